"""Real collectives between 2 ranks on one GPU: ``two_ranks_one_gpu.py`` under torchrun (NCCL, one host id
per rank; see that file), tensor-parallel Llama training against eager, loss and every gradient."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.dist_utils import find_free_port

pytestmark = pytest.mark.gpu

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_ranks_one_gpu.py")
TIMEOUT_S = 110  # under gpu_check's limit for this part, so that a hang ends here, with the ranks' output


def _run_torchrun(log) -> int:
    """torchrun with 2 ranks of SCRIPT, its output streamed to ``log``; on a timeout (or ^C) torchrun gets
    SIGTERM, which it passes on to the ranks (they run in their own sessions), then SIGKILL."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(find_free_port()), SCRIPT]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        return proc.wait(timeout=TIMEOUT_S)
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def test_two_ranks_on_one_gpu_train_like_eager():
    with tempfile.TemporaryFile("w+") as log:
        try:
            rc = _run_torchrun(log)
        finally:
            log.seek(0)
            out = log.read()
            print(out[-12000:])
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no RESULT line (rc={rc})"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["exchanged"] and result["world"] == 2, result
    cases = {k: v for k, v in result.items() if isinstance(v, dict)}
    assert len(cases) == 4, result
    bad = {k: v for k, v in cases.items() if not v["ok"]}
    assert not bad, bad
    assert rc == 0, rc
