"""Tracing one distinct op at a time: the fast path of ``shard()``'s two ``make_fx`` traces.

``trace_forward`` re-traces export's graph to decompose it (``trace._decomposed``) and ``trace_joint``
traces forward + backward (``tracing/joint.py``). Traced whole, every op of every layer goes through the
functional, proxy and fake modes: most of ``shard()``'s time on a deep model, although 32 identical
layers hold about a hundred distinct ops. ``forward_by_op`` and ``joint_by_op`` trace each distinct op
once and copy the result wherever it recurs. Each returns the graph the whole trace gives (same
placeholders, outputs, ops, values and source lines; gradient additions in autograd's order) or None
when the graph is outside what it handles, and the caller then traces it whole: symbolic or
data-dependent shapes, collectives or higher-order ops in the graph (a ``no_grad`` region of
export's), ops that update an input in place, conjugate or negative views, an ``as_strided`` of an
input with a storage offset (fake inputs start at offset 0), a complex input that wants a gradient,
an op whose trace adds effect tokens or constants, any op that fails to trace (the whole trace's error
says where), or a graph whose ops repeat too little to gain (``MIN_REPEATS``). It never guesses; the
reason is logged at DEBUG.

1. Forward, in order: each op's *signature*: op, arguments with the positions of the graph values
   among them, each value's shape, strides, storage offset, dtype, device and whether it needs a
   gradient (a primal that gets one, or an op output autograd marks so: read from the op run once on
   fake tensors per signature; stop-gradients never). The forward decomposition traces each op here (under
   ``no_grad``, as the whole re-trace does), and its consumers see the values the traced copies
   make, not export's record of them (a decomposition may lay its result out differently, and the
   next op's decomposition can depend on strides; the joint reads the forward graph's values, which
   its own trace made).
2. Joint only, backward in reverse: the gradients reaching each op's outputs (tangents of the
   differentiable outputs first, then each consumer's gradient in the order autograd's engine adds
   them). An op with gradients is traced by itself, forward and backward, by the whole trace's
   machinery (``make_fx`` over functional fake tensors under autograd, ``_Differentiable`` for
   stop-gradients and fused kernels), with tangents of exactly the layouts its gradients have; the
   trace is memoised by signature, outputs that get a gradient and their layouts. An op without
   gradients is traced forward-only.
3. Emit: every op's forward part in forward order, then (joint) the backward parts in reverse order,
   a gradient reaching a value more than once summed (``aten.add``) as it arrives. Copies keep the
   provenance (source line, module path) of the node they stand for, and a ``fxshard::constrain``
   its own key (one trace serves every constraint of a kind).
"""

from __future__ import annotations

import logging
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from ..core.torch_compat import pytree

from ..plans.constrain import CONSTRAIN_OP, constraint_kind
from .fake import fake_like, functional_make_fx
from ..core.ir import STOP_KEY
from ..core.torch_compat import COPY_META_FIELDS, FakeTensorMode, OpOverload, ShapeEnv, from_fun, to_fun
from ..core.torch_compat import extract_tensor_metadata as _extract_tensor_metadata, make_graph_module as _make_graph_module

__all__ = ["joint_by_op", "forward_by_op", "by_op_enabled"]

_log = logging.getLogger(__name__)  # why a graph was traced whole (DEBUG)
_FOREIGN = ("_c10d_functional", "c10d", "_c10d_functional_autograd", "higher_order")
# meta that make_fx copies from the node being run (``preserve_node_meta``): where a copy came from
_PROVENANCE = ("stack_trace", *COPY_META_FIELDS)


def by_op_enabled() -> bool:
    """Whether the traces go one op at a time where they can: unless the environment sets
    ``FXSHARD_TRACE_BY_OP=0`` (every graph is then traced whole: slower, the same result; a way to rule
    this module out when a trace looks wrong)."""
    return os.environ.get("FXSHARD_TRACE_BY_OP", "1") != "0"


class _Unsupported(Exception):
    """The graph needs the whole-graph trace."""


@dataclass
class _Mini:
    """One op traced alone: ``ins`` its distinct graph inputs, ``tans`` the tangents of the outputs that
    get a gradient, ``outs`` its output leaves, ``grads`` a gradient per input (None: none)."""

    graph: fx.Graph
    ins: list[fx.Node]
    tans: list[fx.Node]
    outs: list[Any]
    grads: list[Optional[fx.Node]]
    fwd: list[fx.Node]
    bwd: list[fx.Node]
    key: Optional[str]  # the constraint key traced (``fxshard::constrain``): each copy gets its own
    src_meta: dict  # meta of the node traced: the provenance its forward nodes carry


def _layout(t: torch.Tensor) -> tuple:
    """What a traced op may depend on of an input besides its values. A conjugate or negative view
    is not reproduced on the fake inputs: such a value needs the whole trace."""
    if t.is_conj() or t.is_neg():
        raise _Unsupported("a conjugate or negative view")
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)


# ops whose traced graph holds the storage offset of their input (fake inputs start at offset 0)
_OFFSET_OPS = {"as_strided", "as_strided_scatter", "as_strided_copy", "as_strided_"}


def _leaves(val: Any) -> list[Any]:
    """An op's output leaves: the tensor, or the elements of its tuple/list of tensors."""
    if isinstance(val, torch.Tensor):
        return [val]
    if val is None:  # an op that returns nothing (a runtime check)
        return []
    if isinstance(val, (tuple, list)) and all(v is None or isinstance(v, torch.Tensor) for v in val):
        return list(val)
    raise _Unsupported(f"output {type(val).__name__}")


def _frozen(a: Any, index: dict[fx.Node, int]) -> Hashable:
    if isinstance(a, fx.Node):
        return ("in", index[a])
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_frozen(x, index) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _frozen(v, index)) for k, v in a.items()))
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
        raise _Unsupported("symbolic or tensor constant argument")
    hash(a)
    return (type(a).__name__, a)


# Below this many ops per distinct op the per-op traces' fixed cost (one make_fx each) exceeds what
# they save (measured: a 2-layer Llama, 3.3 ops per distinct op, breaks even; seed 000's 5 distinct
# ops trace 0.06 s slower one at a time). Read at each call.
MIN_REPEATS = 4.0


def joint_by_op(fwd_gm: fx.GraphModule, diff_in: list[int], diff_out: list[int],
                interp_cls: Callable[..., fx.Interpreter], table: dict,
                on_node: Callable[[fx.Node], None], force: bool = False
                ) -> Optional[tuple[fx.GraphModule, dict[fx.Node, bool]]]:
    """See module doc. ``interp_cls`` runs a one-op graph as the whole trace runs the forward
    (``_Differentiable``); ``on_node(n)`` is told the forward node being traced (for error messages).
    Returns the joint graph before alias removal and CSE, with the forward's placeholder names, and
    whether autograd marks each forward node's value (any leaf of it) as needing a gradient; None
    also when ops repeat less than ``MIN_REPEATS`` times on average, unless ``force``."""
    try:
        by_op = _ByOp(fwd_gm, diff_in, diff_out, interp_cls, table, on_node, grad=True,
                      min_repeats=0.0 if force else MIN_REPEATS)
        gm = by_op.run()
        return gm, {n: by_op.rg[n] if n in by_op.rg else any(by_op.leaf_rg.get(n, ())) for n in by_op.nodes}
    except Exception as e:  # noqa: BLE001 - outside what it handles (or an op fails): the whole trace decides
        _log.debug("the joint graph is traced whole: %s", e)
        return None


def forward_by_op(gm: fx.GraphModule, table: dict) -> Optional[fx.GraphModule]:
    """``gm`` (an exported program's graph) decomposed by ``table`` one distinct op at a time: the graph
    ``trace._decomposed`` traces whole (under ``no_grad``, inputs that require grad doing so, outputs
    returned as a flat list), or None where that needs the whole trace (the cases of the
    module doc)."""
    try:
        return _ByOp(gm, [], [], fx.Interpreter, table, lambda n: None, grad=False, min_repeats=MIN_REPEATS).run()
    except Exception as e:  # noqa: BLE001 - as joint_by_op
        _log.debug("the forward is decomposed whole: %s", e)
        return None


class _ByOp:
    """Both traces: ``grad`` the joint one (module doc), else the forward decomposition
    (``forward_by_op``: no gradients, every op forward-only)."""

    def __init__(self, fwd_gm, diff_in, diff_out, interp_cls, table, on_node, grad: bool,
                 min_repeats: float) -> None:
        self.g = fwd_gm.graph
        self.grad = grad
        self.diff_in, self.diff_out = diff_in, diff_out
        self.interp_cls, self.table, self.on_node = interp_cls, table, on_node
        self.root = torch.nn.Module()
        self.mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
        self.rg_memo: dict[Hashable, list[bool]] = {}
        self.minis: dict[Hashable, _Mini] = {}
        for n in self.g.nodes:
            if n.op in ("get_attr", "call_module", "call_method"):
                raise _Unsupported(n.op)
            if n.op == "call_function" and n.target is not operator.getitem and (
                    not isinstance(n.target, OpOverload) or n.target.namespace in _FOREIGN
                    or n.target._schema.is_mutable):
                raise _Unsupported(str(n.target))
            for v in pytree.tree_leaves(n.meta.get("val")):
                if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
                    raise _Unsupported("symbolic or data-dependent shape")
        if min_repeats > 0:
            ops = [n for n in self.g.nodes if n.op == "call_function" and n.target is not operator.getitem]
            distinct = set()
            for n in ops:
                ins = self._inputs(n)
                index = {a: i for i, a in enumerate(ins)}
                distinct.add((n.target, _frozen(n.args, index), _frozen(n.kwargs, index),
                              tuple(_layout(a.meta["val"]) for a in ins)))
            if len(ops) < min_repeats * len(distinct):
                raise _Unsupported(f"{len(ops)} ops, {len(distinct)} distinct: cheaper traced whole")

    # -- signatures -------------------------------------------------------------------------------

    def _inputs(self, n: fx.Node) -> list[fx.Node]:
        seen: dict[fx.Node, None] = {}
        for a in pytree.tree_leaves((n.args, n.kwargs)):
            if isinstance(a, fx.Node):
                seen.setdefault(a, None)
        return list(seen)

    def _val(self, a: fx.Node) -> torch.Tensor:
        """``a``'s value as the whole trace would see it: the forward decomposition's ops may lay out
        their results unlike the exported graph's record (``val_of``: the traced copies' values)."""
        v = self.val_of.get(a, a.meta.get("val"))
        if not isinstance(v, torch.Tensor):
            raise _Unsupported(f"input {a.name} without a tensor value")
        return v

    def _signature(self, n: fx.Node, ins: list[fx.Node]) -> Hashable:
        index = {a: i for i, a in enumerate(ins)}
        args = n.args
        if n.target is CONSTRAIN_OP:  # one trace for every key of a kind (its copies get their own key)
            args = (args[0], constraint_kind(args[1]))
        return (n.target, bool(n.meta.get(STOP_KEY)), _frozen(args, index), _frozen(n.kwargs, index),
                tuple(_layout(self._val(a)) + (self.rg[a],) for a in ins))

    # -- tracing one op ---------------------------------------------------------------------------

    def _one_op(self, n: fx.Node, ins: list[fx.Node]) -> fx.Interpreter:
        """An interpreter (``interp_cls``) of the graph ``ins -> n``."""
        g = fx.Graph()
        env = {a: g.placeholder(f"in_{i}") for i, a in enumerate(ins)}
        for a, p in env.items():
            p.meta["val"] = a.meta["val"]
        g.output(g.node_copy(n, env.__getitem__))
        return self.interp_cls(self.root, graph=g)

    def _requires_grad(self, n: fx.Node, ins: list[fx.Node], sig: Hashable) -> list[bool]:
        """Which output leaves of ``n`` autograd marks as needing a gradient."""
        if sig not in self.rg_memo:
            if not self.grad or n.meta.get(STOP_KEY) or not any(self.rg[a] for a in ins):
                flags = [False] * len(_leaves(n.meta.get("val")))
            else:
                interp = self._one_op(n, ins)
                args = [fake_like(self._val(a), self.mode).requires_grad_(self.rg[a]) for a in ins]
                self.on_node(n)
                with self.mode, torch.enable_grad():
                    res = interp.run(*args)
                flags = [isinstance(r, torch.Tensor) and r.requires_grad for r in _leaves(res)]
            self.rg_memo[sig] = flags
        return self.rg_memo[sig]

    def _trace(self, n: fx.Node, ins: list[fx.Node], sig: Hashable, wanted: list[int],
               tangent_vals: list[torch.Tensor]) -> _Mini:
        key = (sig, tuple(wanted), tuple(_layout(t) for t in tangent_vals))  # (conjugate tangents: whole)
        if key in self.minis:
            return self.minis[key]
        self.on_node(n)
        interp = self._one_op(n, ins)
        rg = [self.rg[a] for a in ins]
        vals = [self._val(a) for a in ins]

        def one(prims: list, tangents: list):
            prims = [to_fun(p) for p in prims]
            tangents = [to_fun(t) for t in tangents]
            # as the whole traces do: the joint detaches its primals, the forward marks its inputs
            prim = [(p.detach() if self.grad else p).requires_grad_() if r else p  # complex ones too
                    for p, r in zip(prims, rg)]
            with fx_traceback.preserve_node_meta():
                res = interp.run(*prim)
            outs = _leaves(res)
            pairs = [(outs[j], t) for j, t in zip(wanted, tangents) if outs[j].requires_grad]
            inputs = [p for p, r in zip(prim, rg) if r]
            if pairs and inputs:
                grads = torch.autograd.grad([o for o, _ in pairs], inputs, [t for _, t in pairs], allow_unused=True)
            else:
                grads = [None] * len(inputs)
            return ([from_fun(o.detach() if self.grad else o) if isinstance(o, torch.Tensor) else o for o in outs],
                    [from_fun(x) for x in grads])

        prims = [fake_like(v, self.mode) for v in vals]
        tans = [fake_like(t, self.mode) for t in tangent_vals]
        with torch.set_grad_enabled(self.grad):
            traced = functional_make_fx(one, (prims, tans), "fake", self.table)
        graph = traced.graph
        for x in graph.nodes:
            if x.op == "get_attr" or (x.op == "call_function" and not isinstance(x.target, OpOverload)
                                      and x.target is not operator.getitem):
                raise _Unsupported(f"{x.op} {x.target} in the trace of {n.target}")
        if any(v.storage_offset() for v in vals + tangent_vals) and any(
                getattr(x.target, "overloadpacket", None).__name__ in _OFFSET_OPS for x in graph.nodes
                if isinstance(x.target, OpOverload)):
            raise _Unsupported(f"{n.target} reads the storage offset of an input that has one")
        phs = [x for x in graph.nodes if x.op == "placeholder"]
        if len(phs) != len(ins) + len(tangent_vals):
            raise _Unsupported("extra inputs (effect tokens)")
        out_node = next(x for x in graph.nodes if x.op == "output")
        flat = list(out_node.args[0])  # make_fx flattens (outs, grads), keeping None
        n_out = len(_leaves(n.meta.get("val")))
        outs, grads_flat = flat[:n_out], flat[n_out:]
        grads: list[Optional[fx.Node]] = [None] * len(ins)
        for k, gr in zip([i for i, r in enumerate(rg) if r], grads_flat):
            grads[k] = gr
        fwd_set: set[fx.Node] = set()
        stack = [o for o in outs if isinstance(o, fx.Node)]
        while stack:
            x = stack.pop()
            if x not in fwd_set:
                fwd_set.add(x)
                stack.extend(x.all_input_nodes)
        body = [x for x in graph.nodes if x.op == "call_function"]
        mini = _Mini(graph, phs[:len(ins)], phs[len(ins):], list(outs), grads,
                     [x for x in body if x in fwd_set or not self.grad], [x for x in body if x not in fwd_set and self.grad],
                     n.args[1] if n.target is CONSTRAIN_OP else None, n.meta)
        self.minis[key] = mini
        return mini

    # -- the whole graph --------------------------------------------------------------------------

    def run(self) -> fx.GraphModule:
        self.nodes = list(self.g.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        out_node = next(n for n in self.nodes if n.op == "output")
        self.out_leaves = pytree.tree_leaves(out_node.args, is_leaf=lambda x: isinstance(x, fx.Node))
        self._forward_sweep()
        self.tangent_vals = [fake_like(self.out_leaves[i].meta["val"], self.mode, contiguous=True)
                             for i in self.diff_out]  # row-major: see trace_joint
        chosen = self._backward_sweep()
        return self._emit(chosen)

    @staticmethod
    def _slot(a: fx.Node) -> tuple[fx.Node, int]:
        """The (producer, output leaf) a graph value is."""
        if a.op == "call_function" and a.target is operator.getitem:
            return a.args[0], a.args[1]
        return a, 0

    def _seeds(self) -> list[tuple[tuple[fx.Node, int], int]]:
        """The tangents that reach a value needing a gradient: (its slot, tangent index)."""
        return [(self._slot(self.out_leaves[i]), k) for k, i in enumerate(self.diff_out)
                if self.rg.get(self.out_leaves[i], False)]

    def _forward_sweep(self) -> None:
        """1. Which values need a gradient (per output leaf of an op; a getitem reads its tuple's), each
        op's inputs and signature; the forward decomposition traces each op here."""
        self.rg: dict[fx.Node, bool] = {}
        self.val_of: dict[fx.Node, Any] = {}
        self.leaf_rg: dict[fx.Node, list[bool]] = {}
        self.sigs: dict[fx.Node, Hashable] = {}
        self.ins_of: dict[fx.Node, list[fx.Node]] = {}
        leaf_rg, sigs, ins_of = self.leaf_rg, self.sigs, self.ins_of
        for i, p in enumerate(self.placeholders):
            v = p.meta.get("val")
            if self.grad:
                if i in self.diff_in and isinstance(v, torch.Tensor) and v.is_complex():
                    raise _Unsupported("a complex input that wants a gradient")  # the whole trace says why not
                self.rg[p] = i in self.diff_in and isinstance(v, torch.Tensor) and v.is_floating_point()
            else:
                self.rg[p] = isinstance(v, torch.Tensor) and v.requires_grad
        for n in self.nodes:
            if n.op != "call_function":
                continue
            if n.target is operator.getitem:
                base, idx = n.args
                if base not in leaf_rg:
                    raise _Unsupported("getitem of a non-op")
                self.rg[n] = leaf_rg[base][idx]
                if base in self.val_of:
                    self.val_of[n] = self.val_of[base][idx]
                continue
            ins_of[n] = ins = self._inputs(n)
            sigs[n] = sig = self._signature(n, ins)
            leaf_rg[n] = self._requires_grad(n, ins, sig)
            if not self.grad:  # forward-only: trace now, so consumers see the values it makes
                mini = self._trace(n, ins, sig, [], [])
                vals = [o.meta["val"] if isinstance(o, fx.Node) else o for o in mini.outs]
                self.val_of[n] = vals[0] if isinstance(n.meta.get("val"), torch.Tensor) else vals
            if isinstance(n.meta.get("val"), torch.Tensor):
                self.rg[n] = leaf_rg[n][0]

    def _backward_sweep(self) -> dict[fx.Node, tuple[_Mini, list[int]]]:
        """2. In reverse, the trace of each op and which of its outputs get a gradient, the gradients'
        layouts accumulated (as ``_emit`` will add them) to pick the trace of each producer."""
        acc_val: dict[tuple[fx.Node, int], torch.Tensor] = {}

        def arrive(target: tuple[fx.Node, int], val: torch.Tensor) -> None:
            if target in acc_val:
                with self.mode:
                    acc_val[target] = torch.ops.aten.add.Tensor(acc_val[target], val)
            else:
                acc_val[target] = val

        for target, k in self._seeds():
            arrive(target, self.tangent_vals[k])
        chosen: dict[fx.Node, tuple[_Mini, list[int]]] = {}
        for n in reversed(self.nodes):
            if n not in self.sigs:
                continue
            wanted = [j for j in range(len(self.leaf_rg[n])) if (n, j) in acc_val]
            mini = self._trace(n, self.ins_of[n], self.sigs[n], wanted, [acc_val[(n, j)] for j in wanted])
            chosen[n] = (mini, wanted)
            for a, gr in zip(self.ins_of[n], mini.grads):
                if gr is not None:
                    arrive(self._slot(a), gr.meta["val"])
        return chosen

    def _emit(self, chosen: dict[fx.Node, tuple[_Mini, list[int]]]) -> fx.GraphModule:
        """3. The graph: forward parts in order, then backward parts in reverse, gradients summed as
        they arrive."""
        ins_of, placeholders = self.ins_of, self.placeholders
        g = fx.Graph()
        env: dict[fx.Node, Any] = {}  # forward node -> emitted node (a list of leaves for a tuple op)
        for p in placeholders:
            env[p] = q = g.placeholder(p.name)
            q.meta["val"] = fake_like(p.meta.get("val"), self.mode)
            if isinstance(q.meta["val"], torch.Tensor):
                q.meta["tensor_meta"] = _extract_tensor_metadata(q.meta["val"])
        tangents = []
        for k, t in enumerate(self.tangent_vals):
            q = g.placeholder(f"tangents_{k + 1}")
            q.target = q.name  # suffixed when a forward input has that name
            q.meta["val"] = t
            q.meta["tensor_meta"] = _extract_tensor_metadata(t)
            tangents.append(q)

        def value(a: fx.Node) -> fx.Node:
            if a.op == "call_function" and a.target is operator.getitem:
                return env[a.args[0]][a.args[1]]
            return env[a] if a.op == "placeholder" else env[a][0]

        copies: dict[fx.Node, dict[fx.Node, Any]] = {}
        for n in self.nodes:
            if n not in chosen:
                continue
            mini, _ = chosen[n]
            m = copies[n] = {ph: value(a) for ph, a in zip(mini.ins, ins_of[n])}
            for x in mini.fwd:
                m[x] = self._copy(g, x, m, n, mini)
            env[n] = [m[o] if isinstance(o, fx.Node) else o for o in mini.outs]

        grad_of: dict[tuple[fx.Node, int], fx.Node] = {}

        def add(target: tuple[fx.Node, int], new: fx.Node) -> None:
            old = grad_of.get(target)
            if old is None:
                grad_of[target] = new
                return
            s = g.create_node("call_function", torch.ops.aten.add.Tensor, (old, new), name="add")
            with self.mode:
                s.meta["val"] = torch.ops.aten.add.Tensor(old.meta["val"], new.meta["val"])
            s.meta["tensor_meta"] = _extract_tensor_metadata(s.meta["val"])
            grad_of[target] = s

        for target, k in self._seeds():
            add(target, tangents[k])
        for n in reversed(self.nodes):
            if n not in chosen:
                continue
            mini, wanted = chosen[n]
            m = copies[n]
            for t, j in zip(mini.tans, wanted):
                m[t] = grad_of[(n, j)]
            for x in mini.bwd:
                m[x] = self._copy(g, x, m, None, mini, n)
            for a, gr in zip(ins_of[n], mini.grads):
                if gr is not None:
                    add(self._slot(a), m[gr])

        outs = [value(o) if isinstance(o, fx.Node) else o for o in self.out_leaves]
        grads = [grad_of.get((placeholders[i], 0)) for i in self.diff_in]
        g.output((outs, grads) if self.grad else outs)
        return _make_graph_module(self.root, g)

    def _copy(self, g: fx.Graph, x: fx.Node, m: dict, fwd_node: Optional[fx.Node], mini: _Mini,
              node: Optional[fx.Node] = None) -> fx.Node:
        """Copy ``mini``'s node ``x`` for the forward node ``fwd_node`` (a forward part: it carries that
        node's provenance, not the provenance of the node ``mini`` was traced for) or ``node`` (a backward
        part), named as make_fx names it, with ``node``'s own constraint key."""
        node = fwd_node or node
        name = g._target_to_str(x.target.overloadpacket.__name__) if isinstance(x.target, OpOverload) else None
        args, kwargs = fx.map_arg(x.args, m.__getitem__), fx.map_arg(x.kwargs, m.__getitem__)
        if mini.key is not None and mini.key != node.args[1]:
            args, kwargs = pytree.tree_map_only(str, lambda s: node.args[1] if s == mini.key else s, (args, kwargs))
        y = g.create_node(x.op, x.target, args, kwargs, name=name, type_expr=x.type)
        y.meta = dict(x.meta)
        if fwd_node is not None:
            for key in _PROVENANCE:
                if key in fwd_node.meta:
                    y.meta[key] = fwd_node.meta[key]
                elif key in mini.src_meta:
                    y.meta.pop(key, None)
        return y
