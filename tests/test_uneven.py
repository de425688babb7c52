"""Uneven sharding: sizes that do not divide the mesh axis are cut as ``torch.chunk`` cuts them.

Numbers come from 2 (and 4) real gloo ranks compared with the unsharded model; plans and errors
from the fake process group.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel, ShardingError
from fxshard.planner.propagate import STRATEGY_KEY
from fxshard.core.ir import META_KEY
from fxshard.core.spec import can_split, chunk, local_shape
from fxshard.core.placements import R, S
from tests.dist_utils import run_ranks
from tests.test_training import _max_param_diff, _train

TOL = 1e-5
N_CLASSES = 1001


class Classifier(nn.Module):
    """Embedding trunk with a vocab that does not divide, and a 1001-class head; loss inside."""

    def __init__(self, vocab: int = 37, dim: int = 16, n_classes: int = N_CLASSES):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, 24)
        self.head = nn.Linear(24, n_classes)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.emb(tokens))))

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(tokens).flatten(0, 1), target.flatten())


class Logits(Classifier):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(tokens)


def test_chunk_matches_torch_chunk():
    for size in (1001, 7, 8, 5):
        for n in (2, 3, 4):
            pieces = torch.arange(size).chunk(n)
            for i in range(n):
                start, length = chunk(size, n, i)
                want = pieces[i] if i < len(pieces) else torch.arange(0)
                assert length == len(want) and (length == 0 or start == int(want[0])), (size, n, i)


def test_local_shape_per_rank_and_largest_piece():
    assert local_shape((1001, 4), (S(0),), (2,), coords=(0,)) == (501, 4)
    assert local_shape((1001, 4), (S(0),), (2,), coords=(1,)) == (500, 4)
    assert local_shape((1001, 4), (S(0),), (2,)) == (501, 4)
    assert local_shape((1001, 4), (R,), (2,), coords=(1,)) == (1001, 4)
    assert can_split(1001, 2) and can_split(7, 4) and not can_split(5, 4) and not can_split(9, 2, outer=3)


def _classifier_train(rank: int, world: int, plan_kind: str) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = Classifier()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 37, (4, 6), generator=g), torch.randint(0, N_CLASSES, (4, 6), generator=g))
               for _ in range(3)]
    plan = ({"head": ColwiseParallel(), "emb": RowwiseParallel()} if plan_kind == "styles"
            else {"head.weight": P("tp", None), "head.bias": P("tp"), "body.weight": P(None, "tp"),
                  "emb.weight": P("tp", None)})
    # the greedy sweep (loss parallel at any size); the global planner gathers these 96 KiB of logits
    # instead of three per-token all_reduces and the embedding's (latency outweighs bytes at this size)
    sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=batches[0], planner="greedy")
    ref_l, l = _train(model, sm, batches, lambda m, b: m(*b), "adamw", 4)
    full = sm.full_state_dict()
    return {"loss_err": max(abs(a - b) for a, b in zip(ref_l, l)), "param_err": _max_param_diff(full, model),
            "head_rows": sm.head.weight.shape[0], "emb_rows": sm.emb.weight.shape[0],
            "stats": fxshard.comm_stats(sm)}


@pytest.mark.parametrize("plan_kind", ["styles", "specs"])
def test_1001_class_head_trains_with_parity_on_2_ranks(plan_kind):
    res = run_ranks(_classifier_train, 2, plan_kind)
    for r in res:
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
    # torch.chunk pieces: rank 0 holds 501 classes, rank 1 holds 500; vocab 37 -> 19 + 18 rows
    assert [r["head_rows"] for r in res] == [501, 500]
    assert [r["emb_rows"] for r in res] == [19, 18]
    # loss parallel still holds: no collective carries the [24, 1001] logits
    fwd = res[0]["stats"]["forward"]
    assert max(v["bytes"] / v["count"] for v in fwd.values()) < 24 * N_CLASSES * 4 / 4, fwd


def _gathered_logits(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = Logits(n_classes=7)
    tokens = torch.randint(0, 37, (2, 5))
    ref = model(tokens)
    sm = fxshard.shard(copy.deepcopy(model), mesh, {"head": ColwiseParallel(output_layouts=fxshard.Replicate())},
                       example_inputs=(tokens,))
    out = sm(tokens)
    return {"err": (out - ref).abs().max().item(), "shape": tuple(out.shape), "local_rows": sm.head.weight.shape[0]}


def test_uneven_split_gathers_padded_pieces_on_4_ranks():
    # 7 classes over 4 ranks: pieces 2, 2, 2, 1 are padded to 2 for the all_gather and cut back to 7
    res = run_ranks(_gathered_logits, 4)
    assert [r["local_rows"] for r in res] == [2, 2, 2, 1]
    for r in res:
        assert r["shape"] == (2, 5, 7) and r["err"] <= TOL, r


def _state_round_trip(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = Logits()
    tokens = torch.randint(0, 37, (2, 3))
    sm = fxshard.shard(copy.deepcopy(model), mesh, {"head": ColwiseParallel(), "emb": RowwiseParallel()},
                       example_inputs=(tokens,))
    other = Logits()
    sm.load_full_state_dict(other.state_dict())
    back = sm.full_state_dict()
    dt = sm.sharded_state_dict()["head.weight"]
    return {"err": max((back[k] - v).abs().max().item() for k, v in other.state_dict().items()),
            "dtensor_shape": tuple(dt.shape), "dtensor_local": tuple(dt.to_local().shape)}


def test_uneven_state_dict_round_trip_and_dtensor_view():
    res = run_ranks(_state_round_trip, 2)
    assert [r["dtensor_local"] for r in res] == [(501, 24), (500, 24)]
    for r in res:
        assert r["err"] == 0.0 and r["dtensor_shape"] == (N_CLASSES, 24), r


def test_split_that_leaves_a_rank_empty_is_a_sharding_error(fake_mesh):
    mesh = fake_mesh(4)
    with pytest.raises(ShardingError, match=r"head.weight dim 0 \(size 3\).*at least one element on each of the 4"):
        fxshard.shard(Logits(n_classes=3), mesh, {"head": ColwiseParallel()},
                      example_inputs=(torch.randint(0, 37, (2, 3)),))


def test_uneven_split_over_two_axes_is_a_sharding_error(fake_mesh):
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    with pytest.raises(ShardingError, match=r"dim 0 \(size 1001\).*several mesh axes must divide evenly"):
        fxshard.shard(Logits(), mesh, {"head.weight": P(("dp", "tp"), None)},
                      example_inputs=(torch.randint(0, 37, (2, 3)),))


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def _uneven_batch(rank: int, world: int) -> dict:
    from tests.test_training import train_on_local_batches

    mesh = fxshard.init_mesh(dp=world)
    torch.manual_seed(0)
    model = Regressor()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(7, 16, generator=g), torch.randn(7, 4, generator=g)) for _ in range(2)]
    local = lambda b: (b[0].chunk(world)[rank], b[1].chunk(world)[rank])
    sm = fxshard.shard(copy.deepcopy(model), mesh, None, example_inputs=batches[0],
                       in_specs=(P("dp", None), P("dp", None)))
    loss_err = train_on_local_batches(model, sm, batches, local, steps=3, lr=0.1)
    return {"loss_err": loss_err, "param_err": _max_param_diff(sm.full_state_dict(), model)}


def test_data_parallel_batch_of_7_on_2_ranks_means_over_the_global_batch():
    # rank 0 holds 4 rows, rank 1 holds 3: the mean must weight them 4/7 and 3/7, not 1/2 each
    for r in run_ranks(_uneven_batch, 2):
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r


def test_explain_and_memory_report_each_ranks_own_piece(fake_mesh):
    tokens = torch.randint(0, 37, (2, 3))
    mesh = fake_mesh(2, rank=1)  # the rank holding the shorter piece
    sm = fxshard.shard(Logits(), mesh, {"head": ColwiseParallel()}, example_inputs=(tokens,))
    text = fxshard.explain(sm)
    assert re.search(r"head_weight\s+input\s+\[1001, 24\]\s+S\(0\)\s+\[500, 24\]", text), text
    report = fxshard.memory(sm)
    assert report["params"] == 4 * (37 * 16 + 16 * 24 + 24 + 500 * 24 + 500), report


def _three_head_plan(fix: bool) -> dict:
    from tests.test_forward_parity import transformer_plan

    plan = transformer_plan(1)
    if fix:  # the error's suggested fix: keep q/k/v whole, split only the MLP
        for p in "qkv":
            plan[f"layers.0.attn.w{p}"] = ColwiseParallel(output_layouts=fxshard.Replicate())
        del plan["layers.0.attn.wo"]
    return plan


def test_head_count_that_cannot_be_split_is_the_documented_error(fake_mesh):
    from tests import models

    mesh = fake_mesh(2)
    model = models.Transformer(vocab=64, dim=24, n_heads=3, n_layers=1, max_seq=16)
    with pytest.raises(ShardingError, match=r"models.py:\d+ q = self.wq\(x\).view\(B, T, self.n_heads, "
                       r"self.head_dim\).*reshapes dim 2 \(size 24, split over a mesh axis of 2 ranks\) into "
                       r"\[3, 8\], and 2 does not divide the 3 groups .*output_layouts=Replicate\(\)"):
        fxshard.shard(model, mesh, _three_head_plan(False), example_inputs=(models.make_tokens(2, 8, 64),))


def _three_heads_fixed(rank: int, world: int) -> dict:
    from tests import models

    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = models.Transformer(vocab=64, dim=24, n_heads=3, n_layers=1, max_seq=16)
    tokens = models.make_tokens(2, 8, 64)
    ref = model(tokens)
    sm = fxshard.shard(copy.deepcopy(model), mesh, _three_head_plan(True), example_inputs=(tokens,))
    return {"err": (sm(tokens) - ref).abs().max().item()}


def test_head_count_error_fix_runs_with_parity():
    for r in run_ranks(_three_heads_fixed, 2):
        assert r["err"] <= TOL, r


def _odd_vocab_transformer(rank: int, world: int) -> dict:
    from tests import models
    from tests.test_forward_parity import transformer_plan

    mesh = fxshard.init_mesh(tp=world)
    model = models.TransformerWithLoss(vocab=65, dim=32, n_heads=4, n_layers=1, max_seq=16, tie=True)
    batches = [(models.make_tokens(2, 8, 65, seed=s), models.make_tokens(2, 8, 65, seed=s + 9)) for s in range(2)]
    sm = fxshard.shard(copy.deepcopy(model), mesh, transformer_plan(1), example_inputs=batches[0])
    ref_l, l = _train(model, sm, batches, lambda m, b: m(*b), "sgd", 3)
    return {"loss_err": max(abs(a - b) for a, b in zip(ref_l, l)), "param_err": _max_param_diff(sm.full_state_dict(), model),
            "rows": sm.tok_emb.weight.shape[0]}


def test_odd_vocab_tied_embedding_and_head_train_with_parity():
    # vocab 65 row-split: 33 + 32 rows; the tied head reads the same uneven pieces
    res = run_ranks(_odd_vocab_transformer, 2)
    assert [r["rows"] for r in res] == [33, 32]
    for r in res:
        assert r["loss_err"] <= 1e-4 and r["param_err"] <= TOL, r


def _dcp_make(world: int, seed: int):
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(seed)
    sm = fxshard.shard(Classifier(), mesh, {"head": ColwiseParallel(), "emb": RowwiseParallel()},
                       example_inputs=(torch.randint(0, 37, (2, 3)), torch.randint(0, N_CLASSES, (2, 3))))
    return sm, torch.optim.AdamW(sm.parameters(), lr=1e-2)


def _dcp_save(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    sm, opt = _dcp_make(world, 0)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        opt.zero_grad()
        sm(torch.randint(0, 37, (2, 3), generator=g), torch.randint(0, N_CLASSES, (2, 3), generator=g)).backward()
        opt.step()
    dcp.save({"model": sm.sharded_state_dict(), "optim": fxshard.optim_state_dict(sm, opt)}, checkpoint_id=path)
    osd = fxshard.optim_state_dict(sm, opt)["state"]["head.weight"]["exp_avg"]
    return {"params": sm.full_state_dict(), "exp_avg": osd.full_tensor()}


def _dcp_load(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    sm, opt = _dcp_make(world, 1)  # other initial weights: only the load can make them equal
    for g in opt.param_groups:  # create AdamW's state without moving the weights
        g["lr"] = 0.0
    opt.zero_grad()
    sm(torch.randint(0, 37, (2, 3)), torch.randint(0, N_CLASSES, (2, 3))).backward()
    opt.step()
    state = {"model": sm.sharded_state_dict(), "optim": fxshard.optim_state_dict(sm, opt)}
    dcp.load(state, checkpoint_id=path)
    sm.load_sharded_state_dict(state["model"])
    fxshard.load_optim_state_dict(sm, opt, state["optim"])
    exp_avg = fxshard.optim_state_dict(sm, opt)["state"]["head.weight"]["exp_avg"].full_tensor()
    return {"params": sm.full_state_dict(), "exp_avg": exp_avg, "rows": sm.head.weight.shape[0]}


def test_uneven_dcp_checkpoint_moves_between_2_and_4_ranks_and_unsharded():
    import tempfile

    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as path:
        saved = run_ranks(_dcp_save, 2, path)[0]
        loaded = run_ranks(_dcp_load, 4, path, timeout=300)
        assert [r["rows"] for r in loaded] == [251, 251, 251, 248]
        for r in loaded:
            assert all((r["params"][k] - v).abs().max().item() == 0.0 for k, v in saved["params"].items())
            assert (r["exp_avg"] - saved["exp_avg"]).abs().max().item() == 0.0
        sd = {k: torch.zeros_like(v) for k, v in Classifier().state_dict().items()}
        dcp.load({"model": sd}, checkpoint_id=path)
        assert all((sd[k] - v).abs().max().item() == 0.0 for k, v in saved["params"].items())


def test_sequence_parallel_with_odd_length_and_vocab_keeps_megatron_counts():
    # 15 tokens -> 8 + 7 per rank, 65-token vocab -> 33 + 32: the same collectives as the even case
    from tests.test_plans import llama_seed003_train

    for r in run_ranks(llama_seed003_train, 2, 15, 65, "greedy"):  # the greedy sweep's counts (test_plans)
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
        fwd = r["stats"]["forward"]
        assert fwd["reduce_scatter"]["count"] == 2 * 2 + 1 and fwd["all_gather"]["count"] == 2 * 2 + 1, fwd
        # gathers move the padded pieces: 2 ranks x 8 tokens of [2, 32] floats
        assert fwd["all_gather"]["bytes"] == (2 * 2 + 1) * 2 * 8 * 2 * 32 * 4, fwd


def _compiled_uneven(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = Classifier()
    batch = (torch.randint(0, 37, (4, 6)), torch.randint(0, N_CLASSES, (4, 6)))
    plan = {"head": ColwiseParallel(), "emb": RowwiseParallel()}
    sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=batch)
    loss = torch.compile(sm, backend="inductor", fullgraph=True)(*batch)
    loss.backward()
    ref = model(*batch)
    ref.backward()
    grad = sm._dtensor("head.weight", sm.head.weight.grad).full_tensor()
    via_backend = torch.compile(copy.deepcopy(model), backend=fxshard.backend(mesh, plan))(*batch)
    return {"loss_err": abs(loss.item() - ref.item()), "grad_err": (grad - model.head.weight.grad).abs().max().item(),
            "backend_err": abs(via_backend.item() - ref.item())}


def test_uneven_pieces_compile_with_inductor_and_the_fxshard_backend():
    for r in run_ranks(_compiled_uneven, 2, timeout=600):
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL and r["backend_err"] <= TOL, r


def _uneven_dropout(rank: int, world: int) -> dict:
    from tests.test_dropout import STYLE_PLAN, DropMLP, _data, _steps

    mesh = fxshard.init_mesh(tp=world)
    x, y = _data()
    model = DropMLP(16, 33)  # hidden 33: pieces of 17 and 16
    sm = fxshard.shard(copy.deepcopy(model), mesh, STYLE_PLAN, example_inputs=(x,), out_specs=(None, P(None, "tp")))
    ref_losses, ref_hs, _ = _steps(model, x, y, 3)
    losses, hs, _ = _steps(sm, x, y, 3)
    start, length = chunk(33, world, rank)
    full = sm.full_state_dict()
    drops = [n.meta[META_KEY] for n in sm._training.fwd.gm.graph.nodes  # the lowered dropouts' results
             if n.target is torch.ops.aten.mul.Tensor and any(st.lowering == "global_rng"
                                                               for st in n.meta.get(STRATEGY_KEY, ()))]
    return {"h_err": max((h - r[:, start:start + length]).abs().max().item() for h, r in zip(hs, ref_hs)),
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_err": max((full[k] - v).abs().max().item() for k, v in model.state_dict().items()),
            "hidden_drop": [repr(d) for d in drops if tuple(d.shape) == (8, 33)]}


def test_dropout_on_an_uneven_split_draws_globally_and_keeps_its_piece():
    for r in run_ranks(_uneven_dropout, 2):
        assert r["h_err"] <= TOL and r["loss_err"] <= TOL and r["param_err"] <= TOL, r
        assert r["hidden_drop"] == ["S(1)"], r  # dropped where it lives, not gathered first
