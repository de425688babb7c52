"""Pass 1, trace: model + example inputs -> core-ATen fx graph with global shapes.

Requires: an nn.Module whose forward is traceable by ``torch.export``
(non-strict) with the example inputs; parameters may live on the meta device.
Ensures: a GraphModule whose placeholders are, in order, one per unique
parameter/buffer tensor (tied parameters are one placeholder), lifted
constants, then the flattened tensor leaves of ``(args, kwargs)``; every node
carries ``meta["val"]`` (a fake tensor with global, possibly symbolic, shape).
``_softmax``/``_log_softmax`` are decomposed so a split softmax dim becomes
Partial reductions, while the fused kernels in ``FUSED_FORWARD`` stay fused;
shape assertions and no-op clones are dropped (the former refer to global sizes).
No real weight is allocated.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
from torch._decomp import decompositions as _decomps
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ..constrain import constraint_scope, record
from ..errors import ShardingError
from .simplify import drop_noop_clones

aten = torch.ops.aten

__all__ = ["Traced", "Slot", "trace_forward", "source_line", "decomposition_table", "joint_decomposition_table",
           "FUSED_FORWARD", "FUSED_BACKWARD"]


@dataclass
class Slot:
    """One placeholder of the traced graph: what feeds it at run time."""

    kind: str  # "param" | "buffer" | "constant" | "input"
    names: list[str]  # FQNs for params/buffers (all aliases of a tied tensor), [] for inputs
    index: int = -1  # position among the flattened user-input tensor leaves
    persistent: bool = True
    requires_grad: bool = False


@dataclass
class Traced:
    """The traced global program and how to feed it."""

    gm: fx.GraphModule
    slots: list[Slot]
    in_tree: Any  # pytree spec of (args, kwargs)
    out_tree: Any
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    n_user_leaves: int = 0
    tensor_leaf_positions: list[int] = field(default_factory=list)
    mutations: list[str] = field(default_factory=list)  # buffers updated in place: the first outputs


DROP = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.msg,
}


# Fused CPU kernels kept out of the decompositions: each has a sharding rule (fxshard/rules/), and
# decomposing them costs ~25% of a training step in small ops (benchmarks/profile_step.py).
FUSED_FORWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # rules/attention.py
)
FUSED_BACKWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,  # rules/attention.py
    aten.native_layer_norm_backward.default,  # rules/norm.py
    aten.embedding_dense_backward.default,  # rules/embedding.py
    aten.gelu_backward.default,  # rules/pointwise.py (GRAD kind), as are the four below
    aten.silu_backward.default,
    aten.threshold_backward.default,
    aten.sigmoid_backward.default,
    aten.tanh_backward.default,
)


def decomposition_table() -> Any:
    """torch.export's core-ATen table minus ``FUSED_FORWARD``, plus softmax decompositions.

    Ensures: ``_softmax``/``_log_softmax`` decompose (loss parallel needs a split class dim to become
    Partial max/sum reductions); the ops in ``FUSED_FORWARD`` stay fused (they have rules).
    """
    table = torch.export.default_decompositions()
    for op in FUSED_FORWARD:
        table.pop(op, None)
    table[aten._softmax.default] = _decomps._softmax
    table[aten._log_softmax.default] = _decomps._log_softmax
    return table


def joint_decomposition_table() -> dict:
    """The table joint (forward + backward) graphs are traced with.

    Ensures: core ATen plus :func:`decomposition_table`, minus ``FUSED_FORWARD`` and ``FUSED_BACKWARD``
    (fused kernels with sharding rules stay one node each).
    """
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    table.update(decomposition_table().items())
    for op in FUSED_FORWARD + FUSED_BACKWARD:
        table.pop(op, None)
    return table


class _RandomOps:
    """The op packets CSE must keep apart: any overload tagged ``nondeterministic_seeded``."""

    def __contains__(self, packet: Any) -> bool:
        return isinstance(packet, torch._ops.OpOverloadPacket) and any(
            torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def _cse(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge identical pure nodes (export repeats views per consumer), keeping node metadata."""
    from torch.fx.passes.dialect.common.cse_pass import CSEPass

    res = CSEPass(banned_ops=_RandomOps())(gm)  # two draws are two draws: never merge random ops
    out = res.graph_module if res.modified else gm
    out.recompile()
    return out


def source_line(node: fx.Node) -> str:
    """``file:line code`` of the innermost user frame that produced ``node`` (not torch's)."""
    st = node.meta.get("stack_trace") or ""
    lines = [l.strip() for l in st.strip().splitlines()]
    best = ""
    for i, l in enumerate(lines):
        if l.startswith("File ") and f"{os.sep}torch{os.sep}" not in l:
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            parts = l.split('"')
            fname = os.path.basename(parts[1]) if len(parts) > 1 else l
            lineno = l.split("line ")[1].split(",")[0] if "line " in l else "?"
            best = f"{fname}:{lineno} {code}".strip()
    return best


def _user_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if f"{os.sep}torch{os.sep}" not in fr.filename and f"{os.sep}fxshard{os.sep}" not in fr.filename:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "unknown location"


def tracing_error(what: str, e: BaseException, fix: str) -> ShardingError:
    """One readable error for a failed trace: what was traced, the cause, the user's line, the fix."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ShardingError(f"could not trace {what}: {type(e).__name__}: {msg} [at {_user_frame(e)}]; {fix}")


def _to_meta_like(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor) and x.device != device:
        return x.to(device)
    return x


@contextlib.contextmanager
def _boundary_hooks(model: torch.nn.Module, boundaries: Optional[dict]) -> Iterator[None]:
    """Record the plan's module-boundary constraints as ``fxshard::constrain`` ops while tracing."""
    handles = []
    modules = dict(model.named_modules(remove_duplicate=False))
    for fqn, bounds in (boundaries or {}).items():
        def pre(mod, args, kwargs, bounds=bounds):
            args = list(args)
            for b in bounds:
                for i, spec in enumerate(b.inputs[: len(args)]):
                    args[i] = record(args[i], spec)
                for k, spec in b.kwargs.items():
                    if k in kwargs:
                        kwargs[k] = record(kwargs[k], spec)
            return tuple(args), kwargs

        def post(mod, args, kwargs, out, bounds=bounds):
            for b in bounds:
                if isinstance(out, (tuple, list)):
                    out = type(out)(record(o, s) for o, s in zip(out, list(b.outputs) + [None] * len(out)))
                elif b.outputs:
                    out = record(out, b.outputs[0])
            return out

        m = modules[fqn]
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with constraint_scope():
            yield
    finally:
        for h in handles:
            h.remove()


def trace_forward(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None,
                  boundaries: Optional[dict] = None) -> Traced:
    """Export ``model(*args, **kwargs)`` to a decomposed core-ATen graph (see module doc).

    ``boundaries`` (module FQN -> style Boundaries) become ``fxshard::constrain`` ops at those
    modules' inputs and outputs; ``fxshard.constrain`` calls in model code are recorded too.
    """
    if not isinstance(model, torch.nn.Module):
        raise ShardingError(f"shard() expects an nn.Module, got {type(model).__name__}; wrap your function in a Module")
    params = list(model.parameters())
    if params and params[0].device.type == "meta":
        dev = torch.device("meta")
        args = pytree.tree_map(lambda x: _to_meta_like(x, dev), args)
        kwargs = pytree.tree_map(lambda x: _to_meta_like(x, dev), kwargs)
    try:
        with _boundary_hooks(model, boundaries):
            ep = torch.export.export(model, tuple(args), kwargs or None, dynamic_shapes=dynamic_shapes, strict=False)
        ep = ep.run_decompositions(decomposition_table())
    except ShardingError:
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure becomes one readable error
        raise tracing_error(
            f"{type(model).__name__} with torch.export (non-strict)", e,
            "make forward traceable (no data-dependent Python control flow, no .item()/.tolist() on tensors) "
            "or pass example_inputs matching forward's signature") from e

    gm = ep.graph_module
    sig = ep.graph_signature
    by_id: dict[int, list[str]] = {}
    tensor_of: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        tensor_of[name] = p
    for name, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
        tensor_of[name] = b
    non_persistent = set(sig.non_persistent_buffers) if hasattr(sig, "non_persistent_buffers") else set()

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slots: list[Slot] = []
    first_of: dict[int, fx.Node] = {}
    keep: list[fx.Node] = []
    user_i = 0
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            t = tensor_of[spec.target]
            if id(t) in first_of:  # tied: reuse the first placeholder of the same tensor
                node.replace_all_uses_with(first_of[id(t)])
                gm.graph.erase_node(node)
                continue
            first_of[id(t)] = node
            kind = "param" if spec.kind == InputKind.PARAMETER else "buffer"
            slots.append(
                Slot(kind, list(by_id[id(t)]), persistent=spec.target not in non_persistent,
                     requires_grad=bool(getattr(t, "requires_grad", False)) and kind == "param")
            )
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            slots.append(Slot("constant", [spec.target]))
        elif spec.kind == InputKind.USER_INPUT:
            slots.append(Slot("input", [], index=user_i))
            user_i += 1
        else:
            raise ShardingError(f"unsupported exported input kind {spec.kind} for {node.name}")
        keep.append(node)

    mutations: list[str] = []
    for out_spec in sig.output_specs:
        if out_spec.kind == OutputKind.BUFFER_MUTATION:
            mutations.append(out_spec.target)
        elif out_spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
            raise ShardingError(
                f"forward mutates {out_spec.target!r} ({out_spec.kind.name}); in-place updates of inputs or "
                f"parameters are not supported: compute the new value and return it instead"
            )

    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in DROP:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm = drop_noop_clones(_cse(gm))

    flat, in_tree = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    if len(positions) != user_i:
        raise ShardingError(
            f"the exported program takes {user_i} tensor inputs but the example inputs hold {len(positions)} tensors; "
            f"pass tensors for every tensor argument of forward"
        )
    return Traced(
        gm=gm,
        slots=slots,
        in_tree=in_tree,
        out_tree=ep.call_spec.out_spec,
        constants=dict(ep.constants),
        n_user_leaves=len(flat),
        mutations=mutations,
        tensor_leaf_positions=positions,
    )
