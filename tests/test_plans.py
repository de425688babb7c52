"""torch's ParallelStyle plans moved over unchanged: torch's test Transformer and seed 003's Llama plan,
with and without sequence parallel, on 2 real gloo ranks vs the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
)

import fxshard
from fxshard.models import llama_seed003_plan  # noqa: F401  (also used by other tests)
from tests import models
from tests.dist_utils import run_ranks
from tests.test_training import _max_param_diff, _train

TOL = 1e-5


def torch_transformer_plan(use_seq_parallel: bool) -> dict:
    """The plan ``common_dtensor.Transformer.parallelize`` builds, written as one FQN-glob dict."""
    if use_seq_parallel:
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "norm": SequenceParallel(),
            "layers.*.attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.feed_forward.w1": ColwiseParallel(input_layouts=Shard(1)),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    else:
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
    for p in ("wq", "wk", "wv"):
        plan[f"layers.*.attention.{p}"] = ColwiseParallel()
    return plan


def _torch_transformer(rank: int, world: int, seq_parallel: bool, seq: int = 16) -> dict:
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    # vocab 64 > 32 tokens: as in real models, all-reducing embedding outputs beats gathering the table
    args = ModelArgs(n_layers=2, vocab_size=64, max_seq_len=16, dim=16, n_heads=4, dropout_p=0.0, weight_tying=True)
    model = Transformer(args)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 64, (2, seq), generator=g), torch.randint(0, 64, (2, seq), generator=g))
               for _ in range(2)]
    sm = fxshard.shard(copy.deepcopy(model), mesh, torch_transformer_plan(seq_parallel), example_inputs=(batches[0][0],))
    with torch.no_grad():
        fwd_err = (sm(batches[0][0]) - model(batches[0][0])).abs().max().item()
    loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())
    ref_l, l = _train(model, sm, batches, loss_fn, "sgd", 3)
    return {"fwd_err": fwd_err, "loss_err": max(abs(a - b) for a, b in zip(ref_l, l)),
            "param_err": _max_param_diff(sm.full_state_dict(), model), "stats": fxshard.comm_stats(sm),
            "heads": model.layers[0].attention.n_heads}


def test_torch_test_transformer_with_its_own_plan():
    for res in run_ranks(_torch_transformer, 2, False):
        assert res["fwd_err"] <= TOL and res["loss_err"] <= TOL and res["param_err"] <= TOL, res
        assert res["heads"] == 4  # the model keeps its global head count: no local-head workaround
        fwd, bwd = res["stats"]["forward"], res["stats"]["backward"]
        # Megatron: 2 all_reduces per layer each way. The tied 64 x 16 table is gathered once (4 KiB) for
        # both the embedding lookup and the head, which then run replicated: no embedding all_reduce and no
        # logits gather, forward or backward (the greedy sweep all-reduces the embedding's partial sum and
        # gathers the 8 KiB of logits: one collective more each way). The position table (16 rows, fewer
        # than 2x the tokens) is cheaper to gather than its output is to all-reduce (DTensor all-reduces).
        assert fwd == {"all_reduce": fwd["all_reduce"], "all_gather": fwd["all_gather"]}
        assert fwd["all_reduce"]["count"] == 2 * 2 and fwd["all_gather"]["count"] == 2
        assert fwd["all_gather"]["bytes"] == 64 * 16 * 4 + 16 * 16 * 4
        assert set(bwd) == {"all_reduce"} and bwd["all_reduce"]["count"] == 2 * 2


@pytest.mark.parametrize("seq", [16, 15])  # 15: uneven sequence pieces of 8 and 7, same collectives
def test_torch_test_transformer_sequence_parallel(seq):
    for res in run_ranks(_torch_transformer, 2, True, seq):
        assert res["fwd_err"] <= TOL and res["loss_err"] <= TOL and res["param_err"] <= TOL, res
        fwd, bwd = res["stats"]["forward"], res["stats"]["backward"]
        # Megatron-SP: each layer's all_reduce becomes reduce_scatter + all_gather, both directions
        assert "all_reduce" not in fwd
        # + the vocab-split embedding's partial output, reduce-scattered to the sequence split (Megatron-SP)
        assert fwd["reduce_scatter"]["count"] == 2 * 2 + 1
        # + the head's input and the small positional table (gathered once)
        assert fwd["all_gather"]["count"] == 2 * 2 + 2
        assert bwd["reduce_scatter"]["count"] == 2 * 2 and bwd["all_gather"]["count"] == 2 * 2 + 2
        # the only backward all_reduces are the replicated norm weights' gradients (tiny), as in Megatron-SP,
        # all 2 * (2 * 2 + 1) of them in one gradient bucket (bucket_mb, default 25 MiB)
        assert bwd["all_reduce"]["count"] == 1 and bwd["all_reduce"]["bytes"] <= 10 * 16 * 4


def llama_seed003_train(rank: int, world: int, seq: int = 16, vocab: int = 64, planner: str = "global") -> dict:
    """3 SGD steps of the seed 003 plan on a 2-layer Llama decoder vs unsharded: errors and comm_stats."""
    mesh = fxshard.init_mesh(tp=world)
    model = models.LlamaDecoder(vocab=vocab, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)
    batches = [(models.make_tokens(2, seq, vocab, seed=s), models.make_tokens(2, seq, vocab, seed=s + 9))
               for s in range(2)]
    sm = fxshard.shard(copy.deepcopy(model), mesh, llama_seed003_plan(), example_inputs=batches[0], planner=planner)
    ref_l, l = _train(model, sm, batches, lambda m, b: m(*b), "sgd", 3)
    return {"loss_err": max(abs(a - b) for a, b in zip(ref_l, l)),
            "param_err": _max_param_diff(sm.full_state_dict(), model), "stats": fxshard.comm_stats(sm)}


def test_seed003_llama_plan_with_sequence_parallel_and_loss_parallel():
    # the greedy sweep's loss parallel: the global planner gathers these 8 KiB of logits (latency outweighs bytes)
    for res in run_ranks(llama_seed003_train, 2, 16, 64, "greedy"):
        assert res["loss_err"] <= TOL and res["param_err"] <= TOL, res
        fwd = res["stats"]["forward"]
        logits_bytes = 2 * 16 * 64 * 4
        # no all_gather of the logits: loss statistics only (per token), the rest is SP traffic
        assert fwd["reduce_scatter"]["count"] == 2 * 2 + 1 and fwd["all_gather"]["count"] == 2 * 2 + 1, fwd
        assert fwd["all_gather"]["bytes"] == (2 * 2 + 1) * 2 * 16 * 32 * 4  # activations only
        assert fwd["all_reduce"]["bytes"] < logits_bytes / 8, fwd  # max / sum-exp / target logit per token


def _parametrized(rank: int, world: int) -> dict:
    """net1 under weight norm, spectral norm (power-iteration buffers updated in forward) or an orthogonal
    parametrization, Colwise; net2 Rowwise: 2 SGD steps next to the unsharded model."""
    import torch.nn as nn
    from torch.nn.utils import parametrizations

    mesh = fxshard.init_mesh(tp=world)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    out = {}
    for kind in ("weight_norm", "spectral_norm", "orthogonal"):
        model = models.ToyModel(16, 32)
        model.net1 = getattr(parametrizations, kind)(model.net1)
        ref = copy.deepcopy(model)
        sm = fxshard.shard(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()}, example_inputs=(x,))
        opt, ref_opt = torch.optim.SGD(sm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        fwd = 0.0
        for _ in range(2):
            got, want = sm(x), ref(x)
            fwd = max(fwd, (got - want).abs().max().item())
            got.square().sum().backward(), want.square().sum().backward()
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        full = sm.full_state_dict()
        out[kind] = {"fwd": fwd, "state": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
                     "keys": sorted(full) == sorted(ref.state_dict()), "stats": fxshard.comm_stats(sm)}
    return out


def test_styles_on_parametrized_weights_shard_the_computed_weight():
    """A style on a module whose weight torch.nn.utils.parametrize computes raised a bare KeyError ('net1.weight'
    is no parameter); the computed weight is now pinned to the style's layout, the parametrization's own
    parameters stay replicated (computed on every rank, sliced without communication)."""
    for res in run_ranks(_parametrized, 2):
        for kind, r in res.items():
            assert r["fwd"] <= TOL and r["state"] <= TOL and r["keys"], (kind, r)
            assert r["stats"]["forward"] == {"all_reduce": {"count": 1, "bytes": 4 * 16 * 4}}, (kind, r["stats"])


def _mismatched(rank: int, world: int) -> str:
    mesh = fxshard.init_mesh(tp=world)
    model = models.ToyModel(16, 32)
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel() if rank == 0 else ColwiseParallel()}
    try:
        fxshard.shard(model, mesh, plan, example_inputs=(torch.randn(4, 16),))
    except fxshard.ShardingError as e:
        return str(e)
    return ""


def test_plan_differing_between_ranks_is_an_error_not_a_hang():
    msgs = run_ranks(_mismatched, 2, timeout=60)
    for m in msgs:
        assert "plan entry 'net2'" in m and "rank 1" in m and "differs" in m, m


def _stages(rank: int, world: int) -> dict:
    """Two pipeline stages (``pp`` coordinate), each sharding its OWN model over its own ``tp`` sub-mesh;
    then, on the whole 2x2 mesh, a plan that differs on the last rank only."""
    mesh = fxshard.init_mesh(pp=2, tp=2)
    stage = mesh.get_coordinate()[0]
    torch.manual_seed(stage)
    model = models.ToyModel(16, 32 if stage == 0 else 64)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    sm = fxshard.shard(copy.deepcopy(model), mesh["tp"], {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
                       example_inputs=(x,), src_data_rank=None)
    fwd_err = (sm(x) - model(x)).abs().max().item()
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel() if rank != 3 else ColwiseParallel()}
    try:
        fxshard.shard(models.ToyModel(16, 32), mesh, plan, example_inputs=(x,))
        msg = ""
    except fxshard.ShardingError as e:
        msg = str(e)
    return {"fwd_err": fwd_err, "msg": msg}


def test_sub_meshes_shard_their_own_models_and_a_difference_on_one_rank_reaches_all():
    """The consistency check compares the ranks of the mesh given to shard(), not the whole world: pipeline
    stages sharding different models over their own tp sub-meshes are not an error (nor a hang)."""
    for res in run_ranks(_stages, 4, timeout=120):
        assert res["fwd_err"] <= 1e-5, res
        assert "plan entry 'net2'" in res["msg"] and "rank 3" in res["msg"] and "differs" in res["msg"], res
