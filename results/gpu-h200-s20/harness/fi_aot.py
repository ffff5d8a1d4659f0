import time, torch, sys
from flashinfer.jit import gen_batch_mla_module
for kv in (torch.bfloat16, torch.float8_e4m3fn):
    t = time.time()
    spec = gen_batch_mla_module("fa3", torch.bfloat16, kv, torch.bfloat16, torch.int32, 512, 64, False)
    print("building", spec.name, flush=True)
    spec.build(verbose=False)
    print("built", spec.name, spec.jit_library_path if hasattr(spec, "jit_library_path") else "", time.time() - t, flush=True)
