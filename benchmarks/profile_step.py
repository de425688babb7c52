"""Where fxshard's training step spends its time versus hand-written Megatron TP (compute only).

    .venv/bin/python benchmarks/profile_step.py [--rounds 16]

Same model, plan and step as ``benchmarks/step_time.py``'s case ``tp2/layers/untied/loss-outside``, but on torch's *fake* process group
(one process acting as rank 0 of 2, one thread): collectives are no-ops, so what is measured is
each contender's local compute and framework overhead without the other rank's noise.

A. Compute-only step time (forward + loss + backward + AdamW), interleaved rounds, medians:
   ``megatron`` (eager, fused kernels), ``fxshard``, both compiled as in ``step_time.py``
   (``megatron-compiled``, ``fxshard-compiled``: inductor, ``fxshard.frontends.backend.INDUCTOR_OPTIONS``), and
   three controls built from the *same* Megatron local program, traced into one joint forward+backward graph with
   ``make_fx`` (collectives stubbed out; AdamW applied to the returned gradients):
   ``megatron-graph``      — no decompositions (fused CPU kernels kept),
   ``megatron-graph-fx``   — fxshard's joint table (``fxshard.tracing.decompositions.joint_decomposition_table()``,
   exactly what ``fxshard.tracing.joint.trace_joint`` uses: core ATen minus the fused kernels that
   have sharding rules, ``FUSED_FORWARD`` + ``FUSED_BACKWARD``),
   ``megatron-graph-core`` — everything to core ATen (``core_aten_decompositions()`` +
   ``decomposition_table()``: what fxshard traced with before issue 7).
   The controls differ only in decompositions, so their gaps are the price of decomposing;
   ``fxshard`` over ``megatron-graph-fx`` is what is left for fxshard itself.
B. Aten ops dispatched per step (fxshard and Megatron).
C. Leave-one-out: ``megatron-graph-core`` with one family of fused ops kept out of the table
   (what keeping each family fused buys).
D. fxshard's own programs: node counts and the ops the decompositions produce.
Writes ``benchmarks/results/profile_step.json``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import interleaved, machine, median, ratio_median, table, write_json  # noqa: E402
from benchmarks.step_time import CASE_PROFILED  # noqa: E402


def _graph_step(mod, opt, decomp, x, y):
    """A step that runs ``mod``'s forward+backward as one make_fx graph, then AdamW on its gradients."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    params = dict(mod.named_parameters())
    names = list(params)

    def lossgrad(p, tokens, targets):
        loss = F.cross_entropy(functional_call(mod, p, (tokens,)).flatten(0, 1), targets.flatten())
        return loss, torch.autograd.grad(loss, [p[n] for n in names])

    gm = make_fx(lossgrad, decomposition_table=decomp)(params, x, y)

    def step():
        loss, grads = gm(params, x, y)
        for n, g in zip(names, grads):
            params[n].grad = g
        opt.step()
        opt.zero_grad()
        return loss.item()

    return gm, step


def _megatron(cfg: dict):
    """The Megatron contender of ``CASE_PROFILED`` (rank 0 of 2) and its AdamW."""
    import torch

    from benchmarks.megatron import MegatronTransformer
    from benchmarks.step_time import make_model

    mod = MegatronTransformer(make_model(cfg, CASE_PROFILED.tied, False), 0, 2,
                              shard_vocab=CASE_PROFILED.plan == "full")
    return mod, torch.optim.AdamW(mod.parameters(), lr=1e-3)


class _OpCounter:
    """Counts aten ops dispatched (a TorchDispatchMode, so fused and decomposed ops are both seen)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[str(func.overloadpacket.__name__)] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    a = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._decomp import core_aten_decompositions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import benchmarks.megatron as meg
    from benchmarks.step_time import CONFIG, build
    from fxshard.tracing.decompositions import decomposition_table, joint_decomposition_table

    t_start = time.perf_counter()
    info = machine()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        cfg = CONFIG
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g)
        y = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g)

        steps = {}
        mods = {}
        example = (torch.zeros_like(x), torch.zeros_like(y))
        for name in ("megatron", "fxshard", "megatron-compiled", "fxshard-compiled"):
            step, mods[name] = build(name, CASE_PROFILED, mesh, cfg, example)
            steps[name] = lambda step=step: step(x, y).item()

        # The controls: Megatron's local program as one traced graph. On the fake group the collectives
        # are no-ops; for tracing they are stubbed with ops of the same shapes.
        real_ar, real_ag = meg.dist.all_reduce, meg.dist.all_gather_into_tensor
        meg.dist.all_reduce = lambda t, *args, **kw: None
        meg.dist.all_gather_into_tensor = lambda out, t, *args, **kw: out.copy_(torch.cat([t] * 2, 0))
        core = dict(core_aten_decompositions())
        core.update(decomposition_table())
        graphs = {}
        try:
            for name, table_ in (("megatron-graph", {}), ("megatron-graph-fx", joint_decomposition_table()),
                                 ("megatron-graph-core", core)):
                mod, opt = _megatron(cfg)
                graphs[name], steps[name] = _graph_step(mod, opt, table_, x, y)
            aten = torch.ops.aten
            families = {
                "attention (SDPA fwd+bwd)": [aten._scaled_dot_product_flash_attention_for_cpu.default,
                                             aten.scaled_dot_product_attention.default],
                "layer_norm backward": [aten.native_layer_norm_backward.default],
                "gelu backward": [aten.gelu_backward.default],
                "log_softmax + nll (loss)": [aten._log_softmax.default, aten._log_softmax_backward_data.default,
                                             aten.nll_loss_forward.default, aten.nll_loss_backward.default],
                "embedding backward": [aten.embedding_dense_backward.default],
            }
            loo_steps = {"megatron-graph": steps["megatron-graph"], "megatron-graph-core": steps["megatron-graph-core"]}
            for fam, ops in families.items():
                mod, opt = _megatron(cfg)
                _, loo_steps[f"core, keep {fam}"] = _graph_step(mod, opt, {k: v for k, v in core.items() if k not in ops},
                                                                x, y)
        finally:
            meg.dist.all_reduce, meg.dist.all_gather_into_tensor = real_ar, real_ag

        for s in steps.values():  # warm up
            for _ in range(2):
                s()

        def timed(fn):
            def run() -> float:
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    fn()
                return (time.perf_counter() - t0) / a.steps
            return run

        order = ["megatron", "megatron-graph", "megatron-graph-fx", "megatron-graph-core", "fxshard",
                 "megatron-compiled", "fxshard-compiled"]
        times = interleaved({n: timed(steps[n]) for n in order}, a.rounds)
        med = {n: median(v) for n, v in times.items()}

        for s in loo_steps.values():
            s()
        loo = interleaved({n: timed(s) for n, s in loo_steps.items()}, a.rounds)
        loo_med = {n: median(v) for n, v in loo.items()}

        ops = {}
        for name in ("megatron", "fxshard", "megatron-graph", "megatron-graph-fx", "megatron-graph-core"):
            c = _OpCounter()
            with c.mode:
                steps[name]()
            ops[name] = c.counts

        tr = mods["fxshard"]._training
        prog_nodes = {p.label: collections.Counter(
            str(n.target).replace("aten.", "").rsplit(".", 1)[0] for n in p.gm.graph.nodes if n.op == "call_function")
            for p in (tr.fwd, tr.bwd)}
    finally:
        dist.destroy_process_group()

    print(f"compute only: fake process group (collectives are no-ops), 1 process as rank 0 of 2, 1 thread; "
          f"{a.rounds} rounds x {a.steps} steps, interleaved")
    rows = [[n, f"{med[n] * 1e3:.1f}", f"{ratio_median(times[n], times['megatron']):.2f}x",
             str(sum(ops[n].values())) if n in ops else "-"] for n in order]
    print(table(rows, ["contender", "median ms/step", "vs megatron", "aten ops/step"]))
    decomp_cost = ratio_median(times["megatron-graph-core"], times["megatron-graph"])
    fx_cost = ratio_median(times["megatron-graph-fx"], times["megatron-graph"])
    resid = ratio_median(times["fxshard"], times["megatron-graph-fx"])
    print(f"price of decomposing everything (megatron-graph-core / megatron-graph): {decomp_cost:.2f}x; "
          f"of fxshard's table (megatron-graph-fx / megatron-graph): {fx_cost:.2f}x; "
          f"fxshard / megatron-graph-fx: {resid:.2f}x")

    print(f"\nleave-one-out: megatron-graph-core with one family of fused kernels kept ({len(loo['megatron-graph'])} rounds)")
    core_t = loo["megatron-graph-core"]
    saved = {n: median([c - v for c, v in zip(core_t, loo[n])]) for n in loo}
    rows = [[n, f"{v * 1e3:.1f}", f"{saved[n] * 1e3:+.1f}" if n != "megatron-graph-core" else ""]
            for n, v in loo_med.items()]
    print(table(rows, ["variant", "median ms/step", "saved vs core (median of per-round diffs) ms"]))

    print("\naten ops per step, the largest differences (fxshard - megatron):")
    diff = {k: ops["fxshard"][k] - ops["megatron"][k] for k in set(ops["fxshard"]) | set(ops["megatron"])}
    rows = [[k, ops["fxshard"][k], ops["megatron"][k], f"{d:+d}"]
            for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:16]]
    print(table(rows, ["op", "fxshard", "megatron", "diff"]))

    print("\nfxshard's sharded programs (call_function nodes):")
    for label, c in prog_nodes.items():
        print(f"  {label}: {sum(c.values())} nodes; " + ", ".join(f"{k} {v}" for k, v in c.most_common(14)))
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.1f} s")
    out = {"config": CONFIG, "machine": info, "rounds": a.rounds, "steps_per_round": a.steps,
           "median_s": med, "per_round_s": times, "leave_one_out_median_s": loo_med, "leave_one_out_saved_s": saved,
           "decomposition_cost_ratio": decomp_cost, "fx_table_cost_ratio": fx_cost, "fxshard_over_graph_fx": resid,
           "aten_ops_per_step": {k: dict(v) for k, v in ops.items()},
           "fxshard_program_nodes": {k: dict(v) for k, v in prog_nodes.items()}, "wall_s": wall}
    print(f"wrote {write_json('profile_step.json', out)}")
    return out


if __name__ == "__main__":
    main()
