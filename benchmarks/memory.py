"""Per-rank memory: peak RSS and parameter bytes, fxshard vs DTensor ``parallelize_module``, 2 gloo ranks.

    .venv/bin/python benchmarks/memory.py [--rounds 2]

Scenario ``seed000``: seed 000's ToyModel (in 1024, hidden 4096, 33.6 MB of fp32 parameters)
built in full on every rank, net1 colwise / net2 rowwise, then 3 SGD steps (lr 0.25) on the
seed's batch of 10000 x 1024 with ``out.sum()`` as the loss.

Scenario ``meta+safetensors``: a ToyModel at 4x width (in 4096, hidden 16384, 537 MB) built on
the meta device and filled from a single ``model.safetensors`` file, then 1 SGD step on a
batch of 64. Contenders:
* ``fxshard``: ``fxshard.shard(meta model)`` + ``sm.load_full_state_dict(path)`` (each rank
  reads its slices);
* ``dtensor (DCP HF reader)``: ``parallelize_module`` on meta, ``to_empty``, then
  ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` (reads slices too);
* ``dtensor (rank-0 broadcast)``: the same model, filled with ``set_model_state_dict(...,
  StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` from the full state dict
  that rank 0 loads with ``safetensors.torch.load_file``.
After loading, every rank checks its local shards against the file's slices.

Every (scenario, contender) runs in fresh processes (peak RSS is a per-process high-water
mark), in rounds with the contender order rotated; reported per rank are medians of: the
RSS baseline after importing torch and joining the process group, the peak RSS after
building + sharding (+ loading), its growth over the baseline ("setup"), the peak after the
training steps, and the bytes of the local parameter shards. Writes
``benchmarks/results/memory.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import fmt_bytes, machine, median, rotated, table, write_json  # noqa: E402

SEED000 = dict(in_dim=1024, hidden=4096, batch=10000, steps=3)
BIG = dict(in_dim=4096, hidden=16384, batch=64, steps=1)
CONTENDERS = {
    "seed000": ["fxshard", "dtensor"],
    "meta+safetensors": ["fxshard", "dtensor (DCP HF reader)", "dtensor (rank-0 broadcast)"],
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _rss() -> int:
    return _status("VmRSS")


def _peak_rss() -> int:
    """Peak RSS since the last ``_reset_peak`` (VmHWM; ``getrusage`` cannot be used: under the spawn
    start method its ru_maxrss includes the parent's RSS at fork time, carried over through exec)."""
    return _status("VmHWM")


class _AnonSampler:
    """Samples RssAnon (private memory, without mapped file pages) every ``interval`` s in a thread; ``peak``."""

    def __init__(self, interval: float = 0.001):
        import threading

        self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            self._stop.wait(self._interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))
        return self.peak


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _rank_main(rank: int, world: int, scenario: str, contender: str, ckpt_dir: str) -> dict:
    import gc

    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fxshard
    from tests.models import ToyModel

    mesh = fxshard.init_mesh(tp=world)
    gc.collect()
    _reset_peak()
    base, base_anon = _rss(), _status("RssAnon")
    sampler = _AnonSampler()
    cfg = SEED000 if scenario == "seed000" else BIG
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    x = torch.rand(cfg["batch"], cfg["in_dim"], generator=torch.Generator().manual_seed(0))
    if scenario == "seed000":
        model = ToyModel(cfg["in_dim"], cfg["hidden"])
        if contender == "fxshard":
            mod = fxshard.shard(model, mesh, plan, example_inputs=(x,))
            del model
        else:
            mod = parallelize_module(model, mesh, plan)
    else:
        path = os.path.join(ckpt_dir, "model.safetensors")
        with torch.device("meta"):
            model = ToyModel(cfg["in_dim"], cfg["hidden"])
        if contender == "fxshard":
            mod = fxshard.shard(model, mesh, plan, example_inputs=(x,))
            mod.load_full_state_dict(path)
        else:
            mod = parallelize_module(model, mesh, plan)
            mod.to_empty(device="cpu")
            if contender == "dtensor (DCP HF reader)":
                import torch.distributed.checkpoint as dcp

                sd = mod.state_dict()
                dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(ckpt_dir))
                mod.load_state_dict(sd)
            else:
                from safetensors.torch import load_file
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                full = load_file(path) if rank == 0 else {}
                set_model_state_dict(mod, full, options=StateDictOptions(full_state_dict=True,
                                                                         broadcast_from_rank0=True))
                del full
    gc.collect()
    setup_peak, after_setup = _peak_rss(), _rss()
    setup_anon_peak = sampler.stop()
    _reset_peak()

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = {id(p): p for p in mod.parameters()}.values()
    param_bytes = sum(local(p).numel() * local(p).element_size() for p in params)
    ok = True
    if scenario != "seed000":  # the local shards are this rank's slices of the checkpoint
        from safetensors import safe_open

        n1, n2 = cfg["hidden"] // world, cfg["hidden"] // world
        with safe_open(os.path.join(ckpt_dir, "model.safetensors"), framework="pt") as f:
            want = {"net1.weight": f.get_slice("net1.weight")[rank * n1:(rank + 1) * n1],
                    "net1.bias": f.get_slice("net1.bias")[rank * n1:(rank + 1) * n1],
                    "net2.weight": f.get_slice("net2.weight")[:, rank * n2:(rank + 1) * n2],
                    "net2.bias": f.get_slice("net2.bias")[:]}
        got = {k: local(v).detach() for k, v in mod.state_dict().items()}
        ok = all(torch.equal(got[k], want[k]) for k in want)

    opt = torch.optim.SGD(mod.parameters(), lr=0.25)
    for _ in range(cfg["steps"]):
        out = mod(x)
        local(out).sum().backward()
        opt.step()
        opt.zero_grad()
        del out
    return {"base": base, "setup_peak": setup_peak, "setup_anon_growth": setup_anon_peak - base_anon,
            "after_setup": after_setup, "train_peak": max(setup_peak, _peak_rss()),
            "param_bytes": param_bytes, "slices_ok": ok}


def _write_checkpoint(d: str) -> int:
    from safetensors.torch import save_file

    from tests.models import ToyModel

    sd = {k: v.contiguous() for k, v in ToyModel(BIG["in_dim"], BIG["hidden"]).state_dict().items()}
    save_file(sd, os.path.join(d, "model.safetensors"))
    return sum(v.numel() * v.element_size() for v in sd.values())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    from benchmarks import memory as me
    from tests.dist_utils import run_ranks

    t0 = time.perf_counter()
    info = machine()
    raw: dict[str, dict[str, list]] = {s: {c: [] for c in cs} for s, cs in CONTENDERS.items()}
    with tempfile.TemporaryDirectory() as d:
        ckpt_bytes = _write_checkpoint(d)
        for r in range(a.rounds):
            for s, cs in CONTENDERS.items():
                for c in rotated(cs, r):
                    raw[s][c].append(run_ranks(me._rank_main, 2, s, c, d, timeout=600, fresh=True))
                    print(f"  round {r + 1}/{a.rounds}: {s} / {c} done", flush=True)
    full_small = (2 * SEED000["in_dim"] * SEED000["hidden"] + SEED000["in_dim"] + SEED000["hidden"]) * 4
    summary = {}
    for s, cs in CONTENDERS.items():
        full = full_small if s == "seed000" else ckpt_bytes
        rows = []
        for c in cs:
            for rank in (0, 1):
                runs = [run[rank] for run in raw[s][c]]
                m = {k: median([x[k] for x in runs]) for k in ("base", "setup_peak", "train_peak", "after_setup",
                                                               "param_bytes", "setup_anon_growth")}
                m["setup_growth"] = median([x["setup_peak"] - x["base"] for x in runs])
                m["slices_ok"] = all(x["slices_ok"] for x in runs)
                summary[f"{s} / {c} / rank {rank}"] = m
                rows.append([c, str(rank), fmt_bytes(m["param_bytes"]), fmt_bytes(m["base"]),
                             fmt_bytes(m["setup_peak"]), fmt_bytes(m["setup_growth"]),
                             f"{m['setup_growth'] / full:.2f}", fmt_bytes(m["setup_anon_growth"]),
                             f"{m['setup_anon_growth'] / full:.2f}", fmt_bytes(m["train_peak"]),
                             "yes" if m["slices_ok"] else "NO"])
        cfg = SEED000 if s == "seed000" else BIG
        title = (f"{s}: ToyModel(in {cfg['in_dim']}, hidden {cfg['hidden']}), full parameters {fmt_bytes(full)}, "
                 f"{cfg['steps']} SGD step(s) on batch {cfg['batch']}")
        print(f"\n{title}; medians of {a.rounds} runs")
        print(table(rows, ["contender", "rank", "param bytes", "RSS base", "setup peak", "setup growth",
                           "/ full model", "private growth", "/ full model", "peak incl. training", "slices ok"]))
    print("\nsetup = build + shard (+ load); growth = peak RSS (VmHWM) minus the baseline; private growth = sampled\n"
          "peak of RssAnon (1 ms sampling) minus its baseline, i.e. without the checkpoint's mmapped file pages")
    wall = time.perf_counter() - t0
    print(f"\nwall time {wall:.1f} s")
    out = {"machine": info, "rounds": a.rounds, "seed000": SEED000, "big": BIG, "checkpoint_bytes": ckpt_bytes,
           "seed000_full_bytes": full_small, "summary": summary, "raw": raw, "wall_s": wall}
    print(f"wrote {write_json('memory.json', out)}")
    return out


if __name__ == "__main__":
    main()
