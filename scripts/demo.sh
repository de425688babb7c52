#!/usr/bin/env bash
# Sets up, then runs the main job: 2-rank CPU tensor-parallel training with parity against the unsharded model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 examples/toy_tp_train.py
