"""Collectives per training step: fxshard vs DTensor vs Megatron, without and with sequence parallel.

    .venv/bin/python benchmarks/comm.py

Same model and step as ``benchmarks/step_time.py`` (torch's test Transformer, dim 256, 4 layers,
vocab 1024, batch 4 x 64, fp32, 2 gloo ranks). For each contender, one training step is run
with every collective recorded, split into forward (+ loss), backward and optimizer:

* ``fxshard``: ``fxshard.comm_stats(sm)`` (read from the sharded programs), and the collectives
  actually dispatched at run time, which must agree;
* ``dtensor``: ``torch.distributed.tensor.debug.CommDebugMode`` counts, plus the bytes of the
  same collectives;
* ``megatron``: the analytic count (``benchmarks.megatron.megatron_comm``: 2 all_reduces of
  ``B*T*D*4`` bytes per layer per direction, plus embeddings and head), and without SP the
  hand-written model's collectives at run time (there is no hand-written SP model).

Bytes per collective on one rank = the larger of its input and output buffer (the convention of
``fxshard.comm_stats``). Writes ``benchmarks/results/comm.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import fmt_bytes, machine, table, write_json  # noqa: E402
from benchmarks.step_time import CONFIG  # noqa: E402

KINDS = {
    "all_reduce": "all_reduce", "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "allgather_coalesced_": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
}


def _recorder():
    """A TorchDispatchMode recording every collective (kind, bytes); lets DTensor desugar first."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    def nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(nbytes(y) for y in x)
        return 0

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.table: dict[str, dict[str, int]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor or issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            kind = KINDS.get(func._overloadpacket.__name__) if hasattr(func, "_overloadpacket") else None
            if kind is not None:
                row = self.table.setdefault(kind, {"count": 0, "bytes": 0})
                row["count"] += 1
                row["bytes"] += max([nbytes(a) for a in args] + [nbytes(out)])
            return out

    return Recorder


def _rank_main(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    import fxshard
    from benchmarks.megatron import MegatronTransformer
    from tests.test_plans import torch_transformer_plan

    Recorder = _recorder()
    mesh = fxshard.init_mesh(tp=world)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=cfg["n_layers"], vocab_size=cfg["vocab_size"], dim=cfg["dim"],
                                  max_seq_len=cfg["max_seq_len"], n_heads=cfg["n_heads"], dropout_p=0.0))
    out = {}
    for sp in (False, True):
        mods = {
            "fxshard": fxshard.shard(copy.deepcopy(model), mesh, torch_transformer_plan(sp), example_inputs=(x,)),
            "dtensor": Transformer.parallelize(copy.deepcopy(model), mesh, use_seq_parallel=sp,
                                               local_output_for_attn=True),
        }
        if not sp:
            mods["megatron"] = MegatronTransformer(model, rank, world)
        for name, mod in mods.items():
            opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
            phases, dtensor_counts = {}, {}
            for phase in ("forward", "backward", "optimizer"):
                # CommDebugMode only for DTensor: its module tracker trips over fxshard's GraphModules
                # in the backward (KeyError 'GraphModule'), so the others use the recorder alone.
                rec = Recorder()
                cdm = CommDebugMode() if name == "dtensor" else contextlib.nullcontext()
                with cdm, rec:
                    if phase == "forward":
                        loss = F.cross_entropy(mod(x).flatten(0, 1), y.flatten())
                    elif phase == "backward":
                        loss.backward()
                    else:
                        opt.step()
                        opt.zero_grad()
                phases[phase] = rec.table
                if name == "dtensor":
                    dtensor_counts[phase] = {str(k).split(".")[-1]: v for k, v in cdm.get_comm_counts().items()}
            res = {"runtime": phases, "comm_debug_mode": dtensor_counts}
            if name == "fxshard":
                res["comm_stats"] = fxshard.comm_stats(mod)
            out[f"{name}{'+sp' if sp else ''}"] = res
    return out


def _fmt(table_: dict) -> str:
    return ", ".join(f"{k} {v['count']}x {fmt_bytes(v['bytes'])}" for k, v in sorted(table_.items())) or "-"


def _total(phases: dict) -> tuple[int, int]:
    return (sum(r["count"] for t in phases.values() for r in t.values()),
            sum(r["bytes"] for t in phases.values() for r in t.values()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    from benchmarks import comm as me
    from benchmarks.megatron import megatron_comm
    from tests.dist_utils import run_ranks

    t0 = time.perf_counter()
    res = run_ranks(me._rank_main, 2, CONFIG, timeout=900)
    r0 = res[0]
    cfg = CONFIG
    same_on_ranks = all(r[k]["runtime"] == r0[k]["runtime"] for r in res for k in r0)
    rows, summary = [], {}
    for sp in (False, True):
        suffix = "+sp" if sp else ""
        analytic = megatron_comm(cfg["batch"], cfg["seq"], cfg["dim"], cfg["vocab_size"], cfg["n_layers"], 2, sp)
        analytic["optimizer"] = {}
        entries = [(f"fxshard{suffix}", "comm_stats", {**r0[f"fxshard{suffix}"]["comm_stats"], "optimizer": {}}),
                   (f"fxshard{suffix}", "run time", r0[f"fxshard{suffix}"]["runtime"]),
                   (f"dtensor{suffix}", "run time", r0[f"dtensor{suffix}"]["runtime"])]
        if not sp:
            entries.append(("megatron", "run time", r0["megatron"]["runtime"]))
        entries.append((f"megatron{suffix}", "analytic", analytic))
        for name, how, phases in entries:
            n, b = _total(phases)
            summary[f"{name} ({how})"] = {"phases": phases, "count": n, "bytes": b}
            rows.append([name, how, _fmt(phases["forward"]), _fmt(phases["backward"]), _fmt(phases.get("optimizer", {})),
                         str(n), fmt_bytes(b)])
    print(f"collectives per training step, per rank: torch test Transformer dim {cfg['dim']}, {cfg['n_layers']} "
          f"layers, vocab {cfg['vocab_size']}, batch {cfg['batch']}x{cfg['seq']}, fp32, TP=2 (gloo)")
    print(table(rows, ["contender", "source", "forward (+loss)", "backward", "optimizer", "total n", "total bytes"]))
    print("\nCommDebugMode counts (DTensor):")
    for k in ("dtensor", "dtensor+sp"):
        print(f"  {k}: " + "; ".join(f"{ph} {c}" for ph, c in r0[k]["comm_debug_mode"].items()))
    fx_ok = all(
        {k: v for k, v in r0[k]["comm_stats"].items() if v} == {p: t for p, t in r0[k]["runtime"].items() if t}
        for k in ("fxshard", "fxshard+sp"))
    print(f"\nfxshard.comm_stats equals the collectives dispatched at run time: {fx_ok}; "
          f"same on both ranks: {same_on_ranks}")
    base = summary["megatron (analytic)"]
    for k in ("fxshard (comm_stats)", "dtensor (run time)", "megatron (run time)"):
        print(f"  {k}: {summary[k]['count']} collectives, {summary[k]['bytes'] / base['bytes']:.3f}x Megatron's bytes")
    base_sp = summary["megatron+sp (analytic)"]
    for k in ("fxshard+sp (comm_stats)", "dtensor+sp (run time)"):
        print(f"  {k}: {summary[k]['count']} collectives, {summary[k]['bytes'] / base_sp['bytes']:.3f}x Megatron-SP's bytes")
    wall = time.perf_counter() - t0
    print(f"wall time {wall:.1f} s")
    out = {"config": CONFIG, "machine": machine(), "summary": summary, "raw_rank0": r0,
           "fxshard_comm_stats_matches_runtime": fx_ok, "wall_s": wall}
    print(f"wrote {write_json('comm.json', out)}")
    return out


if __name__ == "__main__":
    main()
