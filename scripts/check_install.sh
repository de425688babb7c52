#!/usr/bin/env bash
# CI: what `pip install fxshard` gives a user. A virtual environment (.venv-install) holding only the pinned CPU
# torch gets `pip install .` alone (no extras), then runs the README's quickstart on 2 ranks (torchrun) and plans
# a dp x tp mesh with the default (MILP) planner (`fxshard plan`), so a package the default paths import but
# pyproject.toml does not declare fails here. The torch-only environment is kept between runs and put back
# to exactly that before each install (everything else uninstalled), so a run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
V=.venv-install
PIP=(env PIP_DISABLE_PIP_VERSION_CHECK=1 "$V/bin/python" -m pip -q)
if [ ! -f "$V/torch-only.txt" ]; then
  rm -rf "$V"
  "$PY" -m venv "$V"
  "${PIP[@]}" install "torch==2.13.0"  # unpinned torch would pull a multi-GB CUDA build
  "${PIP[@]}" freeze --all > "$V/torch-only.txt"
fi
extra=$("${PIP[@]}" freeze --all | grep -vxF -f "$V/torch-only.txt" | sed 's/[=@ ].*//' || true)
[ -z "$extra" ] || "${PIP[@]}" uninstall -y $extra
"${PIP[@]}" install --no-cache-dir . > "$V/install.log" 2>&1 \
  || { grep -v "^WARNING: Location" "$V/install.log"; echo "check_install: pip install . failed" >&2; exit 1; }
"$V/bin/python" -c "import fxshard, importlib.metadata as m; print('check_install: fxshard', m.version('fxshard'), 'installed with', ', '.join(sorted(r.split(';')[0] for r in m.requires('fxshard') if 'extra ==' not in r)))"
# run outside the checkout so that the installed package, not ./fxshard, is imported
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp examples/quickstart.py examples/data_parallel.py "$work"/
cd "$work"
run2() { OMP_NUM_THREADS=1 "$OLDPWD/$V/bin/torchrun" --standalone --nproc-per-node 2 "$1" > "$1.out" 2>&1 \
           || { cat "$1.out"; echo "check_install: $1 failed on 2 ranks" >&2; exit 1; }; }
run2 quickstart.py
run2 data_parallel.py
# the default planner's MILP (scipy) on a plan it cannot certify greedily, on torch's fake process group
# (expecttest), and the console script
OMP_NUM_THREADS=1 "$OLDPWD/$V/bin/python" - <<'PY'
import torch, torch.nn as nn, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import fxshard
from fxshard import P
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = dist.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
model = fxshard.loss_parallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)), nn.functional.mse_loss)
x, y = torch.randn(32, 64), torch.randn(32, 64)
import warnings; warnings.simplefilter("ignore")
fxshard.shard(model, mesh, {}, example_inputs=(x, y), in_specs=(P("dp"), P("dp")), planner="global", progress=False)
PY
"$OLDPWD/$V/bin/fxshard" plan --help > /dev/null
echo "check_install: OK (pip install . alone: the quickstart and data_parallel examples on 2 ranks, the global planner)"
