"""Random ops: dropout and the ``*_like`` samplers, sharded without drawing the same numbers twice.

What the graphs contain. ``nn.Dropout``/``F.dropout`` in training mode trace to
``native_dropout(x, p, True) -> (out, mask)`` in both the exported forward and
the joint graph (core ATen keeps it; the backward multiplies by the saved
``mask``, never redraws it). ``torch.rand_like``/``randn_like``/``randint_like``
and the ``empty_like(x).bernoulli_(p)/.uniform_()/.normal_()/.exponential_()``
idioms trace to ``rand_like``, ``randn_like``, ``randint_like``,
``bernoulli.p``, ``uniform``, ``normal_functional``, ``exponential``; all of
them read only their input's *shape* (dropout also its values, elementwise).
``torch.rand(size)``/``randn(size)``/``torch.bernoulli(probs)`` (which becomes
``rand`` + ``lt``) have explicit global sizes and are replicated factories (see
``factory.py``): every rank draws the whole tensor and consumers slice it.

Semantics (the contract users rely on):

* **Seed every rank the same** (``torch.manual_seed(s)`` on all ranks, as
  torchrun scripts usually do). fxshard never reseeds or forks the generator.
* **Global draw, local slice.** When the output of a random op is split, every
  rank draws the random tensor of the op's *global* shape from the default
  generator and keeps its own chunk (lowering ``global_rng``, applied in
  ``passes/localize.py``). So shards get different numbers exactly where the
  unsharded model draws different numbers, replicated outputs get the same
  numbers on every rank, and every rank advances its generator exactly as the
  unsharded program would: the generators stay in lock-step, so later
  replicated random ops still agree across ranks.
* **Parity.** With the same seed, a sharded model draws bit-identical dropout
  masks to the unsharded eager model on CPU (``bernoulli_(1 - p)`` over a
  contiguous tensor of the activation's global shape and dtype, which is what
  eager dropout draws), so forward values and gradients match the unsharded
  model up to float rounding. Runs with the same seed are deterministic. Under
  ``torch.compile`` the numbers come from inductor's RNG instead (still
  deterministic per seed and identical across ranks), unless
  inductor's ``fallback_random`` config is set, which gives eager's; on
  CUDA the fused dropout kernel's stream is not promised to match.
* **Backward.** The mask is computed once in the forward and saved as this
  rank's boolean chunk; the backward reuses it (the joint graph's partition
  keeps it a saved value, it is never recomputed).
* **Cost (the trade-off).** Each rank generates the random numbers of the
  whole global activation: transient memory of one global-shaped tensor of
  the activation's dtype per random op (freed as soon as the rank's boolean
  chunk is cut out) and ``n``-fold RNG compute. That is the unsharded model's
  own mask size, fine for tensor parallelism of activations; with a large data
  parallel axis splitting the batch it grows with the global batch. The
  cheaper alternative, not implemented, is a counter-based draw
  (hash of seed and *global* element index, the seed drawn once per op from
  the shared generator) that generates only the local chunk, stays
  deterministic and layout-independent, but gives up bit parity with eager.
* **Partial inputs.** Dropout is linear in its input for a fixed mask, so a
  ``P(sum)`` input stays ``P(sum)`` (each rank draws the same global mask,
  no collective); the ``*_like`` samplers ignore values, so a Partial input
  gives a replicated draw.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..comm.collectives import Emitter, redistribute_nodes
from ..core.context import ShardContext, runtime_device
from ..core.ir import INSERTED_KEY, META_KEY, STRATEGY_KEY
from ..comm.lowering import Lowering
from ..core.placements import Part, R, S
from .registry import OpCall, Strategy, outer_of, register, tensor_inputs
from ..core.spec import Spec, local_shape, shard_factor
from ..core.symbolic import is_concrete

aten = torch.ops.aten

__all__ = ["GLOBAL_RNG", "SHAPE_ONLY", "DROPOUT"]


def _global_draw(g: fx.Graph, node: fx.Node, ctx: ShardContext, axes: list[int]) -> None:
    """Replace a random op whose output is split by a draw of its GLOBAL shape cut to this rank's chunk.

    Every rank draws the same numbers and advances the generator as the unsharded program does
    (module doc). ``native_dropout`` becomes ``x * mask * scale`` with the mask drawn as eager dropout
    draws it (``bernoulli_(1 - p)`` in ``x``'s dtype) and kept as a local bool.
    """
    x = tensor_inputs(node)[0]
    spec: Spec = x.meta[META_KEY]
    dropout = node.target is aten.native_dropout.default
    out_specs = node.meta[META_KEY] if dropout else (node.meta[META_KEY],)
    e = Emitter(g, node, {})
    lshape = local_shape(spec.shape, spec.placements, ctx.mesh.sizes, ctx.mesh.coords)
    gshape = []
    for d, (s, ls) in enumerate(zip(spec.shape, lshape)):
        f = shard_factor(spec.placements, ctx.mesh.sizes, d)
        gshape.append(int(s) if is_concrete(s) else e.arith(operator.mul, e.size(x, d, ls), f) if f > 1
                      else e.size(x, d, ls))
    blank = e.op(aten.empty.memory_format, gshape, dtype=spec.dtype, device=runtime_device(ctx))
    if dropout:
        p = float(node.args[1])
        draw = e.op(aten.bernoulli.p, blank, 1.0 - p)
    else:
        draw = e.op(node.target, blank, *node.args[1:], **node.kwargs)
    dst = [R if isinstance(pl, Part) else pl for pl in out_specs[-1].placements]
    glob = Spec((R,) * len(dst), spec.shape, spec.dtype if dropout else out_specs[0].dtype)
    chunk = redistribute_nodes(e, draw, glob, dst, ctx.mesh)
    if dropout:  # a copy, so the global draw dies here and the backward saves only the local bool mask
        mask = e.op(aten._to_copy.default, chunk, dtype=torch.bool)
        out = e.op(aten.mul.Tensor, e.op(aten.mul.Tensor, x, mask), 1.0 / (1.0 - p) if p < 1 else 0.0)
        results = [out, mask]
    else:
        results = [e.contiguous(chunk)]
    for i, r in enumerate(results):  # the results stand for the op in explain(): not "inserted"
        r.meta.pop(INSERTED_KEY, None)
        r.meta.update({k: node.meta[k] for k in ("stack_trace", STRATEGY_KEY) if k in node.meta})
        r.meta["val"] = node.meta["val"][i] if dropout else node.meta["val"]
        r.meta[META_KEY] = out_specs[i]
    if dropout:
        for user in list(node.users):  # getitem(native_dropout, i)
            user.replace_all_uses_with(results[user.args[1]])
            g.erase_node(user)
    else:
        node.replace_all_uses_with(results[0])
    g.erase_node(node)


GLOBAL_RNG = Lowering("global_rng", _global_draw)

DROPOUT = [aten.native_dropout.default]
SHAPE_ONLY = [  # random ops whose only tensor input gives the shape (and default dtype) of the draw
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.bernoulli.p, aten.uniform.default, aten.normal_functional.default, aten.exponential.default,
    aten.cauchy.default, aten.log_normal.default, aten.geometric.default,
]


def _splits(call: OpCall, lowering) -> list[tuple]:
    """``(input placement, output placement, lowering)`` for every split the output can follow."""
    cur = call.in_pls[0]
    res = []
    for d in range(len(call.in_shapes[0])):
        o = outer_of(cur, d)
        res.append((S(d, o), S(d, o), lowering))
    return res


def _rest(call: OpCall) -> tuple:
    return (R,) * (len(call.in_shapes) - 1)


@register(DROPOUT)
def dropout_rule(call: OpCall, n: int) -> list[Strategy]:
    """``(out, mask)``: follows the input's split (global mask, local chunk) or keeps ``P(sum)``."""
    train = call.arg(2, "train", None)
    lowering = None if train is False else GLOBAL_RNG  # native_dropout(x, p, train=False) draws nothing
    res = [Strategy((R,) + _rest(call), (R, R)), Strategy((Part("sum"),) + _rest(call), (Part("sum"), R))]
    for i, o, low in _splits(call, lowering):
        res.append(Strategy((i,) + _rest(call), (o, o), low))
    return res


@register(SHAPE_ONLY)
def shape_only_rule(call: OpCall, n: int) -> list[Strategy]:
    """The draw follows the input's split (global draw, local chunk); a Partial input only lends its shape."""
    res = [Strategy((R,) + _rest(call), R)]
    res += [Strategy((Part(op),) + _rest(call), R) for op in ("sum", "max", "min")]
    for i, o, low in _splits(call, GLOBAL_RNG):
        res.append(Strategy((i,) + _rest(call), o, low))
    return res
