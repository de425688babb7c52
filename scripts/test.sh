#!/usr/bin/env bash
# Sets up, checks a plain `pip install .` (scripts/check_install.sh), then runs the whole test suite; fails on any failure and when no test ran (pytest exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the whole suite (no arguments, as CI runs it) starts with what `pip install fxshard` alone gives a user
[ "$#" -gt 0 ] || bash scripts/check_install.sh
set +e
# --durations: the slowest tests close the log, so CI shows where the time goes.
FXSHARD_VERIFY=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
rc=$?
set -e
echo "note: the GPU tests (tests/gpu, marker gpu) were deselected: they need CUDA; on a GPU machine run bash scripts/gpu_check.sh"
if [ "$rc" -eq 5 ]; then echo "FAIL: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
