"""Wall time of ``fxshard.shard()``: vs DTensor on seed 000, per phase at 8B x 32 layers, vs depth.

    .venv/bin/python benchmarks/shard_time.py --mode toy [--rounds 5]      # seed 000: fxshard vs DTensor
    .venv/bin/python benchmarks/shard_time.py --mode phases [--rounds 2]   # 8B, 32 layers, per phase
    .venv/bin/python benchmarks/shard_time.py --mode phases --planners greedy greedy/whole global global/whole
    .venv/bin/python benchmarks/shard_time.py [--rounds 3] [--layers 2 4 8 16 32]   # vs depth (default)

    .venv/bin/python benchmarks/shard_time.py --mode hf [--rounds 1] [--archs llama qwen3_5_text qwen3_5_moe_text]

``--mode hf``: tiny Hugging Face causal LMs of ``tests/test_hf_zoo.py`` (``build``: hidden 32, 2 layers, the
hybrid Qwen3.5 models with one gated delta-net linear-attention layer and one full-attention layer), each
sharded for training by its own tensor-parallel plan (``"hf"``) on a 2-rank mesh of the fake process group,
labels passed (the loss inside): per phase as ``--mode phases`` (with ``--planners``), the CPU seconds of this
process (the global planner's MILP runs in a child process and is not in them: its size and seconds are
listed), the joint graph's node count, and whether ``FXSHARD_VERIFY`` is on.

``--mode toy``: seed 000's ToyModel (in 1024, hidden 4096, parameters requiring grad, input
10000 x 1024) with the seed's plan (``net1`` column-wise, ``net2`` row-wise) on a 2-rank mesh of the
fake process group, each contender in a fresh process per round (what a user's script pays once):
after ``import torch`` and the process group, the time to import the library and shard once
(``fxshard.shard`` with the default planner, ``global``, and with ``planner="greedy"``, vs
``parallelize_module``), then a second call in the same process (warm);
wall and CPU (``time.process_time``) seconds.
Ratios are medians of per-round ratios (contenders interleaved, order rotated per round).

``--mode phases``: the 32-layer model below with ``planner="greedy"`` and ``"global"``: total time
and per phase (``torch.export`` + decompositions of the forward, joint trace, each pipeline pass
summed over the training and inference programs, the rest of ``shard()``), wall seconds, and the
CPU seconds of the whole call (``time.process_time``: less sensitive to other jobs on the machine).
``--planners greedy greedy/whole`` adds a contender whose joint graph is traced whole
(``FXSHARD_TRACE_BY_OP=0``) instead of one distinct op at a time, interleaved with the default.

Default (``--mode depth``), with the greedy planner (``planner="greedy"``; the numbers in the README are its):
Model: ``tests.models.LlamaDecoder`` at 8B width (dim 4096, 32 heads, 8 KV heads, MLP 14336,
vocab 128256) built on the meta device (no weights allocated), with the loss inside
(``forward(tokens, targets)``, batch 8 x 128), parameters requiring grad (training: the
joint forward+backward graph is traced and sharded too), the Megatron plan of
``examples/llama_shapes.py``; one process acting as rank 0 of torch's fake process group
of 8 ranks (``tests/conftest.py``), one thread.

Each round shards every depth once, depths in an order rotated per round; reported are
medians over rounds, the time of each stage (from ``shard(progress=...)``), time per layer,
a least-squares line ``t = a + b * layers`` and how far from it each point is, and the
marginal cost per layer between consecutive depths (constant if growth is linear).
Writes ``benchmarks/results/shard_time.json`` and plots ``docs/shard_time.png`` (and
``docs/step_time.png`` when ``benchmarks/results/step_time.json`` exists).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import machine, median, rotated, table, write_json  # noqa: E402

LLAMA8B = dict(vocab=128256, dim=4096, n_heads=32, n_kv_heads=8, hidden=14336, max_seq=2048)
LLAMA70B = dict(vocab=128256, dim=8192, n_heads=64, n_kv_heads=8, hidden=28672, max_seq=2048)
WIDTHS = {"8b": LLAMA8B, "70b": LLAMA70B}
STAGES = {  # progress message prefix -> stage name
    "checking the plan": "plan",
    "tracing the forward": "trace forward",
    "tracing forward + backward": "trace joint",
    "sharding the training program": "shard joint",
    "sharding the inference program": "shard inference",
    "allocating local shards": "allocate",
}


def shard_once(n_layers: int, mesh, batch: int = 8, seq: int = 128, planner: str = "greedy") -> dict:
    """Build the model on meta and shard it; total seconds, seconds per stage, joint graph size."""
    import torch

    import fxshard
    from examples.llama_shapes import PLAN
    from tests.models import LlamaDecoder

    with torch.device("meta"):
        model = LlamaDecoder(n_layers=n_layers, **LLAMA8B)
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    marks: list[tuple[str, float]] = []
    nodes = [0]

    def progress(msg: str) -> None:
        marks.append((msg, time.perf_counter()))
        if msg.startswith("sharding the training program"):
            nodes[0] = int(msg.split("(")[1].split()[0])

    gc.collect()
    t0 = time.perf_counter()
    sm = fxshard.shard(model, mesh, PLAN, example_inputs=(tokens, tokens), progress=progress, planner=planner)
    t1 = time.perf_counter()
    if sm._training is None:
        raise RuntimeError("expected a training module (parameters require grad)")
    stages = {}
    for i, (msg, t) in enumerate(marks):
        end = marks[i + 1][1] if i + 1 < len(marks) else t1
        name = next(v for k, v in STAGES.items() if msg.startswith(k))
        stages[name] = end - t
    del sm, model
    return {"total": t1 - t0, "stages": stages, "joint_nodes": nodes[0]}


TOY_CHILD = r"""
import json, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, ROOT)
torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
t, c = time.perf_counter(), time.process_time()
if WHO.startswith("fxshard"):
    import fxshard
    from fxshard import ColwiseParallel, RowwiseParallel
    def run(m, mesh, plan):
        return fxshard.shard(m, mesh, plan, example_inputs=(torch.rand(10000, 1024),),
                             planner="greedy" if WHO == "fxshard-greedy" else "global")
else:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    def run(m, mesh, plan):
        return parallelize_module(m, mesh, plan)
t_import, c_import = time.perf_counter() - t, time.process_time() - c
from tests.models import ToyModel
mesh = init_device_mesh("cpu", (2,))
out = {"import": t_import, "cpu import": c_import}
for key in ("first", "warm"):
    model, plan = ToyModel(1024, 4096), {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    t, c = time.perf_counter(), time.process_time()
    run(model, mesh, plan)
    out[key], out["cpu " + key] = time.perf_counter() - t, time.process_time() - c
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


def toy_once(who: str) -> dict:
    """Seed 000's ToyModel sharded by ``who`` ("fxshard": the default planner, "fxshard-greedy" or
    "dtensor") in a fresh process; seconds."""
    import json
    import subprocess

    from benchmarks._common import ROOT

    code = f"ROOT = {ROOT!r}; WHO = {who!r}\n" + TOY_CHILD
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if res.returncode or line is None:
        raise RuntimeError(f"{who} child failed:\n{res.stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    out["cold"] = out["import"] + out["first"]
    out["cpu cold"] = out["cpu import"] + out["cpu first"]
    return out


def toy(rounds: int) -> dict:
    """Interleaved rounds of ``toy_once`` for both contenders; medians and median per-round ratios."""
    from benchmarks._common import ratio_median, rotated

    runs: dict[str, list[dict]] = {"fxshard": [], "fxshard-greedy": [], "dtensor": []}
    for r in range(rounds):
        for who in rotated(list(runs), r):
            runs[who].append(toy_once(who))
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{w} import+first {runs[w][-1]['cold']:.2f} s (warm {runs[w][-1]['warm']:.3f})" for w in runs), flush=True)
    keys = ("import", "first", "cold", "warm", "cpu cold", "cpu warm")
    med = {w: {k: median([x[k] for x in runs[w]]) for k in keys} for w in runs}
    ratios = {w: {k: ratio_median([x[k] for x in runs[w]], [x[k] for x in runs["dtensor"]]) for k in keys}
              for w in ("fxshard", "fxshard-greedy")}
    ratio = ratios["fxshard"]
    print(f"seed 000 ToyModel (in 1024, hidden 4096, training), 2-rank fake process group, fresh process per "
          f"contender and round; median of {rounds} rounds; fxshard = the default planner (global)")
    rows = [[w] + [f"{med[w][k]:.3f}" for k in keys] for w in runs] + [
        [f"ratio {w} / dtensor"] + [f"{ratios[w][k]:.2f}" for k in keys] for w in ratios]
    print(table(rows, ["contender", "library import s", "first call s", "import + first s", "warm call s",
                       "import + first CPU s", "warm CPU s"]))
    return {"runs": runs, "median_s": med, "ratio": ratio, "ratio_greedy": ratios["fxshard-greedy"]}


def timed_pipeline(acc: dict[str, float]):
    """``fxshard.passes.pipeline.DEFAULT`` with every pass's wall time added to ``acc[pass name]``."""
    import dataclasses

    from fxshard.passes.pipeline import DEFAULT, Pipeline

    def wrap(p):
        def fn(gm, ctx):
            t = time.perf_counter()
            try:
                return p.fn(gm, ctx)
            finally:
                acc[p.name] = acc.get(p.name, 0.0) + time.perf_counter() - t
        return dataclasses.replace(p, fn=fn)

    return Pipeline(tuple(wrap(p) for p in DEFAULT.passes))


def phases_once(n_layers: int, mesh, planner: str, batch: int = 8, seq: int = 128, width: dict = LLAMA8B,
                in_specs=None) -> dict:
    """Shard the model of ``width`` and ``n_layers`` once; total and per-phase seconds."""
    import torch

    import fxshard
    from examples.llama_shapes import PLAN
    from tests.models import LlamaDecoder

    with torch.device("meta"):
        model = LlamaDecoder(n_layers=n_layers, **width)
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    marks: list[tuple[str, float]] = []
    acc: dict[str, float] = {}
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    fxshard.shard(model, mesh, PLAN, example_inputs=(tokens, tokens), planner=planner, in_specs=in_specs,
                  progress=lambda msg: marks.append((msg, time.perf_counter())), pipeline=timed_pipeline(acc))
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    stage = {}
    for i, (msg, t) in enumerate(marks):
        end = marks[i + 1][1] if i + 1 < len(marks) else t0 + total
        stage[next(v for k, v in STAGES.items() if msg.startswith(k))] = end - t
    out = {"total": total, "export (trace forward)": stage.get("trace forward", 0.0),
           "joint trace": stage.get("trace joint", 0.0)}
    out.update(acc)
    out["other"] = total - sum(v for k, v in out.items() if k != "total")
    out["total CPU (process time)"] = cpu
    return out


def phases(rounds: int, n_layers: int, tp: int, dp: int = 1, width: str = "8b",
           planners: tuple[str, ...] = ("greedy", "global")) -> dict:
    """Interleaved rounds of ``phases_once`` for ``planners``; medians per phase. ``dp > 1``: a ``dp x tp``
    mesh, the batch split over ``dp`` (``in_specs``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks._common import rotated

    from fxshard import P

    planners = list(planners)
    runs: dict[str, list[dict]] = {p: [] for p in planners}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * dp)
    in_specs = (P("dp"), P("dp")) if dp > 1 else None
    try:
        mesh = (init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")) if dp > 1 else
                init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
        phases_once(2, mesh, "greedy", in_specs=in_specs)  # warm-up: first-call imports and caches
        for r in range(rounds):
            for p in rotated(planners, r):
                planner, _, joint = p.partition("/")
                os.environ["FXSHARD_TRACE_BY_OP"] = "0" if joint == "whole" else "1"
                runs[p].append(phases_once(n_layers, mesh, planner, width=WIDTHS[width], batch=8 * dp,
                                           in_specs=in_specs))
                print(f"  round {r + 1}/{rounds}: planner={p} {runs[p][-1]['total']:6.2f} s", flush=True)
    finally:
        os.environ.pop("FXSHARD_TRACE_BY_OP", None)
        dist.destroy_process_group()
    names = list(runs[planners[0]][0])
    med = {p: {k: median([x.get(k, 0.0) for x in runs[p]]) for k in names} for p in planners}
    print(f"fxshard.shard() of the {width.upper()}-wide model, {n_layers} layers, training, "
          f"{f'DP={dp} x ' if dp > 1 else ''}TP={tp} (fake process group); median of {rounds} rounds, seconds")
    print(table([[k] + [f"{med[p][k]:.2f}" for p in planners] for k in names], ["phase"] + planners))
    return {"layers": n_layers, "tp": tp, "dp": dp, "width": width, "rounds": rounds, "runs": runs, "median_s": med}


def hf_once(arch: str, mesh, planner: str) -> dict:
    """Shard ``tests.test_hf_zoo.build(arch)`` once for training with its own plan; seconds per phase, the
    global planner's MILPs (nodes, variables, rows, seconds) and the joint graph's size."""
    import logging

    import fxshard
    from tests.test_hf_zoo import build

    model, kwargs = build(arch)
    marks: list[tuple[str, float]] = []
    acc: dict[str, float] = {}
    milps: list[dict] = []

    class Solves(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if hasattr(record, "fxshard_solve"):
                milps.append(record.fxshard_solve)

    log = logging.getLogger("fxshard.planner.solve")
    handler, level = Solves(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        fxshard.shard(model, mesh, "hf", example_kwargs=kwargs, planner=planner,
                      progress=lambda msg: marks.append((msg, time.perf_counter())), pipeline=timed_pipeline(acc))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    stage, joint_nodes = {}, 0
    for i, (msg, t) in enumerate(marks):
        end = marks[i + 1][1] if i + 1 < len(marks) else t0 + total
        stage[next(v for k, v in STAGES.items() if msg.startswith(k))] = end - t
        if msg.startswith("sharding the training program"):
            joint_nodes = int(msg.split("(")[1].split()[0])
    out = {"total": total, "export (trace forward)": stage.get("trace forward", 0.0),
           "joint trace": stage.get("trace joint", 0.0)}
    out.update(acc)
    out["other"] = total - sum(v for k, v in out.items() if k != "total")
    out["total CPU of this process"] = cpu
    out["MILP seconds (solver process)"] = sum(m.get("seconds", 0.0) for m in milps if not m.get("certified"))
    out["joint nodes"] = float(joint_nodes)
    out["MILP variables (largest)"] = float(max((m.get("variables", 0) for m in milps), default=0))
    return out


def hf(rounds: int, archs: list[str], planners: tuple[str, ...]) -> dict:
    """Interleaved rounds of ``hf_once`` for every (architecture, planner); medians per phase."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks._common import rotated

    contenders = [(a, p) for a in archs for p in planners]
    runs: dict[str, list[dict]] = {f"{a} {p}": [] for a, p in contenders}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        hf_once("llama", mesh, "greedy")  # warm-up: first-call imports and caches
        for r in range(rounds):
            for a, p in rotated(contenders, r):
                planner, _, joint = p.partition("/")
                os.environ["FXSHARD_TRACE_BY_OP"] = "0" if joint == "whole" else "1"
                runs[f"{a} {p}"].append(hf_once(a, mesh, planner))
                print(f"  round {r + 1}/{rounds}: {a} planner={p} {runs[f'{a} {p}'][-1]['total']:6.2f} s", flush=True)
    finally:
        os.environ.pop("FXSHARD_TRACE_BY_OP", None)
        dist.destroy_process_group()
    names = list(next(iter(runs.values()))[0])
    med = {c: {k: median([x.get(k, 0.0) for x in runs[c]]) for k in names} for c in runs}
    verify = os.environ.get("FXSHARD_VERIFY", "0") not in ("", "0")
    print(f"fxshard.shard() of tiny HF models (tests/test_hf_zoo.py build), training, their own TP plan on 2 ranks "
          f"(fake process group), FXSHARD_VERIFY {'on' if verify else 'off'}; median of {rounds} rounds, seconds")
    print(table([[k] + [f"{med[c][k]:.2f}" if "nodes" not in k and "variables" not in k else f"{med[c][k]:.0f}"
                        for c in runs] for k in names], ["phase"] + list(runs)))
    return {"archs": archs, "planners": list(planners), "rounds": rounds, "verify": verify, "runs": runs,
            "median_s": med}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``; returns (a, b, r^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, 1 - ss_res / ss_tot


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--mode", choices=["depth", "toy", "phases", "hf"], default="depth")
    ap.add_argument("--archs", nargs="+", default=["llama", "qwen3_5_text", "qwen3_5_moe_text"],
                    help="--mode hf: architectures of tests/test_hf_zoo.py's ZOO")
    ap.add_argument("--width", choices=sorted(WIDTHS), default="8b", help="--mode phases: Llama-3-8B or -70B shapes")
    ap.add_argument("--dp", type=int, default=1, help="--mode phases: a dp x tp mesh, batch 8 x dp split over dp")
    ap.add_argument("--planners", nargs="+", default=["greedy", "global"],
                    help="--mode phases: contenders, a planner, optionally with '/whole': the joint graph traced "
                         "whole rather than one distinct op at a time (FXSHARD_TRACE_BY_OP=0), for side-by-side runs")
    ap.add_argument("--out", default=None, help="--mode phases: results file name (benchmarks/results/)")
    a = ap.parse_args(argv)
    if a.mode != "depth":
        import torch

        torch.set_num_threads(1)
        info = machine()
        print(f"load average at start: {info['load_avg_at_start']}")
        if a.mode == "toy":
            out = toy(a.rounds)
        elif a.mode == "hf":
            out = hf(a.rounds, a.archs, tuple(a.planners))
        else:
            out = phases(a.rounds, max(a.layers), a.tp, a.dp, a.width, tuple(a.planners))
        out["machine"] = info
        out["load_avg_at_end"] = list(os.getloadavg())
        print(f"load average at end: {out['load_avg_at_end']}")
        print(f"wrote {write_json(a.out or f'shard_time_{a.mode}.json', out)}")
        return out

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    t_start = time.perf_counter()
    info = machine()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.tp)
    runs: dict[int, list[dict]] = {n: [] for n in a.layers}
    try:
        mesh = init_device_mesh("cpu", (a.tp,), mesh_dim_names=("tp",))
        shard_once(2, mesh)  # warm-up: first-call imports and caches
        for r in range(a.rounds):
            for n in rotated(a.layers, r):
                runs[n].append(shard_once(n, mesh))
                print(f"  round {r + 1}/{a.rounds}: {n:>2} layers {runs[n][-1]['total']:6.2f} s", flush=True)
    finally:
        dist.destroy_process_group()

    med = {n: median([x["total"] for x in runs[n]]) for n in a.layers}
    seen = {s for n in a.layers for x in runs[n] for s in x["stages"]}
    stage_names = [s for s in STAGES.values() if s in seen]
    stage_med = {n: {s: median([x["stages"].get(s, 0.0) for x in runs[n]]) for s in stage_names} for n in a.layers}
    a0, b, r2 = fit_line([float(n) for n in a.layers], [med[n] for n in a.layers])
    marginal = {f"{p}->{q}": (med[q] - med[p]) / (q - p) for p, q in zip(a.layers, a.layers[1:])}

    print(f"fxshard.shard() wall time, Llama-8B width (dim 4096, 32 heads / 8 KV, MLP 14336, vocab 128256) on meta, "
          f"training (joint graph), TP={a.tp} on the fake process group; median of {a.rounds} rounds")
    rows = []
    for n in a.layers:
        fit = a0 + b * n
        rows.append([str(n), str(runs[n][0]["joint_nodes"]), f"{med[n]:.2f}", f"{med[n] / n:.3f}",
                     f"{fit:.2f}", f"{(med[n] - fit) / fit * 100:+.1f}%"]
                    + [f"{stage_med[n][s]:.2f}" for s in stage_names])
    print(table(rows, ["layers", "joint nodes", "median s", "s/layer", "fit s", "vs fit"] + stage_names))
    print(f"least squares: t = {a0:.2f} s + {b:.3f} s/layer x layers (r^2 = {r2:.4f})")
    print("marginal s/layer between depths: " + ", ".join(f"{k}: {v:.3f}" for k, v in marginal.items()))
    first, last = list(marginal.values())[0], list(marginal.values())[-1]
    print(f"growth is {'linear' if r2 > 0.99 and last < 1.5 * b else 'NOT linear'}: "
          f"r^2 {r2:.4f}, marginal cost at the deep end {last:.3f} s/layer vs slope {b:.3f} "
          f"(shallow end {first:.3f})")
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.1f} s")
    out = {"model": LLAMA8B, "tp": a.tp, "rounds": a.rounds, "layers": a.layers, "machine": info,
           "median_s": {str(n): med[n] for n in a.layers}, "runs": {str(n): runs[n] for n in a.layers},
           "stages": stage_names, "stage_median_s": {str(n): stage_med[n] for n in a.layers}, "fit": {"a": a0, "b": b, "r2": r2},
           "marginal_s_per_layer": marginal, "wall_s": wall}
    print(f"wrote {write_json('shard_time.json', out)}")
    from benchmarks import plots

    for path in plots.main([]):
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
