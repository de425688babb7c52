#!/usr/bin/env bash
# The GPU session's one script: what fxshard does on a CUDA machine, with logs under $OUT (default ./gpu_logs).
#   bash scripts/gpu_check.sh                     # on a machine with a GPU and torch installed (no set-up, no network)
#   PARTS="two_ranks gpu_step" bash scripts/gpu_check.sh   # a rerun of some parts only
# Parts: versions and `import fxshard`; the GPU tests (pytest -m gpu tests/gpu) but the two-rank one; the
# two-rank test (2 processes sharing the GPU, NCCL); benchmarks/gpu_step.py at Llama-3-8B layer shapes (tp=8
# on the fake process group; under torchrun with several GPUs it uses NCCL). Each part has its own time limit
# (565 s together, one device call) so one hang cannot eat the others; at its limit a part gets SIGINT, so
# pytest still prints what failed (and faulthandler dumps the stacks of a test that runs over 60 s). The exit
# code is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PARTS=${PARTS:-versions gpu_tests two_ranks gpu_step}
export PYTHONUNBUFFERED=1
rc=0
part() {  # part NAME SECONDS CMD...: run CMD with a time limit, log to $OUT/NAME.log, keep the first failure
  local name=$1 secs=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name (limit ${secs}s): $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout -s INT -k 20 "$secs" "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "   rc=$r in $((SECONDS - t0)) s; last lines:" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log" | sed 's/^/   | /' | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] && [ "$r" -ne 0 ] && rc=$r
  return 0
}
PYTEST=("$PY" -m pytest -q -rA -p no:cacheprovider -m gpu -o faulthandler_timeout=60 --durations=10)
part versions 45 "$PY" -c "import torch, fxshard; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'); print('fxshard', fxshard.__file__)"
part gpu_tests 160 env OMP_NUM_THREADS=4 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_two_ranks.py
part two_ranks 130 "${PYTEST[@]}" tests/gpu/test_two_ranks.py
part gpu_step 230 "$PY" benchmarks/gpu_step.py --out "$OUT" --budget-s 150 ${GPU_STEP_ARGS:-}
echo "gpu_check rc=$rc" | tee -a "$OUT/summary.txt"
exit $rc
