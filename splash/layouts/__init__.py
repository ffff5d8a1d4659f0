"""Attention layouts as data: the ownership model (who holds projections and KV) and its memory model. No torch."""
