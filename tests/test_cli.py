"""The ``fxshard`` command line: plan and demo paths, exit codes, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "fxshard", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_plan_tiny_llama_prints_exact_shard_bytes_and_collectives():
    from tests.models import LlamaDecoder

    r = run("plan", "examples.llama_shapes:llama_tiny", "--mesh", "dp=2,tp=2", "--plan", "examples.llama_shapes:PLAN",
            "--batch", "4", "--seq", "16")
    assert r.returncode == 0, r.stderr
    model = LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)
    sharded = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "tok_embeddings", "output")
    want = sum(p.numel() * 4 // (2 if any(s in n for s in sharded) else 1) for n, p in model.named_parameters())
    line = next(l for l in r.stdout.splitlines() if l.strip().startswith("params"))
    assert int(line.split()[1].replace(",", "")) == want
    assert "forward   all_reduce" in r.stdout and "needed by:" in r.stdout
    assert "tracing the forward" in r.stderr  # progress


def test_plan_takes_the_inputs_the_builder_returns():
    r = run("plan", "examples.seed004_big_head:planned", "--mesh", "dp=2,tp=2", "--plan",
            "examples.seed004_big_head:PLAN")
    assert r.returncode == 0, r.stderr
    assert "inputs from MODEL: x=[16, 3, 8, 8], target=[16]" in r.stdout, r.stdout
    fwd = next(l for l in r.stdout.splitlines() if l.split()[:2] == ["forward", "all_reduce"])
    assert int(fwd.split("bytes")[1].split()[0].replace(",", "")) < 1000, fwd  # loss parallel: statistics only


def test_plan_bad_mesh_is_one_line_error():
    r = run("plan", "examples.llama_shapes:llama_tiny", "--mesh", "tp=two")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["fxshard: error: --mesh 'tp=two': 'tp=two' is not name=size; "
                                             "write e.g. --mesh dp=64,tp=8"]


def test_plan_bad_model_path_is_one_line_error():
    r = run("plan", "examples.no_such_module:build", "--mesh", "tp=2")
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "cannot import MODEL module 'examples.no_such_module'" in err[0]
    r = run("plan", "examples.llama_shapes:nope", "--mesh", "tp=2")
    assert r.returncode == 2 and "has no attribute 'nope'" in r.stderr


def test_plan_error_from_sharding_is_one_line_and_debug_shows_traceback():
    r = run("plan", "examples.llama_shapes:llama_tiny", "--mesh", "tp=3", "--plan", "examples.llama_shapes:PLAN", "--seq", "16")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    # tp=3 splits the projections unevenly, which is fine, but not the heads: the documented error
    assert lines[-1].startswith("fxshard: error:") and "3 does not divide the" in lines[-1], lines
    r = run("--debug", "plan", "examples.llama_shapes:llama_tiny", "--mesh", "tp=3", "--plan", "examples.llama_shapes:PLAN")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_demo_runs_the_main_job_with_parity():
    r = run("demo", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PARITY" in r.stdout and "all_reduce" in r.stdout


def test_demo_ranks_import_this_checkout_installed_or_not(monkeypatch):
    """torchrun starts the demo's ranks with examples/ as their first path entry: from a checkout that was not
    pip-installed (or beside another installed fxshard) they could not import this fxshard."""
    import fxshard.frontends.cli as cli

    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert cli.demo_command(None) == 0
    (cmd, env), = calls
    assert env["PYTHONPATH"].split(os.pathsep) == [ROOT, "/elsewhere"], env["PYTHONPATH"]
    assert cmd[-1] == os.path.join(ROOT, "examples", "toy_tp_train.py")


def test_plan_auto_completes_an_empty_plan_within_the_budget():
    """Seed 004's 100k-class head needs 781 MiB replicated (parameter, gradient, AdamW state): under a 600 MB
    budget on dp=2 the solver splits it over the classes and the report says so."""
    r = run("plan", "examples.seed004_big_head:planned", "--mesh", "dp=2", "--auto", "--memory-budget", "600MB")
    assert r.returncode == 0, r.stderr
    assert "auto plan: 2 entries chosen by the solver" in r.stdout, r.stdout
    assert "linear.weight: (S(0),)  saves 390.62 MiB per rank" in r.stdout, r.stdout
    r = run("plan", "examples.seed004_big_head:planned", "--mesh", "dp=2", "--auto", "--memory-budget", "1MB")
    assert r.returncode == 2 and "no plan fits; the smallest footprint is at least" in r.stderr, r.stderr


def test_plan_bad_bandwidth_is_one_line_error():
    r = run("plan", "examples.llama_shapes:llama_tiny", "--mesh", "dp=2,tp=2", "--bandwidth", "dp=fast")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("fxshard: error: --bandwidth 'dp=fast': 'dp=fast' is not "
                                                 "name=bytes_per_s; write e.g. --bandwidth dp=25e9,tp=300e9")
    r = run("plan", "examples.llama_shapes:llama_tiny", "--mesh", "dp=2,tp=2", "--bandwidth", "pp=1e9", "--seq", "16")
    assert r.returncode == 2 and "bandwidth names mesh axis 'pp', which the mesh does not have" in r.stderr
