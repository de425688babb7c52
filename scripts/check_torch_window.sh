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
for f in "${files[@]}"; do
  start=$(date +%s)
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FXSHARD_VERIFY=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    timeout "${FILE_TIMEOUT:-1800}" "$py" -m pytest -q -p no:cacheprovider -x "$f" > "/tmp/check_torch_window.$$.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then
    echo "PASS $f (${secs}s): $(tail -n 1 "/tmp/check_torch_window.$$.log")"
  else
    failed=1
    echo "FAIL $f (rc=$rc, ${secs}s):"
    tail -n 40 "/tmp/check_torch_window.$$.log" | sed 's/^/    /'
  fi
done
rm -f "/tmp/check_torch_window.$$.log"
if [ "$#" -eq 0 ] && "$py" -c "import sys, torch; sys.exit(not torch.backends.cuda.is_built())"; then
  # a CUDA build (a GPU machine's wheel, here or there): what fxshard traces on CUDA, without a GPU
  if FXSHARD_VERIFY=1 "$py" scripts/check_cuda_trace.py > "/tmp/check_cuda_trace.$$.log" 2>&1; then
    echo "PASS scripts/check_cuda_trace.py: $(tail -n 1 "/tmp/check_cuda_trace.$$.log")"
  else
    failed=1
    echo "FAIL scripts/check_cuda_trace.py:"
    tail -n 40 "/tmp/check_cuda_trace.$$.log" | sed 's/^/    /'
  fi
  rm -f "/tmp/check_cuda_trace.$$.log"
fi
exit "$failed"
