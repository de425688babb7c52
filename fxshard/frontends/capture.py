"""What the compile backend (``compile.py``) makes of a graph TorchDynamo captured.

``Captured`` reads the graph's placeholders: each is a user input or a parameter/buffer, named
by the FQN its dynamo source spells (``L['self']._modules['net1']._parameters['weight']`` ->
``net1.weight``), and the module calls the graph went through (``nn_module_stack``). ``View`` is
the graph as an ``nn.Module`` that ``fxshard.shard`` can take: the real parameters under their
FQNs in containers of the right type (so ``ColwiseParallel`` on an ``nn.Linear`` resolves) and a
``forward`` that runs the graph, applying ParallelStyle constraints where values cross a styled
module call's boundary (``_BoundaryInterpreter``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ..core.errors import ShardingError
from ..core.torch_compat import DYNAMO_INLINE_NN_MODULES_FLAG

__all__ = ["Captured", "View"]


# ---------------------------------------------------------------------------------------------------
# FQNs from dynamo sources

_ROOT = re.compile(r"""^([LG])\[['"]([^'"]+)['"]\]""")
_STEP = re.compile(r"""\._(?:modules|parameters|buffers)\[['"]([^'"]*)['"]\]|\.(\w+)|\[(\d+)\]|\[['"]([^'"]*)['"]\]""")


def _path(name: str) -> Optional[tuple[str, list[str]]]:
    """``L['self']._modules['net1']._parameters['weight']`` -> ``("L['self']", ["net1", "weight"])``."""
    m = _ROOT.match(name)
    if m is None:
        return None
    parts, pos = [], m.end()
    while pos < len(name):
        s = _STEP.match(name, pos)
        if s is None:
            return None
        parts.append(next(g for g in s.groups() if g is not None))
        pos = s.end()
    return m.group(0), parts


def _source_name(node: fx.Node) -> str:
    ga = node.meta.get("grapharg")
    src = getattr(ga, "source", None)
    if src is None:
        return ""
    name = src.name
    return name() if callable(name) else str(name)


# ---------------------------------------------------------------------------------------------------
# the nn.Module view of a captured graph


def _skeleton(cls: type) -> nn.Module:
    """An empty instance of ``cls`` when it is a torch module type the plan may check (Linear/Embedding)."""
    if isinstance(cls, type) and issubclass(cls, (nn.Linear, nn.Embedding)):
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        if issubclass(cls, nn.Linear):
            m.register_parameter("bias", None)
        return m
    return nn.Module()


def _container(root: nn.Module, path: list[str], types: Mapping[str, type]) -> nn.Module:
    m = root
    for i, part in enumerate(path):
        sub = m._modules.get(part)
        if sub is None:
            sub = _skeleton(types.get(".".join(path[: i + 1]), nn.Module))
            m.add_module(part, sub)
        m = sub
    return m


class Captured:
    """What one captured graph takes: per placeholder ``("param"|"buffer", fqn)`` or ``("input", i)``."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list) -> None:
        self.gm = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if any(n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None), torch.Tensor)
               for n in gm.graph.nodes):
            raise ShardingError(
                "fxshard.backend: the captured graph reads parameters as attributes (get_attr); keep "
                f"{DYNAMO_INLINE_NN_MODULES_FLAG}=True (the default) so they arrive as graph inputs"
            )
        self.kinds: list[tuple[str, Any]] = []
        self.inputs: list[torch.Tensor] = []
        roots = set()
        for node, ex in zip(placeholders, example_inputs):
            if not isinstance(ex, torch.Tensor):
                raise ShardingError(
                    f"fxshard.backend: graph input {node.name} is {type(ex).__name__} {ex!r}, not a tensor: dynamo "
                    f"made a size dynamic; compile with torch.compile(..., dynamic=False) (each new shape is then "
                    f"sharded and compiled once)"
                )
            val = node.meta.get("example_value")
            if isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape):
                raise ShardingError(
                    f"fxshard.backend: graph input {node.name} has dynamic shape {tuple(val.shape)}; compile with "
                    f"torch.compile(..., dynamic=False)"
                )
            src = _source_name(node)
            parsed = _path(src)
            is_param = isinstance(ex, nn.Parameter)
            is_buffer = parsed is not None and "._buffers[" in src
            if is_param or is_buffer:
                if parsed is None or not parsed[1]:
                    raise ShardingError(
                        f"fxshard.backend: cannot name the parameter behind graph input {node.name} (source "
                        f"{src!r}); reach parameters as module attributes so the plan can refer to them by FQN"
                    )
                roots.add(parsed[0])
                self.kinds.append(("param" if is_param else "buffer", ".".join(parsed[1])))
            else:
                self.kinds.append(("input", len(self.inputs)))
                self.inputs.append(ex)
        if len(roots) > 1:
            raise ShardingError(
                f"fxshard.backend: the captured graph uses parameters of several root objects {sorted(roots)}; "
                f"compile one nn.Module (torch.compile(model, backend=...)) so every FQN is relative to it"
            )
        self.root = next(iter(roots), None)
        self.tensors = {k[1]: ex for k, ex in zip(self.kinds, example_inputs) if k[0] != "input"}
        # module calls: nn_module_stack key -> (fqn, type, member nodes)
        self.calls: dict[str, tuple[str, type, set]] = {}
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            for key, (path, cls) in (n.meta.get("nn_module_stack") or {}).items():
                parsed = _path(path)
                if parsed is None or (self.root is not None and parsed[0] != self.root):
                    continue
                entry = self.calls.setdefault(key, (".".join(parsed[1]), cls, set()))
                entry[2].add(n)

    def module_types(self) -> dict[str, type]:
        return {fqn: cls for fqn, cls, _ in self.calls.values()}


class View(nn.Module):
    """The captured graph as an nn.Module: real parameters under their FQNs, forward runs the graph."""

    # TorchDynamo captures a new graph when the compiled model's modes change, so the ShardedModule of a
    # captured graph never re-traces for other modes: fxshard.shard keeps no copy of it for that
    fxshard_fixed_modes = True

    def __init__(self, cap: Captured) -> None:
        super().__init__()
        types = cap.module_types()
        for fqn, cls in types.items():
            if fqn:
                _container(self, fqn.split("."), types)
        for (kind, fqn) in [k for k in cap.kinds if k[0] != "input"]:
            *path, leaf = fqn.split(".")
            owner = _container(self, path, types)
            t = cap.tensors[fqn]
            if kind == "param":
                owner.register_parameter(leaf, t)
            else:
                owner.register_buffer(leaf, t)
        object.__setattr__(self, "_cap", cap)
        object.__setattr__(self, "_bounds", {})

    def forward(self, *inputs: torch.Tensor) -> Any:
        cap: Captured = self._cap
        feed = [inputs[k[1]] if k[0] == "input" else self.get_parameter(k[1]) if k[0] == "param"
                else self.get_buffer(k[1]) for k in cap.kinds]
        if not self._bounds:
            return cap.gm(*feed)
        return _BoundaryInterpreter(cap, self._bounds).run(*feed)


class _BoundaryInterpreter(fx.Interpreter):
    """Runs a captured graph, constraining values where they cross a styled module call's boundary.

    A module call's inputs are the tensors its nodes read from outside (parameters excluded), in
    order of first use, matched to the style's positional input specs; its outputs are its nodes'
    values read from outside, matched to the output specs in order of production.
    """

    def __init__(self, cap: Captured, bounds: dict) -> None:
        super().__init__(cap.gm)
        from ..plans.constrain import record

        self._record = record
        params = {n for n, k in zip([n for n in cap.gm.graph.nodes if n.op == "placeholder"], cap.kinds)
                  if k[0] != "input"}
        self._in: dict[fx.Node, list] = {}  # consumer -> [(module depth, call members, input node, spec)]
        self._out: dict[fx.Node, list] = {}  # producer -> [(module depth, call members, spec)]
        depth: dict[str, int] = {}
        for key, (fqn, _cls, members) in cap.calls.items():
            if fqn not in bounds:
                continue
            depth[key] = len(fqn.split("."))
            ext_in: list[fx.Node] = []
            outs: list[fx.Node] = []
            for n in cap.gm.graph.nodes:
                if n in members:
                    for a in n.all_input_nodes:
                        if a not in members and a not in params and a not in ext_in and _is_tensor(a):
                            ext_in.append(a)
                    if _is_tensor(n) and any(u not in members for u in n.users):
                        outs.append(n)
            for b in bounds[fqn]:
                if b.kwargs:
                    raise ShardingError(
                        f"fxshard.backend: module {fqn!r}: keyword-input layouts (desired_input_kwarg_layouts) "
                        f"cannot be located in a captured graph; use positional layouts or fxshard.shard"
                    )
                for node, spec in zip(ext_in, b.inputs):
                    if spec is not None:
                        for n in members:
                            if node in n.all_input_nodes:
                                self._in.setdefault(n, []).append((depth[key], members, node, spec))
                specs = list(b.outputs)
                if len(outs) > 1 and any(s is not None for s in specs):
                    raise ShardingError(
                        f"fxshard.backend: module {fqn!r} has {len(outs)} output values in the captured graph; "
                        f"its output layouts cannot be matched to them; use fxshard.shard for this plan"
                    )
                for node, spec in zip(outs, specs):
                    if spec is not None:
                        self._out.setdefault(node, []).append((depth[key], members, spec))
        self._cache: dict[tuple, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "placeholder":
            return super().run_node(n)
        sub: dict[fx.Node, Any] = {}
        for a in n.all_input_nodes:
            # leaving module calls (innermost first), then entering them (outermost first): hook order
            outs = sorted([o for o in self._out.get(a, []) if n not in o[1]], key=lambda o: -o[0])
            ins = sorted([i for i in self._in.get(n, []) if i[2] is a], key=lambda i: i[0])
            if not outs and not ins:
                continue
            # one constraint per boundary crossing, shared by every consumer behind it
            key: Any = a
            v = self.env[a]
            for kind, members, spec in [("out", o[1], o[2]) for o in outs] + [("in", i[1], i[3]) for i in ins]:
                key = (key, kind, id(members))
                if key not in self._cache:
                    self._cache[key] = self._record(v, spec)
                v = self._cache[key]
            sub[a] = v
        if not sub:
            return super().run_node(n)
        with self._set_current_node(n):
            args = fx.node.map_arg(n.args, lambda x: sub.get(x, self.env[x]))
            kwargs = fx.node.map_arg(n.kwargs, lambda x: sub.get(x, self.env[x]))
            return getattr(self, n.op)(n.target, args, kwargs)


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("example_value"), torch.Tensor)
