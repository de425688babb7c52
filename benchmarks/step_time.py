"""Training step time on 2 gloo ranks: fxshard vs DTensor ``parallelize_module`` vs hand-written Megatron TP.

    .venv/bin/python benchmarks/step_time.py [--rounds 30] [--steps 4] [--profile]

Model: torch's test Transformer (``common_dtensor.Transformer``; dim 256, 8 heads, 4 layers,
vocab 1024, max_seq_len 64, dropout 0, tied embedding/head), batch 4 x 64 tokens, fp32.
One step = forward + cross entropy + backward + AdamW step + zero_grad.

Contenders, all built from the same initial weights on every rank:
* ``fxshard``  — ``fxshard.shard(model, mesh, tests.test_plans.torch_transformer_plan(False))``;
* ``dtensor``  — ``Transformer.parallelize(model, mesh, use_seq_parallel=False, local_output_for_attn=True)``
  (the same plan; ``local_output_for_attn`` because DTensor has no sharding rule for CPU's fused
  attention op ``_scaled_dot_product_flash_attention_for_cpu``, so attention runs on local
  tensors with the local head count, as torchtitan does);
* ``megatron`` — ``benchmarks/megatron.py``: weights sliced by hand, explicit all_reduces.

Method: the first 3 steps of each contender are warm-up and a parity check (their losses
must agree). Then ``--rounds`` rounds; each round runs every contender for ``--steps``
steps, in an order rotated each round, after a barrier; a round's value is the mean step
time of that block (the slower rank's). Reported: median over rounds per contender, and
ratios as the median of the per-round ratios. Writes ``benchmarks/results/step_time.json``.
``--profile`` additionally profiles a few steps of fxshard and Megatron with torch.profiler
and prints the top ops by self CPU time (rank 0).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import interleaved, machine, median, ratio_median, table, write_json  # noqa: E402

CONFIG = dict(dim=256, n_heads=8, n_layers=4, vocab_size=1024, max_seq_len=64, batch=4, seq=64)
CONTENDERS = ("fxshard", "dtensor", "megatron")
PARITY_STEPS = 3


def _build(name: str, mesh, cfg: dict):
    """(module, AdamW) for one contender; every rank builds the same full model from seed 0 first."""
    import torch
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    import fxshard
    from benchmarks.megatron import MegatronTransformer
    from tests.test_plans import torch_transformer_plan

    torch.manual_seed(0)
    args = ModelArgs(n_layers=cfg["n_layers"], vocab_size=cfg["vocab_size"], max_seq_len=cfg["max_seq_len"],
                     dim=cfg["dim"], n_heads=cfg["n_heads"], dropout_p=0.0)
    model = Transformer(args)
    if name == "fxshard":
        example = torch.zeros(cfg["batch"], cfg["seq"], dtype=torch.long)
        mod = fxshard.shard(model, mesh, torch_transformer_plan(False), example_inputs=(example,))
    elif name == "dtensor":
        # local_output_for_attn: DTensor has no sharding rule for CPU's fused SDPA
        # (aten._scaled_dot_product_flash_attention_for_cpu), so wq/wk/wv hand local tensors to the
        # attention with a local head count, as torchtitan does; the layout is the same plan.
        mod = Transformer.parallelize(copy.deepcopy(model), mesh, use_seq_parallel=False, local_output_for_attn=True)
    else:
        mod = MegatronTransformer(model, mesh.get_local_rank(), mesh.size())
    return mod, torch.optim.AdamW(mod.parameters(), lr=1e-3)


def _rank_main(rank: int, world: int, cfg: dict, rounds: int, steps: int, profile: bool) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fxshard

    mesh = fxshard.init_mesh(tp=world)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g),
                torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g)) for _ in range(8)]
    built, build_s = {}, {}
    for name in CONTENDERS:
        t0 = time.perf_counter()
        built[name] = _build(name, mesh, cfg)
        build_s[name] = time.perf_counter() - t0

    counters = {n: 0 for n in CONTENDERS}

    def step(name: str) -> float:
        mod, opt = built[name]
        x, y = batches[counters[name] % len(batches)]
        counters[name] += 1
        loss = F.cross_entropy(mod(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    parity = {n: [step(n) for _ in range(PARITY_STEPS)] for n in CONTENDERS}

    def timed(name: str):
        def run() -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(name)
            return (time.perf_counter() - t0) / steps
        return run

    times = interleaved({n: timed(n) for n in CONTENDERS}, rounds)
    prof_tables = {}
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        for name in ("fxshard", "megatron", "dtensor"):
            with tprofile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(steps):
                    step(name)
            prof_tables[name] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                                        max_name_column_width=60)
    return {"times": times, "parity": parity, "build_s": build_s, "profile": prof_tables}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4, help="steps per contender per round")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-json", action="store_true", help="do not write benchmarks/results/step_time.json")
    a = ap.parse_args(argv)

    from benchmarks import step_time as me  # so the ranks import the function by module name
    from tests.dist_utils import run_ranks

    t0 = time.perf_counter()
    info = machine()
    res = run_ranks(me._rank_main, 2, CONFIG, a.rounds, a.steps, a.profile, timeout=1800)
    wall = time.perf_counter() - t0
    # a round's value: the slower rank's mean step time in that block
    per_round = {n: [max(r["times"][n][i] for r in res) for i in range(a.rounds)] for n in CONTENDERS}
    med = {n: median(v) for n, v in per_round.items()}
    ratios = {
        "fxshard/dtensor": ratio_median(per_round["fxshard"], per_round["dtensor"]),
        "fxshard/megatron": ratio_median(per_round["fxshard"], per_round["megatron"]),
        "dtensor/megatron": ratio_median(per_round["dtensor"], per_round["megatron"]),
    }
    parity = res[0]["parity"]
    parity_err = max(abs(a_ - b_) for n in CONTENDERS for a_, b_ in zip(parity[n], parity["megatron"]))

    cfg = CONFIG
    print(f"torch test Transformer: dim {cfg['dim']}, {cfg['n_heads']} heads, {cfg['n_layers']} layers, vocab "
          f"{cfg['vocab_size']}, batch {cfg['batch']}x{cfg['seq']}, fp32; 2 gloo ranks (1 thread each); "
          f"{a.rounds} rounds x {a.steps} steps per contender, interleaved")
    rows = []
    for n in CONTENDERS:
        v = sorted(per_round[n])
        q1, q3 = v[len(v) // 4], v[(3 * len(v)) // 4]
        rows.append([n, f"{med[n] * 1e3:.1f}", f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}", f"{min(v) * 1e3:.1f}",
                     f"{med[n] / med['megatron']:.2f}x", f"{res[0]['build_s'][n]:.1f}"])
    print(table(rows, ["contender", "median ms/step", "IQR ms", "min ms", "vs megatron", "setup s"]))
    print("ratios (median of per-round ratios): " + ", ".join(f"{k} = {v:.3f}" for k, v in ratios.items()))
    print(f"parity: losses of the first {PARITY_STEPS} steps agree within {parity_err:.2e} "
          f"(megatron: {', '.join(f'{x:.5f}' for x in parity['megatron'])})")
    for name, txt in res[0]["profile"].items():
        print(f"\n--- torch.profiler, rank 0, {a.steps} steps of {name} ---\n{txt}")
    print(f"wall time {wall:.1f} s")
    out = {"config": CONFIG, "contenders": list(CONTENDERS), "rounds": a.rounds, "steps_per_round": a.steps,
           "machine": info,
           "median_s": med, "per_round_s": per_round, "ratios": ratios, "parity_max_loss_diff": parity_err,
           "setup_s": res[0]["build_s"], "wall_s": wall}
    if not a.no_json:
        print(f"wrote {write_json('step_time.json', out)}")
    return out


if __name__ == "__main__":
    main()
