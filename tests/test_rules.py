"""Op rules, one family at a time, called the way the propagation engine calls them.

Each test traces a tiny function with ``make_fx`` (fake tensors, so every node
carries ``meta["val"]``), builds the rule's :class:`OpCall` exactly as
``planner/propagate.py`` does, and checks which strategies the rule admits on a
mesh axis of size ``n`` (default 2) -- the ones that must be there and the
ones that would compute a wrong result. No process group is needed.

The hypothesis test at the end checks the view algebra against real tensors:
whenever ``view_shard`` says a split survives a reshape, each rank's local
input chunk, reshaped to the local output shape, must be exactly that rank's
chunk of the global output.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fxshard  # noqa: F401  (registers every rule)
from fxshard.core.errors import ShardingError
from fxshard.core.placements import Part, R, S
from fxshard.rules.registry import (OpCall, Strategy, allows_uneven, lookup, out_shape_of, register, registered_ops,
                              tensor_inputs)
from fxshard.rules.view import view_groups, view_shard
from fxshard.core.symbolic import sym_shape

aten = torch.ops.aten
PS, PMAX, PMIN = Part("sum"), Part("max"), Part("min")


# ----------------------------------------------------------------------------- helpers


def op_nodes(fn: Callable, *args: Any) -> list[torch.fx.Node]:
    """The call_function nodes of ``fn`` traced on fake tensors (getitems dropped)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]


def node_of(fn: Callable, *args: Any, op: Any = None) -> torch.fx.Node:
    """The (first) node of ``op`` in ``fn``'s graph; the last op when ``op`` is None."""
    nodes = op_nodes(fn, *args)
    if op is None:
        return nodes[-1]
    hits = [n for n in nodes if n.target is op]
    assert hits, f"{op} not in {[n.target for n in nodes]}"
    return hits[0]


def call_of(node: torch.fx.Node, pls: Optional[Sequence] = None) -> OpCall:
    """The OpCall the propagation engine would build for ``node`` on one mesh axis."""
    ins = tensor_inputs(node)
    pls = list(pls) if pls is not None else [R] * len(ins)
    assert len(pls) == len(ins), f"{node.target} has {len(ins)} tensor inputs"
    return OpCall(node, [sym_shape(i.meta["val"]) for i in ins], pls, out_shape_of(node),
                  [i.meta["val"].dtype for i in ins])


def strategies(node: torch.fx.Node, pls: Optional[Sequence] = None, n: int = 2) -> set[tuple]:
    """``{(inputs, output, lowering)}`` the registered rule admits for ``node``."""
    rule = lookup(node.target)
    assert rule is not None, f"no rule for {node.target}"
    res = rule(call_of(node, pls), n)
    assert all(isinstance(s, Strategy) for s in res)
    return {(tuple(s.inputs), s.output, s.lowering) for s in res}


def st_(inputs: Sequence, output: Any, lowering: Optional[str] = None) -> tuple:
    return (tuple(inputs), output, lowering)


def outputs_for(strats: set[tuple], inputs: Sequence) -> set:
    """Every output placement admitted for exactly these input placements."""
    return {o for i, o, _ in strats if i == tuple(inputs)}


def inputs_giving(strats: set[tuple], output: Any) -> set:
    return {i for i, o, _ in strats if o == output}


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# ----------------------------------------------------------------------------- registry


def test_every_rule_family_is_registered():
    for op in (aten.add.Tensor, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.sum.dim_IntList,
               aten.amax.default, aten.view.default, aten.cat.default, aten.native_layer_norm.default,
               aten.embedding.default, aten.gather.default, aten.full.default, aten.convolution.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert op in registered_ops()


def test_rules_are_uneven_safe_unless_they_opt_out():
    """``register`` defaults to uneven-safe; the rules that only split dims that divide say so."""
    opted_out = {op for op in registered_ops() if not allows_uneven(op)}
    assert opted_out == {aten.convolution.default, aten.convolution_backward.default,
                         aten._scaled_dot_product_flash_attention_for_cpu.default,
                         aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                         torch.ops.fxshard.attention.default, torch.ops.fxshard.attention_backward.default}, opted_out
    assert len(registered_ops()) > 10 * len(opted_out)


def test_registering_an_op_twice_raises():
    before = lookup(aten.mm.default)

    def other(call, n):  # pragma: no cover - never called
        return []

    with pytest.raises(ShardingError, match=r"aten\.mm\.default already has a sharding rule"):
        register(aten.mm.default, other)
    with pytest.raises(ShardingError, match="already has a sharding rule"):
        register([aten.bmm.default])(other)
    assert lookup(aten.mm.default) is before  # the original rule is untouched


# ----------------------------------------------------------------------------- pointwise


def test_pointwise_add_broadcasting():
    node = node_of(lambda x, b: x + b, rnd(4, 8), rnd(8))
    s = strategies(node)
    assert st_((S(0), R), S(0)) in s  # bias broadcasts over the split dim: replicated
    assert st_((S(1), S(0)), S(1)) in s  # a split output dim splits the bias along its own dim
    assert st_((PS, PS), PS) in s  # add is linear
    assert (PS, R) not in {i for i, _, _ in s}  # x_r + b summed over ranks counts b n times
    assert (R, PS) not in {i for i, _, _ in s}


def test_pointwise_size_one_broadcast_dim_is_replicated():
    node = node_of(lambda x, y: x * y, rnd(4, 1), rnd(4, 8))
    s = strategies(node)
    assert st_((R, S(1)), S(1)) in s
    assert st_((S(0), S(0)), S(0)) in s
    assert not any(i[0] == S(1) for i, _, _ in s)  # a size-1 dim cannot be split


def test_pointwise_affine_scalar_add_is_not_linear():
    node = node_of(lambda x: x + 1, rnd(4, 8))
    s = strategies(node)
    assert st_((S(0),), S(0)) in s and st_((S(1),), S(1)) in s
    assert not any(isinstance(o, Part) for _, o, _ in s)  # sum_r (x_r + 1) != x + 1


def test_pointwise_mul_and_div_partial_kinds():
    mul = strategies(node_of(lambda x, y: x * y, rnd(4, 8), rnd(4, 8)))
    assert st_((PS, R), PS) in mul and st_((R, PS), PS) in mul
    assert (PS, PS) not in {i for i, _, _ in mul}  # bilinear, not linear in both at once
    scal = strategies(node_of(lambda x: x * 3.0, rnd(4, 8)))
    assert st_((PS,), PS) in scal
    div = strategies(node_of(lambda x, y: x / y, rnd(4, 8), rnd(4, 8)))
    assert st_((PS, R), PS) in div
    assert (R, PS) not in {i for i, _, _ in div}  # 1/y is not linear in y


def test_pointwise_nonlinear_admits_no_partial():
    for fn in (torch.relu, torch.exp, torch.nn.functional.gelu, lambda x: x > 0):
        s = strategies(node_of(fn, rnd(4, 8)))
        assert st_((S(0),), S(0)) in s and st_((S(1),), S(1)) in s
        assert not any(isinstance(p, Part) for i, o, _ in s for p in i + (o,)), fn


def test_pointwise_copy_keeps_every_partial_kind():
    s = strategies(node_of(torch.clone, rnd(4, 8)))
    for p in (PS, PMAX, PMIN):
        assert st_((p,), p) in s


def test_pointwise_dtype_cast_keeps_only_exact_partials():
    # float -> float: a sum of terms casts term by term
    s = strategies(node_of(lambda x: x.to(torch.float64), rnd(4, 8)), [PS])
    assert st_((PS,), PS) in s and st_((PMAX,), PMAX) in s
    # float -> int: trunc(a) + trunc(b) != trunc(a + b), but trunc is monotonic (max/min commute)
    s = strategies(node_of(lambda x: x.to(torch.int64), rnd(4, 8)), [PS])
    assert (PS,) not in {i for i, _, _ in s}
    assert st_((PMAX,), PMAX) in s
    # float -> bool: neither sums nor maxima survive
    s = strategies(node_of(lambda x: x.to(torch.bool), rnd(4, 8)), [PS])
    assert not any(isinstance(p, Part) for i, o, _ in s for p in i + (o,))


def test_pointwise_where_is_linear_in_its_values_only():
    node = node_of(lambda c, x, y: torch.where(c, x, y), rnd(4, 8) > 0, rnd(4, 8), rnd(4, 8))
    s = strategies(node)
    assert st_((R, PS, PS), PS) in s
    assert not any(i[0] == PS for i, _, _ in s)  # the condition is never partial
    assert st_((S(1), S(1), S(1)), S(1)) in s


def test_pointwise_keeps_a_strided_split():
    s = strategies(node_of(torch.relu, rnd(8, 4)), [S(0, 2)])
    assert st_((S(0, 2),), S(0, 2)) in s
    # outer 4 * n 2 does not divide 4: a strided split the size cannot hold is not offered
    s = strategies(node_of(torch.relu, rnd(4, 4)), [S(0, 4)])
    assert not any(o == S(0, 4) for _, o, _ in s)


# ----------------------------------------------------------------------------- matmul


def test_mm_einsum_strategies():
    s = strategies(node_of(torch.mm, rnd(4, 8), rnd(8, 6)))
    assert st_((R, R), R) in s
    assert st_((S(0), R), S(0)) in s  # rows of the lhs
    assert st_((R, S(1)), S(1)) in s  # columns of the rhs
    assert st_((S(1), S(0)), PS) in s  # the contracted dim: partial sums
    assert st_((PS, R), PS) in s and st_((R, PS), PS) in s
    assert (S(1), R) not in {i for i, _, _ in s}  # a split k on one side only is wrong
    assert (PS, PS) not in {i for i, _, _ in s}


def test_mm_splits_uneven_dims_plainly_but_never_strided():
    s = strategies(node_of(torch.mm, rnd(3, 8), rnd(8, 6)))
    assert st_((S(0), R), S(0)) in s  # 3 rows: torch.chunk pieces of 2 and 1
    assert st_((R, S(1)), S(1)) in s
    # a strided split must divide: 6 rows seen as [2, 3] cannot split the 3 over 2 ranks
    s = strategies(node_of(torch.mm, rnd(6, 8), rnd(8, 6)), [S(0, 2), R])
    assert st_((S(0, 2), R), S(0, 2)) not in s and st_((S(0), R), S(0)) in s


def test_bmm_einsum_strategies():
    s = strategies(node_of(torch.bmm, rnd(2, 4, 8), rnd(2, 8, 6)))
    assert st_((S(0), S(0)), S(0)) in s  # batch
    assert st_((S(1), R), S(1)) in s
    assert st_((R, S(2)), S(2)) in s
    assert st_((S(2), S(1)), PS) in s
    # a strided batch split ([B*H] with H split) flows through when both sides have it
    s = strategies(node_of(torch.bmm, rnd(8, 4, 8), rnd(8, 8, 6)), [S(0, 2), S(0, 2)])
    assert st_((S(0, 2), S(0, 2)), S(0, 2)) in s


def test_addmm_bias_follows_the_output():
    node = node_of(lambda b, x, w: torch.addmm(b, x, w), rnd(6), rnd(4, 8), rnd(8, 6))
    s = strategies(node)
    assert st_((R, S(0), R), S(0)) in s  # bias broadcasts over rows
    assert st_((S(0), R, S(1)), S(1)) in s  # bias split with the columns
    assert st_((PS, S(1), S(0)), PS) in s  # rowwise: the bias becomes a partial term (zero off rank 0)
    assert not any(o == PS and i[0] == R for i, o, _ in s)  # a replicated bias would be added n times


# ----------------------------------------------------------------------------- reductions


def test_sum_reduction_partial_and_kept_dims():
    s = strategies(node_of(lambda x: x.sum(1), rnd(4, 8)))
    assert st_((S(1),), PS) in s  # reduced split dim -> partial sum
    assert st_((S(0),), S(0)) in s
    assert st_((PS,), PS) in s
    s = strategies(node_of(lambda x: x.sum(0), rnd(4, 8)))
    assert st_((S(1),), S(0)) in s  # the surviving dim renumbers
    s = strategies(node_of(lambda x: x.sum(0, keepdim=True), rnd(4, 8)))
    assert st_((S(1),), S(1)) in s
    s = strategies(node_of(lambda x: x.sum(), rnd(4, 8)))
    assert st_((S(0),), PS) in s and st_((S(1),), PS) in s


def test_mean_reduction_lowers_to_scaled_sum():
    s = strategies(node_of(lambda x: x.mean(1, keepdim=True), rnd(4, 8)))
    assert st_((S(1),), PS, "mean_as_sum") in s
    assert st_((S(0),), S(0)) in s
    assert st_((PS,), PS) in s


def test_amax_reduction_gives_max_partial():
    s = strategies(node_of(lambda x: x.amax(-1), rnd(4, 8)))
    assert st_((S(1),), PMAX) in s
    assert st_((PMAX,), PMAX) in s
    assert st_((S(0),), S(0)) in s
    assert PS not in {o for _, o, _ in s}  # max of partial sums is not the max of the sum
    assert (PS,) not in {i for i, _, _ in s}


def test_reductions_without_partial_form():
    s = strategies(node_of(lambda x: x.var(1), rnd(4, 8)))
    assert st_((S(0),), S(0)) in s
    assert not any(i == (S(1),) for i, _, _ in s)
    assert not any(isinstance(o, Part) for _, o, _ in s)
    s = strategies(node_of(lambda x: x.cumsum(1), rnd(4, 8)))
    assert st_((S(0),), S(0)) in s
    assert not any(i == (S(1),) for i, _, _ in s)  # the scanned dim stays whole


def test_ops_along_dims_keep_the_other_dims_splittable():
    """Sorts, scans, flips, FFTs and reductions with indices need only the dims they work along whole."""
    x = rnd(4, 6, 8)
    s = strategies(node_of(lambda x: torch.sort(x, -1), x, op=aten.sort.default))
    assert st_((S(0),), (S(0), S(0))) in s and st_((S(1),), (S(1), S(1))) in s
    assert not any(i == (S(2),) for i, _, _ in s)
    s = strategies(node_of(lambda x: torch.topk(x, 3, dim=1), x, op=aten.topk.default))
    assert st_((S(2),), (S(2), S(2))) in s and not any(i == (S(1),) for i, _, _ in s)
    s = strategies(node_of(lambda x: x.flip(0), x))
    assert st_((S(2),), S(2)) in s and st_((PMAX,), PMAX) in s and not any(i == (S(0),) for i, _, _ in s)
    s = strategies(node_of(lambda x: x.max(1), x, op=aten.max.dim))
    assert st_((S(2),), (S(1), S(1))) in s  # keepdim=False renumbers the output dims
    s = strategies(node_of(lambda x: torch.var_mean(x, 2), x, op=aten.var_mean.correction))
    assert st_((S(1),), (S(1), S(1))) in s and not any(i == (S(2),) for i, _, _ in s)
    s = strategies(node_of(lambda x: torch.fft.rfft(x, dim=1), x, op=aten._fft_r2c.default))
    assert st_((S(0),), S(0)) in s and st_((PS,), PS) in s and not any(i == (S(1),) for i, _, _ in s)


def test_vector_norm_over_a_split_dim_is_partial_for_reducible_orders():
    x = rnd(4, 8)
    norm = aten.linalg_vector_norm.default
    assert st_((S(1),), PMAX) in strategies(node_of(lambda x: torch.linalg.vector_norm(x, float("inf"), 1), x, op=norm))
    assert st_((S(1),), PS) in strategies(node_of(lambda x: torch.linalg.vector_norm(x, 1, 1), x, op=norm))
    s = strategies(node_of(lambda x: torch.linalg.vector_norm(x, 2, 1), x, op=norm))
    assert st_((S(0),), S(0)) in s and not any(i == (S(1),) for i, _, _ in s)  # sqrt of a sum of squares


def test_index_tensor_splits_unindexed_dims_and_the_index():
    x, idx = rnd(4, 6, 8), torch.tensor([[0, 2], [1, 3], [0, 0]])  # idx [3, 2]
    s = strategies(node_of(lambda x, i: x[:, i], x, idx, op=aten.index.Tensor))  # -> [4, 3, 2, 8]
    assert st_((S(0), R), S(0)) in s and st_((S(2), R), S(3)) in s
    assert st_((R, S(0)), S(1)) in s and st_((R, S(1)), S(2)) in s  # the index's dims land in its place
    assert not any(i[0] == S(1) for i, _, _ in s)  # the indexed dim stays whole
    assert st_((PMAX, R), PMAX) in s  # picking elements keeps any partial
    s = strategies(node_of(lambda x, i: x[i, :, i], x, torch.tensor([0, 3]), op=aten.index.Tensor))  # -> [2, 6]
    assert st_((S(1), R, R), S(1)) in s and st_((R, S(0), S(0)), S(0)) in s


def test_scatter_writes_keep_the_other_dims_splittable():
    x = rnd(4, 6)
    s = strategies(node_of(lambda x, y: torch.slice_scatter(x, y, 1, 0, 3), x, rnd(4, 3)))
    assert st_((S(0), S(0)), S(0)) in s and not any(i[0] == S(1) for i, _, _ in s)
    assert st_((PS, PS), PS) in s
    s = strategies(node_of(lambda x, y: torch.select_scatter(x, y, 0, 1), x, rnd(6)))
    assert st_((S(1), S(0)), S(1)) in s


# ----------------------------------------------------------------------------- views


def test_view_split_heads_and_merge():
    # [B, T, D] -> [B, T, H, hd]: D split by rank -> H split
    s = strategies(node_of(lambda x: x.view(2, 3, 4, 2), rnd(2, 3, 8)), [S(2)])
    assert st_((S(2),), S(2)) in s
    # [B, T, H, hd] -> [B, T, D]
    s = strategies(node_of(lambda x: x.reshape(2, 3, 8), rnd(2, 3, 4, 2)), [S(2)])
    assert st_((S(2),), S(2)) in s
    # a split of head_dim interleaves in the merged dim: rank r holds element r of every head
    assert st_((S(3),), S(2, 4)) in s


def test_view_merge_with_split_inner_dim_is_strided():
    # [B, H, T] -> [B*H, T] with H split: rank r holds rows {b*H + r*H/n ...}: S(0, outer=B)
    s = strategies(node_of(lambda x: x.reshape(8, 5), rnd(2, 4, 5)), [S(1)])
    assert st_((S(1),), S(0, 2)) in s
    # and back: [B*H, T] with S(0, outer=B) -> [B, H, T] with H split
    s = strategies(node_of(lambda x: x.reshape(2, 4, 5), rnd(8, 5)), [S(0, 2)])
    assert st_((S(0, 2),), S(1)) in s
    # splitting the outer dim of the merge stays contiguous
    s = strategies(node_of(lambda x: x.reshape(8, 5), rnd(2, 4, 5)), [S(0)])
    assert st_((S(0),), S(0)) in s
    assert view_shard((2, 4, 5), (8, 5), S(1), 2) == S(0, 2)


def test_view_groups_cover_both_shapes():
    assert view_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((8, 5), (2, 4, 5)) == [([0], [0, 1]), ([1], [2])]
    assert view_groups((2, 1, 3), (2, 3)) == [([0], [0]), ([1, 2], [1])]


def test_expand():
    s = strategies(node_of(lambda x: x.expand(3, 8), rnd(8)))
    assert st_((S(0),), S(1)) in s
    assert st_((PS,), PS) in s
    s = strategies(node_of(lambda x: x.expand(4, 8), rnd(4, 1)))
    assert st_((S(0),), S(0)) in s
    assert not any(i == (S(1),) for i, _, _ in s)


def test_permute_and_transpose():
    s = strategies(node_of(lambda x: x.permute(2, 0, 1), rnd(2, 4, 6)))
    assert st_((S(0),), S(1)) in s and st_((S(1),), S(2)) in s and st_((S(2),), S(0)) in s
    s = strategies(node_of(lambda x: x.transpose(1, 2), rnd(2, 4, 6)))
    assert st_((S(1),), S(2)) in s and st_((S(2),), S(1)) in s and st_((S(0),), S(0)) in s
    s = strategies(node_of(lambda x: x.transpose(1, 2), rnd(8, 4, 6)), [S(0, 2)])
    assert st_((S(0, 2),), S(0, 2)) in s  # the stride survives a permutation
    s = strategies(node_of(lambda x: aten.t.default(x), rnd(4, 6)))
    assert st_((S(0),), S(1)) in s


def test_unsqueeze_and_squeeze():
    s = strategies(node_of(lambda x: x.unsqueeze(0), rnd(4, 6)))
    assert st_((S(0),), S(1)) in s and st_((S(1),), S(2)) in s
    s = strategies(node_of(lambda x: x.unsqueeze(-1), rnd(4, 6)))
    assert st_((S(1),), S(1)) in s
    s = strategies(node_of(lambda x: x.squeeze(1), rnd(4, 1, 6)))
    assert st_((S(0),), S(0)) in s and st_((S(2),), S(1)) in s


def test_slice_and_select():
    s = strategies(node_of(lambda x: aten.slice.Tensor(x, 1, 2, 4), rnd(4, 8)))
    assert st_((S(0),), S(0)) in s
    assert not any(i == (S(1),) for i, _, _ in s)  # a partial range of a split dim
    s = strategies(node_of(lambda x: aten.slice.Tensor(x, 1, 0, 8), rnd(4, 8)))
    assert st_((S(1),), S(1)) in s  # the full range is a no-op
    s = strategies(node_of(lambda x: aten.slice.Tensor(x, 0, 0, 4, 2), rnd(4, 8)))
    assert not any(i == (S(0),) for i, _, _ in s)  # a step is not a local op
    s = strategies(node_of(lambda x: x[:, 3], rnd(4, 8, 6)))
    assert st_((S(0),), S(0)) in s and st_((S(2),), S(1)) in s
    assert not any(i == (S(1),) for i, _, _ in s)


def test_split():
    node = node_of(lambda x: torch.split(x, 2, dim=1), rnd(4, 8))
    s = strategies(node)
    assert st_((S(0),), (S(0),) * 4) in s
    assert st_((PS,), (PS,) * 4) in s
    assert not any(i == (S(1),) for i, _, _ in s)


def test_cat():
    s = strategies(node_of(lambda x, y: torch.cat([x, y], 0), rnd(4, 8), rnd(2, 8)))
    assert st_((S(1), S(1)), S(1)) in s
    assert st_((PS, PS), PS) in s
    assert not any(o == S(0) for _, o, _ in s)  # the cat dim
    assert (PS, R) not in {i for i, _, _ in s}
    s = strategies(node_of(lambda x, y: torch.cat([x, y], -1), rnd(4, 8), rnd(4, 2)))
    assert st_((S(0), S(0)), S(0)) in s and not any(o == S(1) for _, o, _ in s)


# ----------------------------------------------------------------------------- norm, embedding, gather


def test_layer_norm_splits_only_unnormalized_dims():
    node = node_of(lambda x, w, b: F.layer_norm(x, [8], w, b), rnd(4, 6, 8), rnd(8), rnd(8))
    s = strategies(node)
    assert st_((S(0), R, R), (S(0),) * 3) in s
    assert st_((S(1), R, R), (S(1),) * 3) in s
    assert not any(i[0] == S(2) for i, _, _ in s)
    assert not any(isinstance(p, Part) for i, _, _ in s for p in i)
    node = node_of(lambda x, w, b: F.layer_norm(x, [6, 8], w, b), rnd(4, 6, 8), rnd(6, 8), rnd(6, 8))
    assert not any(i[0] == S(1) for i, _, _ in strategies(node))


def test_embedding_colwise_vocab_and_index_splits():
    node = node_of(lambda w, i: F.embedding(i, w), rnd(16, 8), torch.randint(0, 16, (2, 4)))
    s = strategies(node)
    assert st_((S(1), R), S(2)) in s  # colwise: embedding dim
    assert st_((S(0), R), PS, "masked_embedding") in s  # vocab split: masked local lookup, partial sum
    assert not any(i == (S(0), R) and lw is None for i, _, lw in s)
    assert st_((R, S(0)), S(0)) in s and st_((R, S(1)), S(1)) in s  # batch / sequence of the indices


def test_gather():
    node = node_of(lambda x, i: torch.gather(x, 1, i), rnd(4, 8), torch.randint(0, 8, (4, 3)))
    s = strategies(node)
    assert st_((S(1), R), PS, "masked_gather") in s
    assert st_((S(0), S(0)), S(0)) in s
    # a non-gather dim where index is shorter than x: chunks would not line up
    node = node_of(lambda x, i: torch.gather(x, 1, i), rnd(4, 8), torch.randint(0, 8, (2, 3)))
    assert not any(i == (S(0), S(0)) for i, _, _ in strategies(node))


def test_index_put():
    idx = torch.tensor([0, 2, 3])

    def put(x, i, v):
        return aten.index_put.default(x, [i], v, False)

    def acc(x, i, v):
        return aten.index_put.default(x, [i], v, True)

    s = strategies(node_of(acc, rnd(4, 8), idx, rnd(3, 8)))
    assert st_((S(1), R, S(1)), S(1)) in s  # a non-indexed dim
    assert st_((S(0), R, R), S(0), "masked_index_put") in s  # the indexed dim: each rank writes its rows
    assert st_((PS, R, PS), PS) in s  # accumulation is linear in (self, values)
    s = strategies(node_of(put, rnd(4, 8), idx, rnd(3, 8)))
    assert not any(isinstance(o, Part) or lw for _, o, lw in s)  # overwriting is not linear
    # values that broadcast: scalar, or one row for every index
    s = strategies(node_of(put, rnd(4, 8), idx, torch.tensor(0.0)))
    assert st_((S(1), R, R), S(1)) in s
    assert all(p.dim >= 0 for i, _, _ in s for p in i if isinstance(p, S))
    s = strategies(node_of(acc, rnd(4, 8), idx, rnd(8)))
    assert st_((S(1), R, S(0)), S(1)) in s
    assert not any(lw == "masked_index_put" for _, _, lw in s)  # no row of values per index to mask


def test_scatter_add():
    node = node_of(lambda x, i, v: x.scatter_add(1, i, v), rnd(4, 8), torch.randint(0, 8, (4, 3)), rnd(4, 3))
    s = strategies(node)
    assert st_((S(1), R, R), S(1), "masked_scatter_add") in s
    assert st_((S(0), S(0), S(0)), S(0)) in s
    assert st_((PS, R, PS), PS) in s


# ----------------------------------------------------------------------------- factories, conv, attention


def test_factories():
    s = strategies(node_of(lambda x: torch.full([4, 8], 3.0), rnd(1)))
    assert s == {st_((), R)}
    s = strategies(node_of(lambda x: torch.arange(8), rnd(1)))
    assert s == {st_((), R)}
    s = strategies(node_of(lambda x: torch.full_like(x, 3.0), rnd(4, 8)))
    assert st_((S(0),), S(0)) in s and st_((S(1),), S(1)) in s
    assert st_((PS,), R) in s  # only the shape is read: a partial input is fine, the output is whole
    assert not any(isinstance(o, Part) for _, o, _ in s)


def test_convolution():
    node = node_of(lambda x, w, b: F.conv2d(x, w, b), rnd(4, 6, 5, 5), rnd(8, 6, 3, 3), rnd(8))
    s = strategies(node)
    assert st_((S(0), R, R), S(0)) in s  # batch
    assert st_((R, S(0), S(0)), S(1)) in s  # output channels
    assert st_((S(1), S(1), PS), PS) in s  # input channels: partial sums, bias counted once
    assert not any(i == (S(1), S(1), R) for i, _, _ in s)
    node = node_of(lambda x, w: F.conv2d(x, w, groups=2), rnd(4, 6, 5, 5), rnd(8, 3, 3, 3))
    s = strategies(node)
    assert st_((S(0), R), S(0)) in s
    assert not any(o in (S(1), PS) for _, o, _ in s)  # channel splits need groups == 1


def test_sdpa_flash_for_cpu():
    q = rnd(2, 4, 8, 16)
    node = node_of(lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True),
                   q, q, q, op=aten._scaled_dot_product_flash_attention_for_cpu.default)
    s = strategies(node)
    assert st_((S(0),) * 3, (S(0), S(0))) in s  # batch
    assert st_((S(1),) * 3, (S(1), S(1))) in s  # heads
    assert not any(o[0] in (S(2), S(3)) for _, o, _ in s if o[0] != R)  # sequence/head_dim: not local
    assert not any(isinstance(p, Part) for i, _, _ in s for p in i)
    # a mask broadcasting over heads stays whole when heads are split
    node = node_of(lambda q, k, v, m: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=m),
                   q, q, q, rnd(2, 1, 8, 8), op=aten._scaled_dot_product_flash_attention_for_cpu.default)
    s = strategies(node)
    assert st_((S(1),) * 3 + (R,), (S(1), S(1))) in s
    assert st_((S(0),) * 4, (S(0), S(0))) in s


# ----------------------------------------------------------------------------- view algebra vs real tensors


def chunk(t: torch.Tensor, p: S, n: int, r: int) -> torch.Tensor:
    """Rank ``r``'s local piece of ``t`` under ``p``: view dim ``p.dim`` as ``[outer, size/outer]``, take
    the ``r``-th of ``n`` chunks of the second factor."""
    d, o = p.dim, p.outer
    sh = list(t.shape)
    v = t.reshape(sh[:d] + [o, sh[d] // o] + sh[d + 1:])
    c = v.chunk(n, dim=d + 1)[r]
    return c.reshape(sh[:d] + [sh[d] // n] + sh[d + 1:])


@st.composite
def reshape_cases(draw):
    """(input shape, output shape of the same numel, split of the input, n)."""
    factors = draw(st.lists(st.sampled_from([2, 2, 2, 3, 4, 5, 6]), min_size=1, max_size=5))

    def shape_of(fs):
        ndim = draw(st.integers(1, 4))
        dims = [1] * ndim
        for f in fs:
            dims[draw(st.integers(0, ndim - 1))] *= f
        if draw(st.booleans()):
            dims.insert(draw(st.integers(0, len(dims))), 1)
        return dims

    a = shape_of(factors)
    b = shape_of(draw(st.permutations(factors)))
    n = draw(st.sampled_from([2, 3, 4]))
    splittable = [(d, o) for d in range(len(a)) for o in range(1, a[d] + 1) if a[d] % (o * n) == 0]
    if not splittable:
        return a, b, None, n
    d, o = draw(st.sampled_from(splittable))
    return a, b, S(d, o), n


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshape_cases())
def test_view_shard_local_view_is_the_output_chunk(case):
    a, b, p, n = case
    groups = view_groups(a, b)
    assert sorted(i for g in groups for i in g[0]) == list(range(len(a)))
    assert sorted(j for g in groups for j in g[1]) == list(range(len(b)))
    if p is None:
        return
    q = view_shard(a, b, p, n)
    if q is None:
        return
    assert 0 <= q.dim < len(b) and b[q.dim] % (q.outer * n) == 0, (a, b, p, n, q)
    g = torch.arange(math.prod(a)).reshape(a)
    out = g.reshape(b)
    local_out_shape = list(b)
    local_out_shape[q.dim] //= n
    for r in range(n):
        local_in = chunk(g, p, n, r)
        assert torch.equal(local_in.reshape(local_out_shape), chunk(out, q, n, r)), (a, b, p, n, q, r)


def test_view_shard_known_cases():
    assert view_shard((2, 3, 8), (2, 3, 4, 2), S(2), 2) == S(2)
    assert view_shard((2, 3, 8), (2, 3, 4, 2), S(2), 8) is None  # one element per rank straddles [4, 2]
    assert view_shard((8,), (2, 4), S(0), 2) == S(0)  # each rank's chunk is one row
    assert view_shard((2, 4, 5), (40,), S(1), 2) == S(0, 2)
    assert view_shard((2, 4, 5), (40,), S(2), 5) == S(0, 8)  # one element of every row of 5
    assert view_shard((4, 6), (6, 4), S(1), 2) is None  # rank chunks of rows straddle output rows
