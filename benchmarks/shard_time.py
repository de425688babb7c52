"""Wall time of ``fxshard.shard()`` on meta-device Llama-3-8B-wide models of 2..32 layers, TP=8.

    .venv/bin/python benchmarks/shard_time.py [--rounds 3] [--layers 2 4 8 16 32]

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
STAGES = {  # progress message prefix -> stage name
    "checking the plan": "plan",
    "tracing the forward": "trace forward",
    "tracing forward + backward": "trace joint",
    "sharding the training program": "shard joint",
    "sharding the inference program": "shard inference",
    "allocating local shards": "allocate",
}


def shard_once(n_layers: int, mesh, batch: int = 8, seq: int = 128) -> dict:
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
    sm = fxshard.shard(model, mesh, PLAN, example_inputs=(tokens, tokens), progress=progress)
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
    a = ap.parse_args(argv)

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
