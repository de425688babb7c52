"""Sharded forward on 2 real gloo ranks vs the same model unsharded on one process."""

from __future__ import annotations

import torch

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel
from tests import models
from tests.dist_utils import run_ranks

TOL = 1e-5


def _toy(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.ToyModel(16, 32)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ref = model(x)
    sm = fxshard.shard(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()}, example_inputs=(x,))
    out = sm(x)
    return {
        "err": (out - ref).abs().max().item(),
        "stats": fxshard.comm_stats(sm),
        "shapes": {n: tuple(p.shape) for n, p in sm.named_parameters()},
    }


def test_toy_model_colwise_rowwise_one_all_reduce():
    for res in run_ranks(_toy, 2):
        assert res["err"] <= TOL
        assert res["stats"]["forward"] == {"all_reduce": {"count": 1, "bytes": 8 * 16 * 4}}
        assert res["shapes"] == {"net1.weight": (16, 16), "net1.bias": (16,), "net2.weight": (16, 16), "net2.bias": (16,)}


def transformer_plan(n_layers: int) -> dict:
    plan: dict = {"tok_emb": RowwiseParallel()}
    for i in range(n_layers):
        plan.update({f"layers.{i}.attn.w{p}": ColwiseParallel() for p in "qkv"})
        plan[f"layers.{i}.attn.wo"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.w1"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.w2"] = RowwiseParallel()
    return plan


def _transformer(rank: int, world: int, n_layers: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.Transformer(vocab=64, dim=32, n_heads=4, n_layers=n_layers, max_seq=16, tie=True)
    tokens = models.make_tokens(2, 16, 64, seed=3)
    ref = model(tokens)
    # the greedy sweep's Megatron pattern (at this width the default global planner gathers the 4 KiB tied
    # table once instead: cheaper under its latency price, docs/solver_design.md "Small tensors")
    sm = fxshard.shard(model, mesh, transformer_plan(n_layers), example_inputs=(tokens,), planner="greedy")
    out = sm(tokens)
    return {"err": (out - ref).abs().max().item(), "stats": fxshard.comm_stats(sm),
            "wq": tuple(sm.get_parameter("layers.0.attn.wq.weight").shape), "tied": sm.output.weight is sm.tok_emb.weight}


def test_transformer_megatron_two_all_reduces_per_layer():
    n_layers = 4
    for res in run_ranks(_transformer, 2, n_layers):
        assert res["err"] <= TOL
        fwd = res["stats"]["forward"]
        # 2 per layer, plus the vocab-sharded embedding's Partial sum; logits are gathered once for the output
        assert fwd["all_reduce"]["count"] == 2 * n_layers + 1
        assert fwd["all_gather"]["count"] == 1
        assert set(fwd) == {"all_reduce", "all_gather"}
        assert res["wq"] == (16, 32)
        assert res["tied"]


def _seed004(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.ConvBigHead(in_ch=3, ch=8, img=8, n_classes=1024)
    x = models.make_images(4, 3, 8, seed=2)
    ref = model(x)
    sm = fxshard.shard(model, mesh, {"linear.weight": P("tp", None), "linear.bias": P("tp")}, example_inputs=(x,))
    out = sm(x)
    return {"err": (out - ref).abs().max().item(), "w": tuple(sm.linear.weight.shape),
            "conv": tuple(sm.conv.weight.shape), "stats": fxshard.comm_stats(sm)}


def test_seed004_only_linear_sharded():
    for res in run_ranks(_seed004, 2):
        assert res["err"] <= TOL
        assert res["w"] == (512, 8 * 8 * 8)
        assert res["conv"] == (8, 3, 3, 3)
        assert res["stats"]["forward"] == {"all_gather": {"count": 1, "bytes": 4 * 1024 * 4}}


def _dynamic_batch(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.Transformer(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16)
    batch = torch.export.Dim("batch", min=1, max=64)
    sm = fxshard.shard(model, mesh, transformer_plan(2), example_inputs=(models.make_tokens(2, 8, 64),),
                       dynamic_shapes=({0: batch},))
    errs = {}
    with torch.no_grad():
        for b in (2, 4, 6):
            t = models.make_tokens(b, 8, 64, seed=b)
            errs[b] = (sm(t) - model(t)).abs().max().item()
    return {"errs": errs}


def test_dynamic_batch_runs_new_sizes_without_resharding():
    for res in run_ranks(_dynamic_batch, 2):
        assert all(e <= TOL for e in res["errs"].values()), res


class _Transpose(torch.nn.Module):
    """Identity whose input and output are constrained to different splits: one all_to_all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fxshard.constrain(x * 2.0, P(None, "tp", None))
        return fxshard.constrain(y + 1.0, P(None, None, "tp")) * 3.0


def _all_to_all(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    x = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    sm = fxshard.shard(_Transpose(), mesh, {}, example_inputs=(x,), out_specs=P(None, None, "tp"))
    out = sm(x)
    want = ((x * 2.0 + 1.0) * 3.0).chunk(world, dim=2)[rank]
    return {"err": (out - want).abs().max().item(), "stats": fxshard.comm_stats(sm)["forward"]}


def test_split_moving_between_dims_is_one_all_to_all():
    for res in run_ranks(_all_to_all, 2):
        assert res["err"] == 0.0
        assert res["stats"] == {"all_to_all": {"count": 1, "bytes": 4 * 3 * 8 * 4}}, res["stats"]


class _Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * mask


def _kwarg_specs(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = _Masked().requires_grad_(False)
    x, mask = torch.randn(4, 8), (torch.rand(4, 8) > 0.5).float()
    sm = fxshard.shard(model, mesh, {}, example_inputs=(x,), example_kwargs={"mask": mask},
                       in_specs=((P("tp"),), {"mask": P("tp")}), out_specs=P("tp"))
    out = sm(x.chunk(world)[rank], mask=mask.chunk(world)[rank])
    return {"err": (out - model(x, mask=mask).chunk(world)[rank]).abs().max().item(), "stats": fxshard.comm_stats(sm)}


def test_in_specs_cover_keyword_inputs():
    for res in run_ranks(_kwarg_specs, 2):
        assert res["err"] <= TOL
        assert res["stats"]["forward"] == {}  # both inputs arrive batch-split: nothing to communicate


class _Upsample(torch.nn.Module):
    """Inference programs keep ``F.interpolate(scale_factor=...)`` as ``upsample_*2d.vec`` (rules/pool.py)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        return (torch.nn.functional.interpolate(y, scale_factor=2, mode="nearest")
                + torch.nn.functional.interpolate(y, scale_factor=2, mode="bilinear"))


def _upsample(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = _Upsample().requires_grad_(False)
    x = torch.randn(5, 3, 4, 6, generator=torch.Generator().manual_seed(2))  # batch 5: uneven pieces 3 + 2
    ref = model(x)
    sm = fxshard.shard(model, mesh, {}, example_inputs=(x,), in_specs=P("tp"), out_specs=P("tp"))
    out = sm(x.chunk(world)[rank])
    return {"err": (out - ref.chunk(world)[rank]).abs().max().item(), "stats": fxshard.comm_stats(sm)["forward"],
            "fallbacks": sm.sharding.fallbacks}


def test_upsample_vec_follows_the_batch_split():
    for res in run_ranks(_upsample, 2):
        assert res["err"] <= TOL
        assert res["fallbacks"] == [] and res["stats"] == {}, res
