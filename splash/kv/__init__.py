"""Paged latent KV cache: a pure block manager, quantisation and the per-layer torch pools."""
