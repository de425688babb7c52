"""Fused CPU kernels kept out of the decompositions (issue 7): their rules, their graphs, their numbers.

* Every strategy the rules of the kept kernels admit is checked against the unsharded op on real
  tensors by the rule validator (``fxshard.devtools.validate``): each simulated rank runs the localized
  op on its local pieces and the pieces of the outputs must reassemble the global outputs.
* The traced training graphs keep the fused kernels (no attention, layer-norm or GELU pieces).
* Clean-up passes (no-op clones, view chains, traced layouts) keep values and work on 2-D meshes.
* Numbers end to end: a vocab-split embedding with a padding row trains like the unsharded one.
"""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxshard
from fxshard import P
from fxshard.planner.propagate import STRATEGY_KEY
from fxshard.tracing.simplify import drop_noop_clones, fold_views
from fxshard.tracing.decompositions import FUSED_BACKWARD, FUSED_FORWARD, joint_decomposition_table
from fxshard.tracing.export import trace_forward
from fxshard.core.placements import Part, R, S
from fxshard.rules.registry import lookup
from fxshard.devtools import validate
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan
from tests.test_rules import node_of, rnd, strategies, st_

aten = torch.ops.aten
PS = Part("sum")


# ----------------------------------------------------------------------------- strategy checker


def numerics(node: fx.Node, *tensors: torch.Tensor) -> int:
    """How many strategies of ``node``'s rule the validator (``fxshard.devtools.validate``) checked on 2
    simulated ranks against the unsharded op; fails on any mismatch."""
    checked, bad = validate.check_node(node, tensors)
    assert not bad, [f"{m.strategy}: {m.error}" for m in bad]
    return checked


# ----------------------------------------------------------------------------- attention


def _sdpa_fwd(q, k, v):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)


def _sdpa_fwd_mask(q, k, v, m):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=m)


def _sdpa_bwd(g, q, k, v, o, lse):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, lse, 0.0, True)


def _sdpa_bwd_mask(g, q, k, v, o, lse, m):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, lse, 0.0, False, attn_mask=m)


def test_sdpa_backward_rule_strategies():
    q = rnd(2, 4, 8, 16)
    o, lse = _sdpa_fwd(q, q, q)
    node = node_of(_sdpa_bwd, q, q, q, q, o, lse, op=aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    s = strategies(node)
    assert st_((R,) * 6, (R, R, R)) in s
    assert st_((S(0),) * 6, (S(0),) * 3) in s  # batch
    assert st_((S(1),) * 6, (S(1),) * 3) in s  # heads
    assert not any(o_ != (R, R, R) and o_[0] in (S(2), S(3)) for _, o_, _ in s)  # sequence / head dim
    assert not any(isinstance(p, Part) for i, _, _ in s for p in i)  # see rules/attention.py
    # with dropout the kernel draws its own mask: only replication
    node = node_of(lambda g, q, k, v, o, lse: aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, o, lse, 0.1, True), q, q, q, q, o, lse, op=aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert strategies(node) == {st_((R,) * 6, (R, R, R))}


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "mask"])
def test_sdpa_rules_match_the_unsharded_kernels(mask):
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(4))
    margs = (torch.randn(2, 1, 8, 8, generator=g),) if mask else ()
    fwd_fn, bwd_fn = (_sdpa_fwd_mask, _sdpa_bwd_mask) if mask else (_sdpa_fwd, _sdpa_bwd)
    fwd = node_of(fwd_fn, q, k, v, *margs, op=aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert numerics(fwd, q, k, v, *margs) == 3
    o, lse = fwd_fn(q, k, v, *margs)
    bwd = node_of(bwd_fn, dout, q, k, v, o, lse, *margs,
                  op=aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert numerics(bwd, dout, q, k, v, o, lse, *margs) == 3


# ----------------------------------------------------------------------------- layer norm


def _ln_bwd(mask):
    def f(g, x, w, b):
        _, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
        return aten.native_layer_norm_backward(g, x, [8], mean, rstd, w, b, mask)
    return f


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, True]])
def test_layer_norm_backward_rule(mask):
    gen = torch.Generator().manual_seed(2)
    g, x = torch.randn(4, 6, 8, generator=gen), torch.randn(4, 6, 8, generator=gen)
    w, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    node = node_of(_ln_bwd(mask), g, x, w, b, op=aten.native_layer_norm_backward.default)
    s = strategies(node)
    outs = lambda *p: tuple(q if on else None for q, on in zip(p, mask))  # noqa: E731
    assert st_((S(0),) * 4 + (R, R), outs(S(0), PS, PS)) in s  # batch: weight/bias grads are partial sums
    assert st_((S(1),) * 4 + (R, R), outs(S(1), PS, PS)) in s
    assert not any(i[0] == S(2) for i, _, _ in s)  # the normalized dim stays whole
    _, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
    assert numerics(node, g, x, mean, rstd, w, b) == 3


def test_layer_norm_backward_rule_without_affine():
    gen = torch.Generator().manual_seed(3)
    g, x = torch.randn(4, 6, 8, generator=gen), torch.randn(4, 6, 8, generator=gen)

    def f(g, x):
        _, mean, rstd = aten.native_layer_norm(x, [8], None, None, 1e-5)
        return aten.native_layer_norm_backward(g, x, [8], mean, rstd, None, None, [True, False, False])

    node = node_of(f, g, x, op=aten.native_layer_norm_backward.default)
    assert st_((S(0),) * 4, (S(0), None, None)) in strategies(node)
    _, mean, rstd = aten.native_layer_norm(x, [8], None, None, 1e-5)
    assert numerics(node, g, x, mean, rstd) == 3


# ----------------------------------------------------------------------------- activation backward


ACT_BACKWARD = [
    ("gelu", lambda g, x: aten.gelu_backward(g, x), aten.gelu_backward.default),
    ("gelu_tanh", lambda g, x: aten.gelu_backward(g, x, approximate="tanh"), aten.gelu_backward.default),
    ("silu", lambda g, x: aten.silu_backward(g, x), aten.silu_backward.default),
    ("threshold", lambda g, x: aten.threshold_backward(g, x, 0.0), aten.threshold_backward.default),
    ("sigmoid", lambda g, y: aten.sigmoid_backward(g, torch.sigmoid(y)), aten.sigmoid_backward.default),
    ("tanh", lambda g, y: aten.tanh_backward(g, torch.tanh(y)), aten.tanh_backward.default),
]


@pytest.mark.parametrize("fn,op", [(f, op) for _, f, op in ACT_BACKWARD], ids=[n for n, _, _ in ACT_BACKWARD])
def test_activation_backward_is_pointwise_and_linear_in_the_gradient(fn, op):
    gen = torch.Generator().manual_seed(4)
    g, x = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    node = node_of(fn, g, x, op=op)
    s = strategies(node)
    assert st_((S(0), S(0)), S(0)) in s and st_((S(1), S(1)), S(1)) in s
    assert st_((PS, R), PS) in s  # linear in the incoming gradient
    assert (R, PS) not in {i for i, _, _ in s} and (PS, PS) not in {i for i, _, _ in s}
    second = x if op not in (aten.sigmoid_backward.default, aten.tanh_backward.default) else torch.sigmoid(x)
    assert numerics(node, g, second) == len(s) + 1  # and the strided split S(1, outer=2) of dim 1 (8)


# ----------------------------------------------------------------------------- embedding backward


def _emb_bwd(pad: int, freq: bool):
    return lambda g, i: aten.embedding_dense_backward(g, i, 16, pad, freq)


def test_embedding_dense_backward_rule():
    gen = torch.Generator().manual_seed(5)
    g, idx = torch.randn(2, 4, 8, generator=gen), torch.randint(0, 16, (2, 4), generator=gen)
    node = node_of(_emb_bwd(-1, False), g, idx, op=aten.embedding_dense_backward.default)
    s = strategies(node)
    assert st_((S(2), R), S(1)) in s  # colwise: the embedding dim
    assert st_((R, R), S(0), "masked_embedding_backward") in s  # vocab split: this rank's rows only
    assert st_((PS, R), PS) in s  # linear in the gradient
    assert not any(i[1] != R for i, _, _ in s)  # split tokens are gathered (see rules/embedding.py)
    assert numerics(node, g, idx) == 4  # the masked vocab-split accumulation included
    # scale_grad_by_freq counts tokens per row: no masked lookup (misses would be counted for row 0)
    node = node_of(_emb_bwd(3, True), g, idx, op=aten.embedding_dense_backward.default)
    s = strategies(node)
    assert not any(lw for _, _, lw in s) and st_((PS, R), PS) in s
    assert numerics(node, g, idx) == len(s)


def _embedding_train(rank: int, world: int, vocab: int, padding_idx: Optional[int]) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, 8, padding_idx=padding_idx), nn.Linear(8, 4))
    tokens = torch.tensor([[0, 3, 3, 9], [vocab - 1, 8, 7, 3]])
    sm = fxshard.shard(copy.deepcopy(model), mesh, {"0.weight": P("tp", None)}, example_inputs=(tokens,))
    grads = []
    for m in (model, sm):
        m.zero_grad()
        m(tokens).square().sum().backward()
        grads.append(m.get_parameter("0.weight").grad)
    mine = grads[0].chunk(world, 0)[rank]
    lowered = [n for p in sm._programs() for n in p.gm.graph.nodes
               if n.target is aten.embedding_dense_backward.default
               and any(st.lowering == "masked_embedding_backward" for st in n.meta.get(STRATEGY_KEY, ()))]
    return {"err": (grads[1] - mine).abs().max().item(), "lowered": len(lowered),
            "stats": fxshard.comm_stats(sm)["backward"]}


@pytest.mark.parametrize("vocab,padding_idx", [(16, None), (16, 3), (16, 9), (15, 7)],
                         ids=["no_pad", "pad_rank0", "pad_rank1", "uneven_8_7_pad_rank0"])
def test_vocab_split_embedding_backward_matches_unsharded(vocab, padding_idx):
    for res in run_ranks(_embedding_train, 2, vocab, padding_idx):
        assert res["err"] <= 1e-6, res
        assert res["lowered"] == 1  # the fused backward with a masked local accumulation
        assert res["stats"] == {}  # each rank accumulates its own rows: no backward collective


# ----------------------------------------------------------------------------- traced graphs


def _targets(sm: fxshard.ShardedModule) -> dict[str, set]:
    return {p.label: {n.target for n in p.gm.graph.nodes if n.op == "call_function"} for p in sm._programs()}


def test_training_graph_keeps_the_fused_kernels(mesh2):
    model = models.Transformer(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16)
    sm = fxshard.shard(model, mesh2, transformer_plan(2), example_inputs=(models.make_tokens(2, 16, 64),),
                       planner="greedy")  # Megatron's pattern, asserted below (the solver's differs at this width)
    t = _targets(sm)
    assert torch.ops.fxshard.attention.default in t["forward"]  # attention: one device-neutral node
    for op in (torch.ops.fxshard.attention_backward.default,
               aten.native_layer_norm_backward.default, aten.gelu_backward.default,
               aten.embedding_dense_backward.default):
        assert op in t["backward"], op
    for pieces in (aten.bmm.default, aten.amax.default, aten.exp.default, aten.erf.default, aten.index_put.default):
        assert pieces not in t["forward"] | t["backward"], pieces  # nothing of the fused kernels decomposed
    for prog in sm._programs():
        assert not prog.fallbacks
        for n in prog.gm.graph.nodes:  # heads split through the fused attention, both directions
            if n.target in (torch.ops.fxshard.attention.default, torch.ops.fxshard.attention_backward.default):
                out = n.meta[STRATEGY_KEY][0].output
                assert (out[0] if isinstance(out, tuple) else out) == S(1), n.name
    # Megatron: 2 all_reduces per layer each way, + the vocab-split embedding (forward) and the tied
    # vocab-split head's input gradient (backward): the fused kernels add no communication
    stats = fxshard.comm_stats(sm)
    assert stats["forward"]["all_reduce"]["count"] == 2 * 2 + 1
    assert stats["backward"] == {"all_reduce": stats["backward"]["all_reduce"]}
    assert stats["backward"]["all_reduce"]["count"] == 2 * 2 + 1


def test_tables_keep_what_has_rules():
    table = joint_decomposition_table()
    for op in FUSED_FORWARD + FUSED_BACKWARD:
        assert op not in table, op
        assert lookup(op) is not None, op  # a kept kernel without a rule would run replicated
    # loss parallelism needs softmax pieces: a split class dim becomes Partial max / sum reductions
    assert aten._softmax.default in table and aten._log_softmax.default in table


def test_math_attention_still_decomposes_and_shards(mesh2):
    """Where the CPU kernel is not used (math backend, attention dropout), attention arrives in pieces."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = models.Transformer(vocab=64, dim=32, n_heads=4, n_layers=1, max_seq=16)
    with sdpa_kernel(SDPBackend.MATH):
        sm = fxshard.shard(model, mesh2, transformer_plan(1), example_inputs=(models.make_tokens(2, 16, 64),))
    t = _targets(sm)
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in t["forward"]
    assert aten.bmm.default in t["forward"] and not any(p.fallbacks for p in sm._programs())


def test_sequence_parallel_linear_backward_gathers_its_gradient_once(mesh2):
    """A rowwise linear's backward reads ``g`` (input gradient) and ``permute(g)`` (weight gradient):
    with ``g`` sequence-split one all_gather of ``g`` serves both, as in Megatron-SP."""
    from tests.test_plans import llama_seed003_plan

    model = models.LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)
    batch = (models.make_tokens(2, 16, 64, seed=0), models.make_tokens(2, 16, 64, seed=9))
    sm = fxshard.shard(model, mesh2, llama_seed003_plan(), example_inputs=batch)
    bwd = fxshard.comm_stats(sm)["backward"]
    # per layer: the gradients into wo and w2 (sequence shards) gathered once each; + the embedding's
    assert bwd["all_gather"]["count"] == 2 * 2 + 1, bwd
    assert bwd["reduce_scatter"]["count"] == 2 * 2 + 1 and "all_to_all" not in bwd, bwd


# ----------------------------------------------------------------------------- clean-up passes


class _Dropout0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.lin(x))
        return y.clone().t().contiguous() + y  # a no-op clone, and a clone that makes a transpose contiguous


def test_drop_noop_clones_keeps_values_and_needed_copies():
    x = torch.randn(8, 8)
    model = _Dropout0().train()
    traced = trace_forward(model, (x,), {})
    clones = [n for n in traced.gm.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == 1 and clones[0].args[0].target is aten.permute.default  # the transpose copy stays
    params = [p for p in model.parameters()]
    torch.testing.assert_close(traced.gm(*params, x)[0], model(x))


def test_fold_views_composes_permutes_and_views():
    def f(x):
        a = x.permute(1, 0, 2).permute(1, 0, 2)  # cancels
        b = x.view(6, 4).view(2, 12).view(24)
        c = x.permute(2, 0, 1).permute(0, 2, 1)
        return a + 1, b, c

    x = torch.randn(2, 3, 4)
    gm = make_fx(f)(x)
    want = gm(x)
    fold_views(gm)
    perms = [n for n in gm.graph.nodes if n.target is aten.permute.default]
    views = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert len(perms) == 1 and list(perms[0].args[1]) == [2, 1, 0]
    assert len(views) == 1 and views[0].args[0].op == "placeholder"
    for a, b in zip(gm(x), want):
        torch.testing.assert_close(a, b)
        assert a.stride() == b.stride()


def test_2d_mesh_fsdp_attention_keeps_traced_layouts(fake_mesh):
    """q/k/v arrive all-reduced (contiguous) where the trace saw transposed views; the fused kernel's
    outputs follow their inputs' layout, so the views after it need the traced layout back."""
    from tests.test_mesh2d import transformer_specs

    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16, tie=True)
    batch = (models.make_tokens(4, 16, 64, seed=0), models.make_tokens(4, 16, 64, seed=10))
    sm = fxshard.shard(model, mesh, transformer_specs(2, True), example_inputs=batch, in_specs=(P("dp"), P("dp")))
    local = tuple(t.chunk(2)[0] for t in batch)
    sm(*local).backward()  # the fake group's collectives return garbage of the right shape: layouts only
