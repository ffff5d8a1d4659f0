"""HIP backend (AMD ROCm, Hygon DCU): RCCL collectives (torch's "nccl" backend on a ROCm build of torch) and
AITER MLA decode (`backends.hip.aiter_mla`: `aiter.mla.mla_decode_fwd`) on the archs it ships kernels for and
where its head and page constraints hold, else our Triton kernel (`backends.hip.arch` checks at startup that the
installed Triton compiles for the device). Importing this package imports nothing from aiter or triton. Install:
pip install 'splash[hip]' over a ROCm torch (it keeps that torch's Triton) and AITER from source (not on PyPI;
docs/backends.md). Not verified on hardware yet."""
