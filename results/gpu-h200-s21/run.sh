#!/usr/bin/env bash
# device-tool harness, session 21 (not part of the product): install the carried packages, then
# gpu-check on 2 ranks sharing the GPU, the Triton launch sweep, gpu-check on 1 rank; each part's output in $OUT
source .gpu/setup.sh
python3 - <<'PY' 2>&1 | tee $OUT/versions.txt
import sys, torch, triton, flashinfer, mpi4py, xgrammar, fastapi
from mpi4py import MPI
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "flashinfer", flashinfer.__version__, "mpi4py", mpi4py.__version__, MPI.Get_library_version()[:14],
      torch.cuda.get_device_name(), torch.cuda.get_device_capability())
PY
S0=$SECONDS
GPU_CHECK_JSON=$OUT/gpu-check-r2.json PYTHON=python3 GPU_CHECK_TIMEOUT_S=${R2_S:-230} scripts/gpu-check.sh --ranks 2 > $OUT/gpu-check-r2.log 2>&1
echo "ranks 2 rc=$? in $((SECONDS - S0)) s"; tail -40 $OUT/gpu-check-r2.log
S0=$SECONDS
timeout ${SWEEP_S:-150} python3 results/gpu-h200-s21/triton_sweep.py --out $OUT/sweep.jsonl --cap-s 55 > $OUT/sweep.log 2>&1
echo "sweep rc=$? in $((SECONDS - S0)) s"; grep -c us= $OUT/sweep.log
S0=$SECONDS
GPU_CHECK_JSON=$OUT/gpu-check-r1.json PYTHON=python3 GPU_CHECK_TIMEOUT_S=${R1_S:-150} scripts/gpu-check.sh --ranks 1 > $OUT/gpu-check-r1.log 2>&1
echo "ranks 1 rc=$? in $((SECONDS - S0)) s"; tail -40 $OUT/gpu-check-r1.log
