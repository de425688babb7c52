#!/usr/bin/env bash
# Runs the torch-version core of the suite on a given python (e.g. one with another torch of the supported
# window, pyproject's dependencies), one file at a time, from this checkout (its fxshard, not an installed one).
#   scripts/check_torch_window.sh /path/to/venv/bin/python [test files...]
# Prints one line per file (PASS/FAIL, seconds); exits non-zero when any file fails or collects nothing.
# With no files named and a torch built with CUDA, it also runs scripts/check_cuda_trace.py (CUDA traces, no GPU).
# Needs pytest, expecttest, hypothesis, numpy, scipy, safetensors and transformers on that python.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${1:?usage: scripts/check_torch_window.sh PYTHON [test files...]}"
shift
files=("$@")
if [ "${#files[@]}" -eq 0 ]; then
  files=(tests/test_torch_compat.py tests/test_rules.py tests/test_passes.py tests/test_custom_gradients.py tests/test_training.py
         tests/test_forward_parity.py tests/test_hf_plans.py tests/test_compile.py tests/test_attention.py
         tests/test_mixed_precision.py tests/test_packed.py tests/test_eager_branches.py tests/test_hf_zoo.py
         tests/test_fsdp2.py)
fi
"$py" -c "import torch, fxshard; print('torch', torch.__version__, '| fxshard from', fxshard.__file__)" || exit 1
failed=0
log="/tmp/check_torch_window.$$.log"
check() {  # check NAME CMD...: run CMD with this checkout first on the path, print PASS or FAIL with its log's tail
  local name=$1 start=$SECONDS; shift
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FXSHARD_VERIFY=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    timeout "${FILE_TIMEOUT:-1800}" "$@" > "$log" 2>&1
  local rc=$? secs=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    echo "PASS $name (${secs}s): $(tail -n 1 "$log")"
  else
    failed=1
    echo "FAIL $name (rc=$rc, ${secs}s):"
    tail -n 40 "$log" | sed 's/^/    /'
  fi
}
for f in "${files[@]}"; do
  check "$f" "$py" -m pytest -q -p no:cacheprovider -x "$f"
done
if [ "$#" -eq 0 ] && "$py" -c "import sys, torch; sys.exit(not torch.backends.cuda.is_built())"; then
  # a CUDA build (a GPU machine's wheel, here or there): what fxshard traces on CUDA, without a GPU
  check scripts/check_cuda_trace.py "$py" scripts/check_cuda_trace.py
fi
rm -f "$log"
exit "$failed"
