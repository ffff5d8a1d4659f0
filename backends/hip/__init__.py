"""HIP backend (AMD ROCm, Hygon DCU): RCCL collectives (torch's "nccl" backend on a ROCm build of torch) and
AITER MLA decode (`backends.hip.aiter_mla`: `aiter.mla.mla_decode_fwd`) where its head and page constraints
hold, else our Triton kernel. Importing this package imports nothing from aiter or triton. Install: pip install
'splash[hip]' (triton) and AITER from source (not on PyPI; docs/backends.md). Not verified on hardware yet."""
