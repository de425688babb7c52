"""Auto-sharding at Llama-3 scale: the plan ``shard(auto=True, memory_budget=...)`` finds from nothing
but ``in_specs=P("dp")``, next to the hand Megatron TP + DDP plan.

    .venv/bin/python benchmarks/auto_at_scale.py [--model 8b] [--dp 8 --tp 8] [--layers 1]
                                                 [--batch 16 --seq 1024] [--budget 8GiB]

Both are sharded on the fake process group (``benchmarks/comm_at_scale.py``'s model builder and
Megatron plan); printed: shard() time, the auto report (chosen entries, memory estimate), the
per-rank memory report (``fxshard.memory``, AdamW) of both, and their collective bytes (comm_stats'
convention) and ring wire bytes with the ratio auto / hand.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _totals(sm, sizes: dict[str, int]) -> tuple[int, float]:
    from benchmarks.comm_at_scale import wire
    from fxshard.report.inspect import collectives

    nbytes, w = 0, 0.0
    for prog in sm.sharding.programs:
        for c in collectives(prog):
            nbytes += int(c["bytes"])
            w += wire(c["kind"], c["bytes"], sizes[c["axis"]])
    return nbytes, w


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="8b")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget", default="8GiB")
    args = ap.parse_args(argv)
    import torch

    import fxshard
    from benchmarks.comm_at_scale import DECODER, build, megatron_plan
    from tests.conftest import fake_world

    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long)
    sizes = {"dp": args.dp, "tp": args.tp}
    out = {}
    with fake_world(args.dp * args.tp, shape=(args.dp, args.tp), names=("dp", "tp")) as mesh:
        for name, plan, kw in (("hand", megatron_plan(DECODER), {}),
                               ("auto", {}, {"auto": True, "memory_budget": args.budget})):
            m = build(args.model, args.layers, args.seq, "decoder")
            t0 = time.perf_counter()
            sm = fxshard.shard(m, mesh, plan, example_inputs=(tokens, tokens), in_specs=(fxshard.P("dp"), fxshard.P("dp")),
                               progress=False, **kw)
            secs = time.perf_counter() - t0
            mem = fxshard.memory(sm, "adamw")
            nbytes, w = _totals(sm, sizes)
            out[name] = {"shard_s": secs, "bytes": nbytes, "wire": w, "memory": mem}
            print(f"{name}: shard() {secs:.1f} s; collective bytes {nbytes / 2**20:,.1f} MiB, wire {w / 2**20:,.1f} MiB; "
                  f"memory {', '.join(f'{k} {v / 2**30:.2f} GiB' for k, v in mem.items())}", flush=True)
            if sm.sharding.auto is not None:
                print("\n".join(sm.sharding.auto.lines()), flush=True)
            print(fxshard.comm_stats(sm), flush=True)
    print(f"auto / hand: bytes {out['auto']['bytes'] / out['hand']['bytes']:.3f}, "
          f"wire {out['auto']['wire'] / out['hand']['wire']:.3f}")
    return out


if __name__ == "__main__":
    main()
