"""CUDA backend (NVIDIA): NCCL collectives through torch.distributed (splash.distributed) and FlashInfer MLA
attention (`backends.cuda.flashinfer_mla`: BatchMLAPagedAttentionWrapper on SM90, trtllm-gen MLA decode on
SM100), with our Triton kernel as the fallback. Importing this package imports nothing from flashinfer or triton;
the kernel module does, when `parallel.attention_backend: flashinfer` asks for it. Install: pip install
'splash[cuda]'. Run on one H200 at one rank (the SM90 wrapper, bf16 and fp8); never on several GPUs or SM100
(docs/backends.md)."""
