"""Joint tracing and partitioning: one graph for forward + backward, split after sharding.

``trace_joint`` requires the *global* traced forward (before any pass ran) and
ensures a core-ATen graph ``(primals..., tangents...) -> (outputs..., grads...)``
obtained by tracing the forward program together with ``torch.autograd.grad``
under fake tensors (``make_fx``): backward ops are ordinary ATen ops, so the
same rules shard them and the backward collectives fall out of propagation.
Attention's backward is one ``fxshard::attention_backward`` node (the autograd of
``fxshard::attention``, ``fxshard/ops/attention.py``; a learned mask's gradient included).
Fused kernels that have rules (``decompositions.FUSED_FORWARD``/``FUSED_BACKWARD``:
layer-norm and activation backwards, embedding backward) stay one
node each (``decompositions.joint_decomposition_table``) unless a gradient is wanted for
an input their backward does not differentiate (``decompositions.FUSED_GRAD_ARGS``).
The trace runs on functional tensors under autograd, as AOTAutograd does, so
the graph is pure (no in-place op left for CSE or the passes to misread); the
forward's stop-gradients (``trace.STOP_KEY``) detach; data-dependent sizes get
unbacked symbols; placeholders keep the forward's names (clashing nodes are
renamed). A failure is one ShardingError naming the op and the user's line
(the forward node being run, or the one whose backward autograd reached last);
a gradient through a collective the model itself calls is such an error (``CollectiveGradient``, which
``shard`` defers to the backward: only the training program is impossible). Where the graph allows it
the trace goes one distinct op at a time (``fxshard/tracing/by_op.py``: the same graph, a fraction of
the time on repeated layers). ``rrelu``'s backward is pointed at the noise its forward drew (the
functionalized trace gives it the buffer before the write).

``partition`` requires a sharded joint graph and ensures two GraphModules:
forward ``primals -> (outputs..., saved...)`` holding exactly the nodes the
outputs need, and backward ``(saved..., tangents...) -> grads`` holding the
rest (so anything only the backward needs, collectives included, runs in the
backward, and saved values are the forward nodes the backward reads). Under a
rematerialisation policy (``fxshard.tracing.remat``) the backward recomputes some forward
values from saved ones instead, each right before its first reader there.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from ..core.torch_compat import pytree

from ..core.context import ShardContext
from ..core.errors import ShardingError
from .fake import fake_inputs, fake_like, functional_make_fx, named_placeholders, reject_effect_tokens
from ..core.ir import INSERTED_KEY, STOP_KEY, VIEW_OPS, source_line
from ..core.placements import Part, Pl, R
from ..rules.registry import output_leaves
from .by_op import by_op_enabled, joint_by_op
from .remat import Policy, check_policy, fit_budget, layer_sets, recomputed, value_bytes
from .cse import cse
from .decompositions import FUSED_GRAD_ARGS, joint_decomposition_table
from .export import Traced
from .failures import quiet_unless_ok, tracing_errors
from ..core.torch_compat import OpOverload, decomposition_table, free_unbacked_symbols, from_fun, to_fun
from ..core.torch_compat import make_graph_module as _make_graph_module

__all__ = ["CollectiveGradient", "Joint", "trace_joint", "joint_context", "partition", "Split"]


class CollectiveGradient(ShardingError):
    """A gradient reaches a torch.distributed collective the model calls itself (eager autograd has no derivative
    for c10d collectives either). Only the training program is impossible: ``shard`` records it and the module
    raises it at the backward of a call that needs that gradient; the forward runs (``module.Untrainable``)."""


@dataclass
class Joint:
    """The joint graph and how its inputs/outputs line up with the forward's."""

    gm: fx.GraphModule
    n_primals: int
    diff_out: list[int]  # forward output positions that get a tangent
    diff_in: list[int]  # primal positions that get a gradient
    n_out: int
    # the positions of diff_out whose value autograd marks as needing a gradient (not .detach()-ed, ...)
    grad_out: list[int] = field(default_factory=list)
    # per diff_in: the grad_out positions whose gradient reaches it (None: every one, a single grad_out)
    reaches: Optional[list[frozenset[int]]] = None


def _tie_sizes(out: torch.Tensor, tangent: torch.Tensor) -> None:
    """Assert that the data-dependent sizes of ``tangent`` (``fake_like``) are ``out``'s, so autograd's
    shape check and every later size comparison see one value."""
    for a, b in zip(tangent.shape, out.shape):
        if free_unbacked_symbols(a):
            torch._check(a == b)


_COLLECTIVES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")


class _Differentiable(fx.Interpreter):
    """Runs the traced forward so that autograd sees what eager autograd would see: stop-gradients
    (``meta[STOP_KEY]``) detach, and a fused kernel whose backward does not cover every input that
    needs a gradient (``FUSED_GRAD_ARGS``) runs as its decomposition (eager takes its math path).

    ``at`` is the forward node being run, or the one whose backward autograd reached last: where a
    failed trace points the user. A gradient reaching a collective the model issues itself raises."""

    at: Optional[fx.Node] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requires_grad: dict[fx.Node, bool] = {}  # per node run: whether its value needs a gradient

    def run_node(self, n: fx.Node) -> Any:
        self.at = n
        if n.meta.get(STOP_KEY):
            self.requires_grad[n] = False
            with self._set_current_node(n):
                return self.env[n.args[0]].detach()
        res = super().run_node(n)
        self.requires_grad[n] = any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(res))
        fns = {id(t.grad_fn): t.grad_fn for t in pytree.tree_leaves(res)
               if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        for fn in fns.values():
            fn.register_prehook(functools.partial(self._reached, n))
        return res

    def _reached(self, n: fx.Node, grad_outputs: Any) -> None:
        self.at = n
        if isinstance(n.target, OpOverload) and n.target.namespace in _COLLECTIVES:
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) and "wait" in str(n.target) else n
            raise CollectiveGradient(
                f"the model calls a torch.distributed collective ({src.target}) at {source_line(n) or n.name} on a "
                f"value that needs a gradient; fxshard shards the single-device model itself and inserts the "
                f"collectives that needs (forward and backward), so write the model for one device: drop the "
                f"collective and shard the layer with the plan (e.g. RowwiseParallel() where you summed partial "
                f"outputs). A collective under torch.no_grad() or on a .detach()-ed value is allowed (it runs as "
                f"written, on every rank), and so is calling the module under torch.no_grad() (its forward runs the "
                f"collective as written); see docs/semantics.md, 'Collectives inside the model'")

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        covered = FUSED_GRAD_ARGS.get(target)
        if covered is not None:
            rest = [a for i, a in enumerate(args) if i not in covered] + list(kwargs.values())
            if any(isinstance(a, torch.Tensor) and a.requires_grad for a in pytree.tree_leaves(rest)):
                outs = decomposition_table[target](*args, **kwargs)
                # the rest of the graph was traced on the fused kernel's output layout (views rely on it)
                return type(outs)(_restride(o, v) for o, v in zip(outs, self.at.meta["val"]))
        return super().call_function(target, args, kwargs)


def _restride(t: Any, like: Any) -> Any:
    """``t`` with the dense layout (dim order by stride) of ``like`` when both have the same shape."""
    if not isinstance(t, torch.Tensor) or t.shape != like.shape or t.stride() == like.stride():
        return t
    order = sorted(range(t.dim()), key=lambda d: (-like.stride()[d], d))
    back = [order.index(d) for d in range(t.dim())]
    return t.permute(order).contiguous().permute(back)


def trace_joint(traced: Traced, fwd_gm: fx.GraphModule, wants_grad: list[bool], by_op: Optional[bool] = None) -> Joint:
    """See module doc; ``wants_grad[i]`` says whether primal ``i`` gets a gradient. ``by_op``: trace each
    distinct op once where the graph allows it (``fxshard/tracing/by_op.py``: the same graph, faster), else
    (and where it does not allow it) the whole graph at once; None: ``trace_by_op.by_op_enabled()``, and only
    where ops repeat enough to gain (``trace_by_op.MIN_REPEATS``)."""
    auto = by_op is None
    if auto:
        by_op = by_op_enabled()
    placeholders = [n for n in fwd_gm.graph.nodes if n.op == "placeholder"]
    primals, mode, tracing_mode = fake_inputs([n.meta.get("val") for n in placeholders])
    out_node = next(n for n in fwd_gm.graph.nodes if n.op == "output")
    out_leaves = output_leaves(out_node)
    diff_out = [i for i, o in enumerate(out_leaves) if i >= len(traced.mutations) and isinstance(o, fx.Node)
                and isinstance(o.meta.get("val"), torch.Tensor) and o.meta["val"].is_floating_point()]
    diff_in = [i for i, w in enumerate(wants_grad) if w]
    # row-major, as _RunSharded.backward passes them (AOTAutograd does the same): a tangent traced with its
    # output's strides (a transposed output) would meet views it cannot take at run time
    tangents = [fake_like(out_leaves[i].meta["val"], mode, contiguous=True) for i in diff_out]
    n_out = len(out_leaves)

    def joint(primals: list, tangents: list):
        # functional tensors under autograd (as AOTAutograd traces): the backward formulas' in-place
        # ops (copy_, relu_, ...) are functionalized too, so the joint graph is pure
        primals = [to_fun(p) for p in primals]
        tangents = [to_fun(t) for t in tangents]
        prim = [p.detach().requires_grad_(i in diff_in) if isinstance(p, torch.Tensor) and p.is_floating_point()
                else p for i, p in enumerate(primals)]
        with fx_traceback.preserve_node_meta():  # joint nodes keep the forward's source lines
            outs = interp.run(*prim)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        for i, t in zip(diff_out, tangents):
            _tie_sizes(outs[i], t)
        pairs = [(outs[i], t) for i, t in zip(diff_out, tangents) if outs[i].requires_grad]
        inputs = [prim[i] for i in diff_in]
        if pairs and inputs:
            grads = torch.autograd.grad([o for o, _ in pairs], inputs, [t for _, t in pairs], allow_unused=True)
        else:
            grads = [None] * len(inputs)
        return ([from_fun(o.detach()) if isinstance(o, torch.Tensor) else o for o in outs],
                [from_fun(g) for g in grads])

    interp = _Differentiable(fwd_gm)
    table = joint_decomposition_table()  # core ATen, fused kernels that have rules kept
    at = lambda: interp.at  # noqa: E731 - the node being traced when the trace fails
    with tracing_errors(
            lambda: f"the training graph (forward + backward){f' at {at().target}' if at() is not None else ''}",
            "if no gradient is needed there, compute it under torch.no_grad() or on .detach()-ed values; to shard "
            "for inference only, set requires_grad=False on the parameters and example inputs",
            where=lambda: (source_line(at()) or at().name) if at() is not None else None), \
            quiet_unless_ok(), torch.enable_grad():
        gm = None
        if tracing_mode == "fake" and by_op:
            fast = joint_by_op(fwd_gm, diff_in, diff_out, _Differentiable, table, lambda n: setattr(interp, "at", n),
                               force=not auto)
            if fast is not None:
                gm, needs_grad = fast
        if gm is None:
            interp.at = None
            gm = functional_make_fx(joint, (primals, tangents), tracing_mode, table)
            needs_grad = interp.requires_grad
            reject_effect_tokens(gm, "the training graph", "gradients (torch.no_grad() or .detach())")
            gm = named_placeholders(gm, [n.name for n in placeholders])
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.alias.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
        elif isinstance(n.target, OpOverload) and n.target._schema.is_mutable:
            raise ShardingError(f"internal: the functionalized joint graph still mutates ({n.format_node()}); "
                                f"please report this model")
    _read_written_noise(gm.graph)
    gm = cse(gm)
    grad_out = [i for i in diff_out if needs_grad.get(out_leaves[i], False)]
    return Joint(gm, len(primals), diff_out, diff_in, n_out, grad_out,
                 _reaches(fwd_gm, needs_grad, diff_in, {i: out_leaves[i] for i in grad_out}))


def _gradient_layout(layout: Optional[tuple[Pl, ...]], what: str) -> Optional[tuple[Pl, ...]]:
    """The layout of the gradient of a value laid out ``layout`` (``what`` names it: a primal, or a module output
    whose incoming gradient this is): its own, except that a term of a sum over an axis (``P(sum)``) has the whole
    gradient there (``R``: d(sum)/d(term) is 1 on every rank, as DTensor's ``from_local`` gives), so a module
    taking a ``P(sum)`` input hands back what a module returning a ``P(sum)`` output takes. A ``P(max)``/``P(min)``
    value's gradient would depend on which rank holds the extreme: a ShardingError."""
    if layout is None or not any(isinstance(p, Part) for p in layout):
        return layout
    other = [p for p in layout if isinstance(p, Part) and p.op != "sum"]
    if other:
        raise ShardingError(
            f"{what} is laid out {other[0]!r} (each rank holds a candidate; the value is their {other[0].op}) and needs a "
            f"gradient, which fxshard does not compute for a partial {other[0].op}; lay it out reduced instead "
            f"(replicated or split in in_specs / out_specs), or let it need no gradient"
        )
    return tuple(R if isinstance(p, Part) else p for p in layout)


def _slot_name(slot: Any) -> str:
    return f"input {slot.index}" if slot.kind == "input" else " / ".join(slot.names)


def _reaches(fwd_gm: fx.GraphModule, needs_grad: dict[fx.Node, bool], diff_in: list[int],
             outs: dict[int, fx.Node]) -> Optional[list[frozenset[int]]]:
    """Per primal of ``diff_in``: the output positions of ``outs`` (position -> a forward value that needs a
    gradient) from which autograd reaches it: a path of values that need a gradient (``needs_grad``) leads
    from it to them. Eager leaves a ``.grad`` None when no output used in the loss reaches it. None for one
    output or none."""
    if len(outs) < 2:
        return None
    placeholders = [n for n in fwd_gm.graph.nodes if n.op == "placeholder"]
    hit: dict[fx.Node, set[int]] = {}
    for k, out in outs.items():
        todo, seen = [out], {out}
        while todo:
            n = todo.pop()
            if n.op == "placeholder":
                hit.setdefault(n, set()).add(k)
            for a in n.all_input_nodes:
                if a not in seen and needs_grad.get(a, False):
                    seen.add(a)
                    todo.append(a)
    return [frozenset(hit.get(placeholders[i], ())) for i in diff_in]


def _read_written_noise(g: fx.Graph) -> None:
    """``rrelu``'s backward reads the noise its forward drew (eager's kernel writes it in place); the
    functionalized trace hands the backward the buffer as it was before that write (uninitialised
    ``empty``), whatever the path. Point every such read at the forward's written noise."""
    written: dict[fx.Node, fx.Node] = {}
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is torch.ops.aten.rrelu_with_noise_functional.default:
            out = next((u for u in n.users if u.target is operator.getitem and u.args[1] == 1), None)
            if out is None:
                with g.inserting_after(n):
                    out = g.call_function(operator.getitem, (n, 1))
                out.meta["val"] = n.meta["val"][1]
            written[n.args[1]] = out
        elif n.target is torch.ops.aten.rrelu_with_noise_backward.default and n.args[2] in written:
            n.args = (n.args[0], n.args[1], written[n.args[2]], *n.args[3:])


@dataclass
class Split:
    fwd: fx.GraphModule
    bwd: fx.GraphModule
    n_saved: int


def partition(joint: Joint, gm: fx.GraphModule, remat: Union[str, Policy] = "none", sizes: Sequence[int] = ()) -> Split:
    """See module doc. ``gm`` is the sharded joint graph (same placeholders/outputs as ``joint.gm``);
    ``remat`` the rematerialisation policy (``fxshard.tracing.remat``: a name or a ``Policy`` with a budget),
    ``sizes`` the mesh's axis sizes."""
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
    # the forward values the backward reads
    reads = {a for n in g.nodes if n not in needed and n.op not in ("placeholder", "output")
             for a in n.all_input_nodes if a in needed}
    reads.update(gr for gr in grads if isinstance(gr, fx.Node) and gr in needed)
    # views of parameters are recomputed in the backward rather than saved, and what the policy says
    def with_param_views(cheap: set[fx.Node]) -> set[fx.Node]:
        cheap = set(cheap)
        for n in g.nodes:
            if (n in needed and n.op == "call_function" and n.target in VIEW_OPS and not n.meta.get(INSERTED_KEY)
                    and all(a in cheap or a in primals for a in n.all_input_nodes)):
                cheap.add(n)
        return cheap

    def saved_and_recomputed(cheap: set[fx.Node]) -> tuple[list[fx.Node], set[fx.Node]]:
        saved: list[fx.Node] = []
        recompute: set[fx.Node] = set()

        def need_in_bwd(a: fx.Node) -> None:
            todo = [a]
            while todo:
                a = todo.pop()
                if a in cheap:
                    if a not in recompute:
                        recompute.add(a)
                        todo.extend(reversed(a.all_input_nodes))  # visited in input order
                elif a in needed and a not in saved:
                    saved.append(a)

        for n in g.nodes:  # in graph order: the saved values keep the order of their first read
            if n in needed or n.op in ("placeholder", "output"):
                continue
            for a in n.all_input_nodes:
                need_in_bwd(a)
        for gr in grads:
            if isinstance(gr, fx.Node) and gr in needed:
                need_in_bwd(gr)
        return saved, recompute

    def saved_bytes(cheap: set[fx.Node]) -> int:
        """Local bytes the forward saves (as ``fxshard.memory`` counts them: a view as its storage, once;
        inputs, parameters and buffers not at all)."""
        owners = set()
        for s in saved_and_recomputed(with_param_views(cheap))[0]:
            while (s.op == "call_function" and s.target in VIEW_OPS and isinstance(s.args[0], fx.Node)
                   and "val" in s.args[0].meta):  # a collective's result is sized at its wait_tensor
                s = s.args[0]
            if s.op != "placeholder":
                owners.add(s)
        return sum(value_bytes(s, sizes) for s in owners)

    policy = check_policy(remat)
    base = recomputed(g, needed, reads, fwd_outs, policy.name, sizes)
    if policy.budget is not None:
        layers = layer_sets(g, needed, fwd_outs)
        base = fit_budget(policy, base if policy.name == "auto" else set(), layers, saved_bytes)
    saved, recompute = saved_and_recomputed(with_param_views(base))

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
    order = {n: i for i, n in enumerate(g.nodes)}

    def materialize(n: fx.Node) -> None:
        """Recompute ``n`` (and what it needs) in the backward right before its first reader: a layer is
        recomputed when its backward starts, not all layers at the top of the backward."""
        if n not in recompute or n in benv:
            return
        todo, closure = [n], set()
        while todo:
            a = todo.pop()
            if a in recompute and a not in benv and a not in closure:
                closure.add(a)
                todo.extend(a.all_input_nodes)
        for a in sorted(closure, key=order.__getitem__):
            benv[a] = bwd.node_copy(a, lambda x: benv[x])

    for n in g.nodes:
        if n in needed or n.op in ("placeholder", "output"):
            continue
        for a in n.all_input_nodes:
            materialize(a)
        benv[n] = bwd.node_copy(n, lambda a: benv[a])
    for gr in grads:
        if isinstance(gr, fx.Node):
            materialize(gr)
    bwd.output(tuple(benv[x] if isinstance(x, fx.Node) else x for x in grads))
    fgm = _make_graph_module(gm, fwd)
    bgm = _make_graph_module(gm, bwd)
    for m in (fgm, bgm):
        m.graph.eliminate_dead_code()
        m.recompile()
    return Split(fgm, bgm, len(saved))


def joint_context(traced: Traced, ctx: ShardContext, joint: Joint, bucket_mb: Optional[float] = None) -> ShardContext:
    """The context of the joint graph from the forward's ``ctx``: primals keep the forward's seeds,
    tangents take the layout their output is required in, and each gradient (output
    ``len(ctx.out_required) + m`` for the ``m``-th of ``joint.diff_in``) its primal's layout."""
    fwd_ph = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    joint_ph = [n for n in joint.gm.graph.nodes if n.op == "placeholder"]
    jctx = ShardContext(mesh=ctx.mesh, label="training", constraints=dict(ctx.constraints), planner=ctx.planner,
                        bucket_mb=bucket_mb, activation_room=ctx.activation_room,
                        solve_within=ctx.solve_within)
    for f, j in zip(fwd_ph, joint_ph):
        if f in ctx.seeds:
            jctx.seeds[j] = ctx.seeds[f]
    k = len(ctx.mesh.sizes)
    for t, i in zip(joint_ph[joint.n_primals:], joint.diff_out):
        jctx.seeds[t] = _gradient_layout(ctx.out_required[i], f"output {i}") or (R,) * k
    jctx.out_required = list(ctx.out_required) + [_gradient_layout(ctx.seeds.get(fwd_ph[i]), _slot_name(traced.slots[i]))
                                                  for i in joint.diff_in]
    if bucket_mb:
        jctx.bucketed = frozenset(range(len(ctx.out_required), len(jctx.out_required)))
    return jctx
