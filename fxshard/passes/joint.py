"""Joint tracing and partitioning: one graph for forward + backward, split after sharding.

``trace_joint`` requires the *global* traced forward (before any pass ran) and
ensures a core-ATen graph ``(primals..., tangents...) -> (outputs..., grads...)``
obtained by tracing the forward program together with ``torch.autograd.grad``
under fake tensors (``make_fx``): backward ops are ordinary ATen ops, so the
same rules shard them and the backward collectives fall out of propagation.
Fused kernels that have rules (``trace.FUSED_FORWARD``/``FUSED_BACKWARD``:
attention, layer-norm and activation backwards, embedding backward) stay one
node each (``trace.joint_decomposition_table``).

``partition`` requires a sharded joint graph and ensures two GraphModules:
forward ``primals -> (outputs..., saved...)`` holding exactly the nodes the
outputs need, and backward ``(saved..., tangents...) -> grads`` holding the
rest (so anything only the backward needs, collectives included, runs in the
backward, and saved values are the forward nodes the backward reads).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import ShardingError
from ..collectives import INSERTED_KEY
from ..memory import VIEW_OPS
from ..registry import output_leaves
from .trace import Traced, _cse, joint_decomposition_table

__all__ = ["Joint", "trace_joint", "partition", "Split"]


@dataclass
class Joint:
    """The joint graph and how its inputs/outputs line up with the forward's."""

    gm: fx.GraphModule
    n_primals: int
    diff_out: list[int]  # forward output positions that get a tangent
    diff_in: list[int]  # primal positions that get a gradient
    n_out: int


def _example(val: Any, mode: FakeTensorMode) -> Any:
    """A fake tensor like ``val`` (global shape, same device): nothing is allocated."""
    if isinstance(val, torch.Tensor):
        with mode:
            return torch.empty_strided(tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride()),
                                       dtype=val.dtype, device=val.device)
    return val


def trace_joint(traced: Traced, fwd_gm: fx.GraphModule, wants_grad: list[bool]) -> Joint:
    """See module doc; ``wants_grad[i]`` says whether primal ``i`` gets a gradient."""
    placeholders = [n for n in fwd_gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    dynamic = any(isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape) for v in vals)
    out_node = next(n for n in fwd_gm.graph.nodes if n.op == "output")
    out_leaves = output_leaves(out_node)
    diff_out = [i for i, o in enumerate(out_leaves) if i >= len(traced.mutations) and isinstance(o, fx.Node)
                and isinstance(o.meta.get("val"), torch.Tensor) and o.meta["val"].is_floating_point()]
    diff_in = [i for i, w in enumerate(wants_grad) if w]
    if dynamic:  # trace on export's own fake tensors: their dynamic dims stay symbols of its ShapeEnv
        mode = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor))
        primals = list(vals)
        with mode:
            tangents = [torch.empty_like(out_leaves[i].meta["val"]) for i in diff_out]
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        primals = [_example(v, mode) for v in vals]
        tangents = [_example(out_leaves[i].meta["val"], mode) for i in diff_out]
    n_out = len(out_leaves)

    def joint(primals: list, tangents: list):
        prim = [p.detach().requires_grad_(i in diff_in) if isinstance(p, torch.Tensor) and p.is_floating_point()
                else p for i, p in enumerate(primals)]
        with fx_traceback.preserve_node_meta():  # joint nodes keep the forward's source lines
            outs = fx.Interpreter(fwd_gm).run(*prim)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        pairs = [(outs[i], t) for i, t in zip(diff_out, tangents) if outs[i].requires_grad]
        inputs = [prim[i] for i in diff_in]
        if pairs and inputs:
            grads = torch.autograd.grad([o for o, _ in pairs], inputs, [t for _, t in pairs], allow_unused=True)
        else:
            grads = [None] * len(inputs)
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], list(grads)

    table = joint_decomposition_table()  # core ATen, fused kernels that have rules kept
    with torch.enable_grad():
        gm = make_fx(joint, tracing_mode="symbolic" if dynamic else "fake", decomposition_table=table)(primals, tangents)
    for ph, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], [n.name for n in placeholders]):
        ph.name = name  # name primals after the forward's placeholders (p_net1_weight, ...)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.alias.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm = _cse(gm)
    return Joint(gm, len(primals), diff_out, diff_in, n_out)


@dataclass
class Split:
    fwd: fx.GraphModule
    bwd: fx.GraphModule
    n_saved: int


def partition(joint: Joint, gm: fx.GraphModule) -> Split:
    """See module doc. ``gm`` is the sharded joint graph (same placeholders/outputs as ``joint.gm``)."""
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    primals, tangents = placeholders[: joint.n_primals], placeholders[joint.n_primals:]
    out_node = next(n for n in g.nodes if n.op == "output")
    leaves = output_leaves(out_node)
    fwd_outs, grads = leaves[: joint.n_out], leaves[joint.n_out:]

    needed: set[fx.Node] = set()
    stack = [o for o in fwd_outs if isinstance(o, fx.Node)]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    if any(t in needed for t in tangents):
        raise ShardingError("internal: a forward output depends on a tangent; please report this model")
    needed.update(primals)
    for n in g.nodes:  # unpack forward tuples in the forward: save the parts, not the tuple
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in needed:
            needed.add(n)
    # views of parameters are recomputed in the backward rather than saved
    cheap: set[fx.Node] = set()
    for n in g.nodes:
        if (n in needed and n.op == "call_function" and n.target in VIEW_OPS and not n.meta.get(INSERTED_KEY)
                and all(a in cheap or a in primals for a in n.all_input_nodes)):
            cheap.add(n)

    saved: list[fx.Node] = []
    recompute: set[fx.Node] = set()

    def need_in_bwd(a: fx.Node) -> None:
        if a in cheap:
            if a not in recompute:
                recompute.add(a)
                for b in a.all_input_nodes:
                    need_in_bwd(b)
        elif a in needed and a not in saved:
            saved.append(a)

    for n in g.nodes:
        if n in needed or n.op in ("placeholder", "output"):
            continue
        for a in n.all_input_nodes:
            need_in_bwd(a)
    for gr in grads:
        if isinstance(gr, fx.Node) and gr in needed:
            need_in_bwd(gr)

    fwd = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:
        if n in needed:
            env[n] = fwd.node_copy(n, lambda a: env[a])
    fwd.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in fwd_outs) + tuple(env[s] for s in saved))

    bwd = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for s in saved:
        p = bwd.placeholder(f"saved_{s.name}")
        p.meta.update(s.meta)
        benv[s] = p
    for t in tangents:
        benv[t] = bwd.node_copy(t, lambda a: benv[a])
    for n in g.nodes:
        if (n in needed and n not in recompute) or n.op in ("placeholder", "output"):
            continue
        benv[n] = bwd.node_copy(n, lambda a: benv[a])
    bwd.output(tuple(benv[x] if isinstance(x, fx.Node) else x for x in grads))
    fgm = fx.GraphModule(gm, fwd)
    bgm = fx.GraphModule(gm, bwd)
    for m in (fgm, bgm):
        m.graph.eliminate_dead_code()
        m.recompile()
    return Split(fgm, bgm, len(saved))
