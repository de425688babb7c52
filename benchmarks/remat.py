"""Activation checkpointing: ``shard(..., remat="none" | "layers" | "auto")`` on a 4-layer transformer, 2 gloo ranks.

    .venv/bin/python benchmarks/remat.py [--dim 256] [--seq 128] [--batch 8]

The reference transformer of ``tests/models.py`` (4 layers, Megatron TP plan over 2 ranks) runs one training
step (forward + cross entropy + backward) per policy. Reported per rank (rank 0 shown):

* ``saved``: bytes of the activations the forward saves for the backward, measured with autograd's
  ``saved_tensors_hooks`` (each storage once; parameters and inputs not counted), and
  ``fxshard.memory(sm)["saved"]``, the prediction from the programs;
* ``step peak``: the peak of bytes allocated by ops and still alive during the step (a dispatch
  mode tracking storages, ``tests/test_memory.py::LiveBytes``);
* step time (median of 5 after a warm-up) and the largest gradient difference against ``"none"``.

Writes ``benchmarks/results/remat.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import fmt_bytes, machine, median, table, write_json  # noqa: E402

POLICIES = ("none", "layers", "auto")


def _rank_main(rank: int, world: int, cfg: dict) -> dict:
    import torch

    import fxshard
    from tests import models
    from tests.test_forward_parity import transformer_plan
    from tests.test_memory import LiveBytes
    from tests.test_remat import saved_activation_bytes

    mesh = fxshard.init_mesh(tp=world)
    batch = (models.make_tokens(cfg["batch"], cfg["seq"], cfg["vocab"], seed=0),
             models.make_tokens(cfg["batch"], cfg["seq"], cfg["vocab"], seed=1))
    out, ref_grads = {}, None
    for remat in POLICIES:
        torch.manual_seed(0)
        model = models.TransformerWithLoss(vocab=cfg["vocab"], dim=cfg["dim"], n_heads=cfg["heads"],
                                           n_layers=cfg["layers"], max_seq=cfg["seq"])
        sm = fxshard.shard(model, mesh, transformer_plan(cfg["layers"]), example_inputs=batch, remat=remat,
                           progress=False)
        loss, saved = saved_activation_bytes(sm, *batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in sm.named_parameters()}
        if ref_grads is None:
            ref_grads = grads
        sm.zero_grad(set_to_none=True)
        mode = LiveBytes()
        with mode:
            sm(*batch).backward()
        sm.zero_grad(set_to_none=True)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            sm(*batch).backward()
            times.append(time.perf_counter() - t0)
            sm.zero_grad(set_to_none=True)
        out[remat] = {"saved": saved, "predicted": fxshard.memory(sm)["saved"], "step_peak": mode.peak,
                      "step_s": median(times),
                      "grad_diff": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    from benchmarks import remat as me
    from tests.dist_utils import run_ranks

    cfg = {"dim": args.dim, "seq": args.seq, "batch": args.batch, "vocab": 256, "heads": 8, "layers": 4}
    res = run_ranks(me._rank_main, 2, cfg, timeout=1800)
    r0 = res[0]
    none = r0["none"]
    rows = [[k, fmt_bytes(r["saved"]), fmt_bytes(r["predicted"]), f"{none['saved'] / r['saved']:.2f}x",
             fmt_bytes(r["step_peak"]), f"{none['step_peak'] / r['step_peak']:.2f}x", f"{r['step_s'] * 1e3:.1f}",
             f"{r['grad_diff']:.1e}"] for k, r in r0.items()]
    print(f"4-layer transformer, dim {cfg['dim']}, seq {cfg['seq']}, batch {cfg['batch']}, tp=2 (rank 0)")
    print(table(rows, ["remat", "saved (measured)", "saved (memory())", "saving", "step peak", "saving",
                       "step ms", "max |grad - none|"]))
    path = write_json("remat.json", {"config": cfg, "machine": machine(), "ranks": res})
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
