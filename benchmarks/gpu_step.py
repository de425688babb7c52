"""Per-rank training step on a GPU at Llama-3-8B layer shapes: fxshard vs the dense per-rank model vs DTensor.

    python benchmarks/gpu_step.py                      # one GPU: the fake process group stands in for tp ranks
    torchrun --nproc-per-node 8 benchmarks/gpu_step.py # several GPUs: NCCL, real collectives, tp = world size
    python benchmarks/gpu_step.py --tiny --device cpu  # a seconds-long smoke run of the script itself (no GPU)

Model (``fxshard.models.LlamaDecoder``): hidden 4096, 32 heads / 8 KV heads (head dim 128), SwiGLU
14336, vocab 32000 (``--vocab 128256`` for Llama 3's), ``--layers`` (2), batch 4 x 2048 tokens, fp32
parameters and AdamW state, the step under ``torch.autocast(device, bfloat16)`` (``--dtype float32``:
no autocast). One step = forward with the loss inside + backward + AdamW step + zero_grad.

One plan for every contender (``PLAN``): per layer ``wq/wk/wv/w1/w3`` column-parallel, ``wo/w2``
row-parallel (Megatron's two all-reduces per layer per direction); the token embedding, the norms and
the output head replicated and computed whole on every rank (pinned with ``P()``, so fxshard's planner
cannot split them). Contenders:

* ``dense`` / ``dense-compiled``: the per-rank model that hand-written Megatron runs (each layer with
  ``heads / tp`` heads and ``14336 / tp`` hidden units, full embedding and head), its all-reduces as
  Megatron's autograd pairs (free on the fake process group), eager and under ``torch.compile``;
* ``fxshard`` / ``fxshard-compiled``: ``fxshard.shard`` of the global model with ``PLAN``, eager and
  ``sm.compile()``;
* ``dtensor``: ``parallelize_module`` with the same plan (torch's ParallelStyles, heads set per rank as
  torchtitan does);
* ``fxshard-free`` (reported apart, not in the ratios): fxshard with only the layers pinned, its global
  planner free to place the embedding and head (on the fake process group it may split the head, whose
  collectives are then free).

Method: every contender is built, warmed up (2 steps, compilation included), then ``--rounds`` rounds
each run every contender for ``--steps`` steps in a rotated order (``benchmarks/_common.interleaved``),
timed with CUDA events; medians over rounds, ratios as medians of per-round ratios against ``dense``'s
eager step. Peak memory of a contender = the bytes it holds between steps (parameters, optimizer state)
+ the growth of the allocator's peak during its own steps. MFU = the dense model's FLOPs per step
(``torch.utils.flop_counter``) / step time / the bf16 matmul rate measured in the same run (8192^3),
also given against the datasheet's 989 TFLOP/s. Writes ``benchmarks/results/gpu_step.json`` (not with
``--tiny``) and ``--out DIR/gpu_step.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import interleaved, machine, median, ratio_median, table, write_json  # noqa: E402

LLAMA3_8B = dict(dim=4096, n_heads=32, n_kv_heads=8, hidden=14336, vocab=32000, batch=4, seq=2048)
TINY = dict(dim=64, n_heads=16, n_kv_heads=8, hidden=128, vocab=256, batch=2, seq=32)  # GQA that tp=8 divides
DATASHEET_BF16 = 989e12  # H100/H200 SXM dense bf16, FLOP/s


def layer_plan() -> dict:
    """Megatron's layers: column-parallel in, row-parallel out (the fxshard names of torch's styles)."""
    from fxshard import ColwiseParallel, RowwiseParallel

    plan: dict = {}
    for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{w}"] = ColwiseParallel()
    for w in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{w}"] = RowwiseParallel()
    return plan


def pinned_plan() -> dict:
    """``layer_plan`` with every other parameter pinned replicated (``P()`` of its rank): the plan the
    dense per-rank model and DTensor run."""
    from fxshard import P

    plan = layer_plan()
    plan["tok_embeddings.weight"] = P(None, None)
    plan["output.weight"] = P(None, None)
    plan["norm.weight"] = P(None)
    plan["layers.*.attention_norm.weight"] = P(None)
    plan["layers.*.ffn_norm.weight"] = P(None)
    return plan


# ----------------------------------------------------------------------------- the dense per-rank model


def dense_model(cfg: dict, tp: int, layers: int, group: Any, device: str):
    """The per-rank model of Megatron tensor parallelism: ``heads / tp`` heads, ``hidden / tp`` units per
    layer, the embedding and head whole; all-reduces after ``wo``/``w2`` forward and before
    ``wq/wk/wv``/``w1/w3`` backward (no-ops on the fake process group)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    from fxshard.models import RMSNorm, _rotate_half, rope_tables

    class _F(torch.autograd.Function):  # Megatron's f: identity forward, all-reduce backward
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            g = g.contiguous()
            dist.all_reduce(g, group=group)
            return g

    class _G(torch.autograd.Function):  # Megatron's g: all-reduce forward, identity backward
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            x = x.contiguous()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return g

    hd = cfg["dim"] // cfg["n_heads"]
    h, hk, ff = cfg["n_heads"] // tp, cfg["n_kv_heads"] // tp, cfg["hidden"] // tp

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg["dim"]
            self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
            self.wq, self.wk, self.wv = nn.Linear(d, h * hd, bias=False), nn.Linear(d, hk * hd, bias=False), \
                nn.Linear(d, hk * hd, bias=False)
            self.wo = nn.Linear(h * hd, d, bias=False)
            self.w1, self.w3 = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
            self.w2 = nn.Linear(ff, d, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            a = _F.apply(self.attention_norm(x))
            q = self.wq(a).view(B, T, h, hd).transpose(1, 2)
            k = self.wk(a).view(B, T, hk, hd).transpose(1, 2)
            v = self.wv(a).view(B, T, hk, hd).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != hk)
            x = x + _G.apply(self.wo(y.transpose(1, 2).reshape(B, T, h * hd)))
            m = _F.apply(self.ffn_norm(x))
            return x + _G.apply(self.w2(F.silu(self.w1(m)) * self.w3(m)))

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(cfg["vocab"], cfg["dim"])
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm(cfg["dim"])
            self.output = nn.Linear(cfg["dim"], cfg["vocab"], bias=False)
            cos, sin = rope_tables(cfg["seq"], hd)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

        def forward(self, tokens, targets):
            h_ = self.tok_embeddings(tokens)
            for layer in self.layers:
                h_ = layer(h_, self.cos, self.sin)
            logits = self.output(self.norm(h_))
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    with torch.device(device):
        return Dense()


def global_model(cfg: dict, layers: int, device: str):
    """The model every sharded contender starts from (``fxshard.models.LlamaDecoder``, loss inside)."""
    import torch

    from fxshard.models import LlamaDecoder

    with torch.device(device):
        return LlamaDecoder(vocab=cfg["vocab"], dim=cfg["dim"], n_heads=cfg["n_heads"],
                            n_kv_heads=cfg["n_kv_heads"], n_layers=layers, hidden=cfg["hidden"], max_seq=cfg["seq"])


def dtensor_model(cfg: dict, layers: int, mesh, device: str):
    """``parallelize_module`` with ``layer_plan``'s styles (torch's own); heads per rank set on the modules."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = global_model(cfg, layers, device)
    tp = mesh.size()
    torch_plan = {k: (ColwiseParallel() if type(v).__name__.startswith("Colwise") else RowwiseParallel())
                  for k, v in layer_plan().items()}
    parallelize_module(model, mesh, torch_plan)
    for layer in model.layers:
        layer.attention.n_heads //= tp
        layer.attention.n_kv_heads //= tp
    return model


# ----------------------------------------------------------------------------- measuring


class Timer:
    """Milliseconds per step over ``steps`` calls: CUDA events on a GPU, the wall clock elsewhere."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device == "cuda"
        self.torch = torch

    def __call__(self, fn: Callable[[], Any], steps: int) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / steps
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / steps


def matmul_rate(device: str) -> float:
    """Measured bf16 FLOP/s of one 8192^3 matmul (a GPU's practical ceiling); 0 off a GPU."""
    import torch

    if device != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = Timer(device)(lambda: a @ b, 20)
    return 2 * 8192 ** 3 / (ms / 1e3)


def step_flops(step: Callable[[], Any]) -> int:
    """FLOPs of one call of ``step`` (matmuls and attention, as ``torch.utils.flop_counter`` counts)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def autocast_of(device: str, dtype) -> Callable[[], Any]:
    """A factory of the step's autocast context: ``torch.autocast(device, dtype)``, or no autocast for None."""
    import contextlib

    import torch

    return (lambda: torch.autocast(device, dtype=dtype)) if dtype is not None else contextlib.nullcontext


def make_step(module, opt, batch, autocast_dtype, device: str) -> Callable[[], Any]:
    """forward (loss inside) + backward + optimizer step + zero_grad, under autocast when a dtype is given."""
    ctx = autocast_of(device, autocast_dtype)

    def step():
        with ctx():
            loss = module(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build(name: str, cfg: dict, layers: int, mesh, group, device: str, autocast_dtype, local_batch, tp: int):
    """``(module, step)`` of one contender."""
    import torch

    import fxshard

    base = name.replace("-compiled", "")
    if base == "dense":
        module = dense_model(cfg, tp, layers, group, device)
    elif base == "dtensor":
        module = dtensor_model(cfg, layers, mesh, device)
    else:
        plan = layer_plan() if base == "fxshard-free" else pinned_plan()
        # example inputs: global shapes on the meta device; the ShardedModule runs on the mesh's device
        example = tuple(torch.empty((cfg["batch"], cfg["seq"]), dtype=torch.long, device="meta") for _ in range(2))
        with autocast_of(device, autocast_dtype)():  # shard() inside the autocast the step runs under
            module = fxshard.shard(global_model(cfg, layers, "cpu"), mesh, plan, example_inputs=example)
    if name.endswith("-compiled"):
        if base == "fxshard":
            module.compile()
        else:
            module = torch.compile(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    return module, make_step(module, opt, local_batch, autocast_dtype, device)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=None, help="default 32000 (256 with --tiny)")
    ap.add_argument("--tp", type=int, default=8, help="fake-process-group world size (ignored under torchrun)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="autocast dtype of the step (float32: no autocast)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run of this script)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated contenders")
    ap.add_argument("--out", default=None, help="also write the JSON into this folder")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="build no further contender once this many seconds have passed (the timing still runs)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = dict(TINY if args.tiny else LLAMA3_8B)
    if args.vocab:
        cfg["vocab"] = args.vocab
    real = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if real:  # torchrun: real collectives, tp = world size
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        tp, rank = dist.get_world_size(), dist.get_rank()
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        tp, rank = args.tp, 0
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    mesh = init_device_mesh(device, (tp,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    autocast_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    for k in ("n_heads", "n_kv_heads", "hidden"):
        if cfg[k] % tp:
            raise SystemExit(f"{k}={cfg[k]} is not divisible by tp={tp}")

    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(device)
                  for _ in range(2))
    names = ["dense", "fxshard", "dtensor"]
    if not args.no_compile:
        names += ["dense-compiled", "fxshard-compiled"]
    names.append("fxshard-free")
    if args.only:
        names = [n for n in names if n in args.only.split(",")]

    timer = Timer(device)
    cuda = device == "cuda"
    steps: dict[str, Callable[[], Any]] = {}
    held: dict[str, int] = {}
    peak: dict[str, int] = {}
    losses: dict[str, float] = {}
    build_s: dict[str, float] = {}
    failed: dict[str, str] = {}  # a contender that raised (or was skipped for time): the others still run
    started = time.perf_counter()
    for name in names:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            failed[name] = f"skipped: the --budget-s of {args.budget_s:.0f} s was spent"
            print(f"[gpu_step] {name}: {failed[name]}", flush=True)
            continue
        try:
            if cuda:
                torch.cuda.synchronize()
            before = torch.cuda.memory_allocated() if cuda else 0
            t0 = time.perf_counter()
            torch.manual_seed(0)
            _, step = build(name, cfg, args.layers, mesh, group, device, autocast_dtype, batch, tp)
            for _ in range(2):  # warm-up (and compilation)
                losses[name] = float(step())
            if cuda:
                torch.cuda.synchronize()
            build_s[name] = time.perf_counter() - t0
            if cuda:
                held[name] = torch.cuda.memory_allocated() - before
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak[name] = held[name] + torch.cuda.max_memory_allocated() - base
        except Exception as e:  # noqa: BLE001 - reported, and the other contenders still measured
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"[gpu_step] {name} FAILED: {failed[name][:500]}", flush=True)
            gc.collect()
            continue
        steps[name] = step
        # on the fake process group collectives move no data (a gather returns uninitialised memory), so the
        # losses only show that a step ran; they are comparable across contenders only under torchrun
        print(f"[gpu_step] built {name} in {build_s[name]:.1f} s, loss {losses[name]:.4f}"
              f"{'' if real else ' (fake group: not comparable)'}"
              f"{f', held {held[name] / 2**30:.2f} GiB, peak {peak[name] / 2**30:.2f} GiB' if cuda else ''}",
              flush=True)
    names = [n for n in names if n in steps]
    gc.collect()

    flops = step_flops(steps["dense"]) if "dense" in steps else 0
    rate = matmul_rate(device)
    per_round = interleaved({n: (lambda n=n: timer(steps[n], args.steps)) for n in steps}, args.rounds)
    ms = {n: median(v) for n, v in per_round.items()}
    ref = "dense"
    rows = []
    for n in names:
        r = ratio_median(per_round[n], per_round[ref]) if ref in per_round else float("nan")
        ref_peak = peak.get("dense-compiled" if n.endswith("-compiled") else "dense")
        mem_ratio = peak[n] / ref_peak if cuda and ref_peak else float("nan")
        mfu = flops / (ms[n] / 1e3) / rate if rate else float("nan")
        rows.append([n, f"{ms[n]:.2f}", f"{r:.3f}", f"{peak.get(n, 0) / 2**30:.2f}" if cuda else "-",
                     f"{mem_ratio:.3f}" if cuda else "-", f"{mfu:.1%}" if rate else "-",
                     f"{flops / (ms[n] / 1e3) / DATASHEET_BF16:.1%}" if cuda else "-",
                     f"{cfg['batch'] * cfg['seq'] / (ms[n] / 1e3):,.0f}"])
    header = ["contender", "ms/step", "x dense eager", "peak GiB", "x dense peak (same mode)", "MFU (measured peak)",
              "MFU (989 TF)", "tokens/s/rank"]
    gpu = torch.cuda.get_device_name() if cuda else "none"
    print(f"\nGPU {gpu}, torch {torch.__version__}, tp={tp} ({'NCCL' if real else 'fake process group'}), "
          f"{args.layers} layers, vocab {cfg['vocab']}, batch {cfg['batch']}x{cfg['seq']}, "
          f"{'bf16 autocast' if autocast_dtype else 'fp32'}, fp32 params + AdamW; "
          f"dense FLOPs/step {flops / 1e12:.2f} T; bf16 matmul measured {rate / 1e12:.0f} TFLOP/s")
    print(table(rows, header))
    print("fxshard-free is the plan fxshard's planner picks with only the layers pinned (not like for like).")
    for n, why in failed.items():
        print(f"not measured: {n}: {why[:300]}")
    result = {"machine": {**machine(), "gpu": gpu}, "config": {**cfg, "layers": args.layers, "tp": tp,
              "collectives": "nccl" if real else "fake", "dtype": args.dtype}, "ms": ms,
              "ratio_vs_dense_eager": {r[0]: float(r[2]) for r in rows}, "peak_bytes": peak, "held_bytes": held,
              "losses": losses, "flops_per_step": flops, "matmul_flops_per_s": rate, "build_s": build_s,
              "rounds": per_round, "not_measured": failed}
    if rank == 0:
        if not args.tiny:  # a smoke run's numbers are not results
            print(f"wrote {write_json('gpu_step.json', result)}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_step.json"), "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()
    errors = [n for n, why in failed.items() if not why.startswith("skipped")]
    if errors:
        raise SystemExit(f"gpu_step: {len(errors)} contender(s) failed: {', '.join(errors)}")
    return result


if __name__ == "__main__":
    main()
