#!/usr/bin/env bash
# device-tool harness, session 21 second call: the focused Triton sweep around the new launch table, then
# gpu-check on 1 rank with it (kernels against torch, decode time, serve and live switches)
source .gpu/setup.sh > /dev/null
S0=$SECONDS
timeout ${SWEEP_S:-170} python3 results/gpu-h200-s21/triton_sweep.py --focused --out $OUT/sweep2.jsonl > $OUT/sweep2.log 2>&1
echo "sweep rc=$? in $((SECONDS - S0)) s"; grep -c us= $OUT/sweep2.log; grep -i error $OUT/sweep2.log | head -3
S0=$SECONDS
GPU_CHECK_JSON=$OUT/gpu-check-r1b.json PYTHON=python3 GPU_CHECK_TIMEOUT_S=${R1_S:-130} scripts/gpu-check.sh --ranks 1 > $OUT/gpu-check-r1b.log 2>&1
echo "ranks 1 rc=$? in $((SECONDS - S0)) s"; grep -E "triton|FAIL|gpu-check:" $OUT/gpu-check-r1b.log | tail -40
