"""Real collectives between 2 ranks on one GPU: ``two_ranks_one_gpu.py`` under torchrun (NCCL, one host id
per rank; see that file), tensor-parallel Llama training against eager, loss and every gradient."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import find_free_port

pytestmark = pytest.mark.gpu

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_ranks_one_gpu.py")


def test_two_ranks_on_one_gpu_train_like_eager():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(find_free_port()), SCRIPT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    print(proc.stdout[-4000:], proc.stderr[-8000:], sep="\n")
    assert lines, f"no RESULT line (rc={proc.returncode})"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["exchanged"] and result["world"] == 2, result
    cases = {k: v for k, v in result.items() if isinstance(v, dict)}
    assert len(cases) == 4, result
    bad = {k: v for k, v in cases.items() if not v["ok"]}
    assert not bad, bad
    assert proc.returncode == 0, proc.returncode
