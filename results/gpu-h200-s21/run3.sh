#!/usr/bin/env bash
# device-tool harness, session 21 third call: int8 pools — gpu-check's kernel rows (now with int8) and the int8 sweep
source .gpu/setup.sh > /dev/null
S0=$SECONDS
GPU_CHECK_JSON=$OUT/gpu-check-k.json PYTHON=python3 timeout 120 python3 scripts/gpu_check.py --part kernels,comm --json $OUT/gpu-check-k.json > $OUT/gpu-check-k.log 2>&1
echo "kernels rc=$? in $((SECONDS - S0)) s"; grep -E "int8|FAIL|decode time" $OUT/gpu-check-k.log
S0=$SECONDS
timeout 120 python3 results/gpu-h200-s21/triton_sweep.py --focused --kv int8 --out $OUT/sweep3.jsonl > $OUT/sweep3.log 2>&1
echo "sweep rc=$? in $((SECONDS - S0)) s"; cat $OUT/sweep3.log | cut -c1-200
