"""``init_parameters`` on a meta-built model (2 gloo ranks, one pooled call).

* tiled (default): the sharded model's full state dict equals ``fxshard.tiled_init`` of the unsharded model
  (1 process vs 2 ranks: the values do not depend on the mesh), and so do its loss and gradients; tiles
  cross shard boundaries (vocab 600 vs 512-row tiles);
* tiled memory: a 512 MiB parameter initializes with peak RSS growth far below its size (one tile at a
  time; the former behaviour built the full tensor on every rank);
* exact: a per-tensor seeded init reproduces the unsharded init bit for bit;
* an init the tiles cannot replay raises a ShardingError; a tensor init does not write stays unfilled;
* ``nn.init`` run on the local pieces (the same numbers on every rank) raises at the first call; pieces
  written with their own values do not.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

import fxshard
from fxshard import ColwiseParallel, ShardingError
from fxshard.state.checkpoint import Piece
from fxshard.state.tiled_init import fill
from tests import models
from tests.dist_utils import run_ranks
from tests.test_training import llama_megatron_plan

TOL = 1e-5
LLAMA = dict(vocab=600, dim=64, n_heads=8, n_kv_heads=4, n_layers=2, hidden=128, max_seq=16)
ROPE = {k: v for k, v in models.LlamaDecoder(**LLAMA).named_buffers() if k.startswith("rope")}


def _init(name: str, t: torch.Tensor) -> None:
    if name in ROPE:
        t.copy_(ROPE[name])  # from a full tensor: each tile copies its part
    elif t.dim() >= 2:
        nn.init.trunc_normal_(t, std=0.02)  # rejection sampling: runs per tile
    else:
        nn.init.ones_(t)


def _seeded_init(name: str, t: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(name)))
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, generator=g) * 0.02)


def _meta_llama(mesh):
    with torch.device("meta"):
        model = models.LlamaDecoder(**LLAMA)
    batch = (models.make_tokens(2, 16, 600, seed=0), models.make_tokens(2, 16, 600, seed=1))
    return fxshard.shard(model, mesh, llama_megatron_plan(2), example_inputs=batch), batch


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _big(rank: int, mesh) -> dict:
    """A 512 MiB weight, column-split: RSS high-water growth during init_parameters, and a few rows checked."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8192, 16384, bias=False))
    sm = fxshard.shard(model, mesh, {"0": ColwiseParallel()}, example_inputs=(torch.randn(2, 8192),))
    init = lambda name, t: nn.init.normal_(t, std=0.02)  # noqa: E731
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM (the peak RSS) to the current RSS
        f.write("5")
    start = time.perf_counter()
    sm.init_parameters(init, seed=3)
    seconds = time.perf_counter() - start
    growth = _status("VmHWM") - before
    rows = torch.empty(3, 8192)
    lo = rank * 8192
    fill(rows, "0.weight", (16384, 8192), init, [Piece((slice(lo, lo + 3), slice(0, 8192)),
                                                       (slice(0, 3), slice(0, 8192)))], 3)
    return {"growth": growth, "full_bytes": 16384 * 8192 * 4, "rows_equal": torch.equal(sm.get_parameter("0.weight")[:3], rows),
            "std": sm.get_parameter("0.weight")[:64].std().item(), "seconds": seconds}


def _grads(m) -> dict:
    return {n: p.grad for n, p in m.named_parameters()}


def _inits(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    out = {}
    sm, batch = _meta_llama(mesh)
    sm.init_parameters(_init, seed=7)
    ref = models.LlamaDecoder(**LLAMA)
    fxshard.tiled_init(ref, _init, seed=7)
    want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}  # the rope buffers are not persistent
    full = {n: sm._dtensor(n, t).full_tensor() for n, t in [*sm.named_parameters(), *sm.named_buffers()]}
    out["tiled_state"] = max((full[k] - want[k]).abs().max().item() for k in want)
    out["rope_copied"] = all(torch.equal(full[k], v) for k, v in ROPE.items())
    out["tiled_std"] = want["tok_embeddings.weight"].std().item()
    loss, ref_loss = sm(*batch), ref(*batch)
    loss.backward()
    ref_loss.backward()
    grads = {n: sm._dtensor(n, p.grad).full_tensor() for n, p in sm.named_parameters()}
    out["tiled_loss"] = abs(loss.item() - ref_loss.item())
    out["tiled_grads"] = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())

    sm, batch = _meta_llama(mesh)
    try:
        sm.init_parameters(_seeded_init)  # draws a full-size tensor: not tileable
        out["refused"] = ""
    except ShardingError as e:
        out["refused"] = str(e)
    sm.init_parameters(lambda n, t: None if n in ROPE else _init(n, t))
    out["unfilled"] = _call_error(sm, batch)
    sm, batch = _meta_llama(mesh)
    sm.init_parameters(lambda n, t: None if n in ROPE else _seeded_init(n, t), exact=True)
    out["exact_unfilled"] = _call_error(sm, batch)
    sm.init_parameters(_seeded_init, exact=True)
    ref = models.LlamaDecoder(**LLAMA)
    for name, t in ref.state_dict().items():
        _seeded_init(name, t)
    full = sm.full_state_dict()
    out["exact_state"] = max((full[k] - ref.state_dict()[k]).abs().max().item() for k in full)
    out["exact_loss"] = abs(sm(*batch).item() - ref(*batch).item())

    out["pieces"] = _pieces_written(rank, mesh)
    out["big"] = _big(rank, mesh)
    return out


def _call_error(sm, batch) -> str:
    """The ShardingError ``sm(*batch)`` raises, or "" if it runs."""
    try:
        sm(*batch)
        return ""
    except ShardingError as e:
        return str(e)


def _pieces_written(rank: int, mesh) -> dict:
    """nn.init on sm's pieces (one seed on every rank) raises at the first call; pieces each rank writes with
    its own values (the full values scaled) do not, and compute as the unsharded model."""
    out = {}
    sm, batch = _meta_llama(mesh)
    sm.init_parameters(lambda n, t: t.copy_(ROPE[n]) if n in ROPE else None)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in sm.parameters():
            nn.init.normal_(p, std=0.02) if p.dim() >= 2 else nn.init.ones_(p)
    out["same_seed"] = _call_error(sm, batch)
    # HF's _init_weights style writes through .data (p's version counter does not move); rank 0 alone loads
    # one weight first, so the ranks' fills differ: both still check the same names and raise alike
    sm, batch = _meta_llama(mesh)
    sm.init_parameters(lambda n, t: t.copy_(ROPE[n]) if n in ROPE else None)
    if rank == 0:
        wq = "layers.0.attention.wq.weight"
        sm.load_state_dict({wq: torch.randn(sm._global_shapes[wq])}, strict=False)
    torch.manual_seed(5)
    for p in sm.parameters():
        p.data.normal_(0, 0.02) if p.dim() >= 2 else p.data.fill_(1.0)
    out["data_writes"] = _call_error(sm, batch)
    torch.manual_seed(6)
    ref = models.LlamaDecoder(**LLAMA)
    scaled = {n: t * 1.5 for n, t in ref.state_dict().items()}
    sm = fxshard.shard(ref, mesh, llama_megatron_plan(2), example_inputs=batch)
    with torch.no_grad():
        for p in sm.parameters():
            p.mul_(1.5)  # each rank writes its own piece: they differ
    ref.load_state_dict(scaled)
    out["own_slices_loss"] = abs(sm(*batch).item() - ref(*batch).item())
    return out


def test_init_parameters_tiled_and_exact():
    for res in run_ranks(_inits, 2, timeout=300):
        assert res["tiled_state"] == 0.0 and res["rope_copied"] and 0.015 < res["tiled_std"] < 0.025, res
        assert res["tiled_loss"] <= TOL and res["tiled_grads"] <= TOL, res
        assert "draws random numbers with aten.randn" in res["refused"], res
        assert "exact=True" in res["refused"], res
        assert "rope_cos" in res["unfilled"] and "tok_embeddings" not in res["unfilled"], res
        assert "rope_cos" in res["exact_unfilled"] and "tok_embeddings" not in res["exact_unfilled"], res
        assert res["exact_state"] == 0.0 and res["exact_loss"] <= TOL, res
        pieces = res["pieces"]
        # the embedding and column/row-split weights repeat one piece; norms (ones) are constant fills
        assert "written in place on every rank alike" in pieces["same_seed"], pieces
        assert "tok_embeddings.weight (split over 'tp')" in pieces["same_seed"], pieces
        assert "sm.init_parameters(fn)" in pieces["same_seed"] and "norm" not in pieces["same_seed"], pieces
        assert pieces["own_slices_loss"] <= TOL, pieces
        assert "tok_embeddings.weight (split over 'tp')" in pieces["data_writes"], pieces
        big = res["big"]
        assert big["rows_equal"] and 0.015 < big["std"] < 0.025, big
        # the shard (half of 512 MiB) exists before; init adds about one 1 MiB tile, never a full tensor
        assert big["growth"] < big["full_bytes"] / 16, big
