#!/usr/bin/env bash
# The GPU session's one script: what fxshard does on a CUDA machine, with logs under $OUT (default ./gpu_logs).
#   bash scripts/gpu_check.sh            # on a machine with a GPU and torch installed (no set-up, no network)
# Runs: versions and `import fxshard`; the GPU tests (pytest -m gpu tests/gpu); benchmarks/gpu_step.py at
# Llama-3-8B layer shapes (tp=8 on the fake process group; under torchrun with several GPUs it uses NCCL).
# Each part has its own time limit so one hang cannot eat the others (together under 10 minutes, one device
# call); the exit code is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
rc=0
part() {  # part NAME SECONDS CMD...: run CMD with a time limit, log to $OUT/NAME.log, keep the first failure
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s): $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "   rc=$r in $((SECONDS - t0)) s; last lines:" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log" | sed 's/^/   | /' | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] && [ "$r" -ne 0 ] && rc=$r
  return 0
}
part versions 30 "$PY" -c "import torch, fxshard; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'); print('fxshard', fxshard.__file__)"
part gpu_tests 270 env OMP_NUM_THREADS=4 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --durations=10
part gpu_step 270 "$PY" benchmarks/gpu_step.py --out "$OUT" ${GPU_STEP_ARGS:-}
echo "gpu_check rc=$rc" | tee -a "$OUT/summary.txt"
exit $rc
