#!/usr/bin/env bash
# device-tool harness (not part of the product): install the carried packages, then scripts/gpu-check.sh
source .gpu/setup.sh
python3 - <<'PY'
import sys, torch, triton, flashinfer, mpi4py, xgrammar, fastapi
from mpi4py import MPI
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "flashinfer", flashinfer.__version__, "mpi4py", mpi4py.__version__, MPI.Get_library_version()[:14],
      torch.cuda.get_device_name(), torch.cuda.get_device_capability())
PY
GPU_CHECK_JSON=$OUT/gpu-check.json PYTHON=python3 GPU_CHECK_TIMEOUT_S=${1:-400} scripts/gpu-check.sh --ranks 1 2>&1 | tee $OUT/gpu-check.log
echo "rc=${PIPESTATUS[0]}"
