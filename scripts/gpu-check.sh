#!/usr/bin/env bash
# One prepared check of a GPU machine (NVIDIA or AMD/Hygon), < 8 minutes, after the README's GPU install line
# `pip install -e '.[cuda,gpu-check]'` (or '.[hip,gpu-check]' + AITER; [gpu-check] brings httpx and mpirun):
#   scripts/gpu-check.sh                  # every GPU this machine has (mpirun -n N when N > 1)
#   scripts/gpu-check.sh --ranks 1        # one GPU
#   scripts/gpu-check.sh --dry-run        # CPU only, tiny shapes: what CI runs (tests/test_gpu_check.py)
# Checks (scripts/gpu_check.py): each GPU attention kernel and the torch.distributed communicator against the torch
# reference, decode attention time against the HBM-bandwidth floor, and a splash-serve smoke test on N ranks with
# every layout pinned and live switches between them. Prints each row as it ends, then the PASS/FAIL/SKIP table
# (rows also in gpu-check.json, or $GPU_CHECK_JSON); exit 0 only on PASS.
# Other flags go to scripts/gpu_check.py (--device, --hbm-gbs, --batch, --context); see --help there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MPIRUN=${MPIRUN:-$(command -v mpirun || command -v mpiexec || echo "")}
LIMIT_S=${GPU_CHECK_TIMEOUT_S:-470}
JSON=${GPU_CHECK_JSON:-gpu-check.json}   # every row of both halves (PASS/FAIL/SKIP/info), appended as they end

ranks="" dry=0 rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="${2:-}"; shift 2 || { echo "gpu-check: --ranks needs a number" >&2; exit 2; } ;;
    --ranks=*) ranks="${1#--ranks=}"; shift ;;
    --dry-run) dry=1; rest+=("$1"); shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) rest+=("$1"); shift ;;
  esac
done
if [ -n "$ranks" ] && ! [[ "$ranks" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu-check: --ranks must be a positive integer, got '$ranks'" >&2; exit 2
fi
if [ "$dry" = 0 ]; then
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__)')
  if [ "${gpus%% *}" = 0 ]; then
    echo "gpu-check: no GPU visible to torch (${gpus#* }); use --dry-run on CPU" >&2; exit 2
  fi
  [ -z "$ranks" ] && ranks=${gpus%% *}
fi
[ -z "$ranks" ] && ranks=1
if [ "$ranks" -gt 1 ] && [ -z "$MPIRUN" ]; then
  echo "gpu-check: $ranks GPUs but no mpirun/mpiexec on PATH (set MPIRUN)" >&2; exit 2
fi

status=0
rm -f "$JSON"
echo "== gpu-check: $ranks rank(s), $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda" if torch.version.cuda else "hip" if torch.version.hip else "cpu")')"
if [ "$ranks" -gt 1 ]; then
  timeout "$LIMIT_S" "$MPIRUN" -n "$ranks" "$PY" scripts/gpu_check.py --part kernels,comm --json "$JSON" \
    "${rest[@]}" || status=1
else
  timeout "$LIMIT_S" "$PY" scripts/gpu_check.py --part kernels,comm --json "$JSON" "${rest[@]}" || status=1
fi
left=$(( LIMIT_S - SECONDS )); [ "$left" -lt 30 ] && left=30   # one budget for both halves
timeout "$left" "$PY" scripts/gpu_check.py --part serve --ranks "$ranks" --json "$JSON" "${rest[@]}" || status=1
echo; echo "== gpu-check: both halves (rows in $JSON)"
if [ -s "$JSON" ]; then "$PY" scripts/gpu_check.py --summary "$JSON" || status=1; else status=1; fi
echo "== gpu-check: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
