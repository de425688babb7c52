"""torch.compile integration: ``fxshard.backend`` (a TorchDynamo backend that shards the captured
graph), ``fxshard.backend_options`` (the same, for ``backend="fxshard"``) and ``overlap`` (issue
collectives early, wait late).

Compiling an already sharded module needs nothing from this file: ``torch.compile(sm)`` (any
backend, ``fullgraph=True`` works) traces through ``ShardedModule.forward`` and the autograd
function that runs the sharded forward/backward programs, so each rank compiles its own program.

How the backend works (one captured graph at a time):

1. TorchDynamo hands over an FX graph of torch-level calls whose placeholders are the user's
   tensors *and* the model's parameters/buffers (``inline_inbuilt_nn_modules``, the default on
   torch 2.13). Each placeholder's dynamo source (``L['self']._modules['net1']._parameters['weight']``)
   gives the parameter's FQN (``net1.weight``) relative to the compiled module, and the nodes'
   ``nn_module_stack`` gives the FQN and type of every submodule the graph went through.
2. An ``nn.Module`` view of the graph is rebuilt: the real parameters registered under their FQNs
   in containers of the right type (so ``ColwiseParallel`` on an ``nn.Linear`` resolves), and a
   ``forward`` that runs the captured graph. Module-boundary constraints of ParallelStyles are
   applied where values enter/leave the nodes of that module call (``nn_module_stack``).
3. ``fxshard.shard`` shards the view with the plan (the whole pipeline: trace, propagate,
   redistribute, localize, joint graph for training) and the resulting ShardedModule is compiled
   with the inner backend (default ``"inductor"``) with ``fullgraph=True``.
4. The returned callable feeds that ShardedModule the user inputs and this rank's *local*
   parameter shards; the full parameters dynamo passes in are ignored.

Overlap: fxshard's redistribute pass puts each collective directly before its wait, right before
the first consumer (buffers die early, seed 002). ``overlap(sm)`` / ``backend(..., overlap=True)``
reschedules the emitted per-rank programs instead: each collective is issued as soon as its inputs
exist and waited only when nothing independent is left to run (``reorder_for_overlap``);
``overlap_report(sm)`` lists, per collective, its issue and wait positions and the compute between.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar, Token
import re
import weakref
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from .ir import COMM_KEY, OpClass, is_op
from .passes.overlap import collective_groups, reorder_for_overlap
from .errors import ShardingError
from .mesh import MeshInfo
from .module import ShardedModule
from .placements import to_torch

__all__ = ["backend", "backend_options", "FxshardBackend", "overlap", "overlap_report", "reorder_for_overlap"]

c10d = torch.ops._c10d_functional


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


class _Captured:
    """What one captured graph takes: per placeholder ``("param"|"buffer", fqn)`` or ``("input", i)``."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list) -> None:
        self.gm = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if any(n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None), torch.Tensor)
               for n in gm.graph.nodes):
            raise ShardingError(
                "fxshard.backend: the captured graph reads parameters as attributes (get_attr); keep "
                "torch._dynamo.config.inline_inbuilt_nn_modules=True (the default) so they arrive as graph inputs"
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


class _View(nn.Module):
    """The captured graph as an nn.Module: real parameters under their FQNs, forward runs the graph."""

    # TorchDynamo captures a new graph when the compiled model's modes change, so the ShardedModule of a
    # captured graph never re-traces for other modes: fxshard.shard keeps no copy of it for that
    fxshard_fixed_modes = True

    def __init__(self, cap: _Captured) -> None:
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
        cap: _Captured = self._cap
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

    def __init__(self, cap: _Captured, bounds: dict) -> None:
        super().__init__(cap.gm)
        from .constrain import record

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


# ---------------------------------------------------------------------------------------------------
# the backend


class FxshardBackend:
    """A TorchDynamo backend that shards every graph it is given; see :func:`backend`.

    Holds this rank's local parameter shards, shared by every graph it compiles (graph breaks,
    recompilations, tied parameters): ``parameters()``/``named_parameters()`` are what the
    optimizer must update; ``modules`` are the ShardedModules of the graphs compiled so far (for
    ``fxshard.explain``/``comm_stats``).
    """

    def __init__(self, mesh: DeviceMesh, plan: Optional[Mapping[str, Any]] = None, *,
                 inner: Any = "inductor", overlap: bool = False, **shard_options: Any) -> None:
        MeshInfo.of(mesh)  # validate early
        self.mesh = mesh
        self.plan = dict(plan or {})
        self.inner = inner
        self.overlap = overlap
        self.shard_options = shard_options
        self.modules: list[ShardedModule] = []
        self._local: dict[int, torch.Tensor] = {}  # id(full tensor) -> local shard
        self._full: dict[int, Any] = {}  # id -> weakref of the full tensor (an id may be reused after it dies)
        self._placement: dict[int, tuple] = {}
        self._fqn: dict[int, str] = {}
        self._matched: set[str] = set()

    # ---- state ---------------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's local parameter shards under their FQNs (one entry per tensor)."""
        if not self.modules:
            raise ShardingError(
                "fxshard.backend: no graph has been compiled yet, so no parameters are sharded; call the "
                "compiled model once (compilation is lazy) before creating the optimizer"
            )
        for i, t in self._local.items():
            if isinstance(t, nn.Parameter):
                yield self._fqn[i], t

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def placements(self) -> dict[str, tuple]:
        """FQN -> fxshard placements of every tensor sharded so far."""
        return {self._fqn[i]: p for i, p in self._placement.items()}

    # ---- compiling ----------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        if kwargs.get("options"):
            raise ShardingError(
                "fxshard backend: torch.compile(options=...) is not used; give the mesh and plan with "
                "fxshard.backend(mesh, plan) or fxshard.backend_options(mesh, plan)"
            )
        cap = _Captured(gm, list(example_inputs))
        view = _View(cap)
        plan = self._plan_for(view, cap)
        from .plan import resolve_boundaries

        bounds = resolve_boundaries(plan, view, MeshInfo.of(self.mesh))
        object.__setattr__(view, "_bounds", bounds)
        from .api import shard

        from .pipeline import DEFAULT, OVERLAP

        options = dict(self.shard_options)
        pipeline = options.pop("pipeline", DEFAULT)
        with _outside_dynamo():
            sm = shard(view, self.mesh, plan, example_inputs=tuple(cap.inputs),
                       pipeline=pipeline.with_pass(OVERLAP) if self.overlap else pipeline, **options)
        self._share(sm, cap)
        self.modules.append(sm)
        run = sm if self.inner in (None, "none") else torch.compile(sm, backend=self.inner, fullgraph=True)
        positions = [i for i, k in enumerate(cap.kinds) if k[0] == "input"]

        def sharded_graph(*args: Any) -> Any:  # dynamo passes the full parameters too: only inputs go on
            return run(*[args[i] for i in positions])

        sharded_graph.sharded_module = sm  # type: ignore[attr-defined]
        return sharded_graph

    def _plan_for(self, view: _View, cap: _Captured) -> dict:
        """The user plan restricted to entries that match this graph, plus placements already chosen
        for tensors seen in earlier graphs under FQNs the plan does not cover."""
        tensors = [n for n, _ in view.named_parameters(remove_duplicate=False)]
        tensors += [n for n, _ in view.named_buffers(remove_duplicate=False)]
        modules = [n for n, _ in view.named_modules(remove_duplicate=False)]
        plan: dict = {}
        covered: set[str] = set()
        for key, spec in self.plan.items():
            names = modules if isinstance(spec, ParallelStyle) else tensors
            hits = [n for n in names if fnmatchcase(n, key)]
            if hits:
                plan[key] = spec
                self._matched.add(key)
                if isinstance(spec, ParallelStyle):
                    covered.update(t for t in tensors for h in hits if t.startswith(h + "."))
                else:
                    covered.update(hits)
        for fqn, t in cap.tensors.items():
            i = id(t)
            if i in self._placement and self._full[i]() is t and fqn not in covered:
                plan[fqn] = tuple(to_torch(p) for p in self._placement[i])
        return plan

    def unmatched_plan_entries(self) -> list[str]:
        """Plan keys that matched nothing in any graph compiled so far (likely typos)."""
        return [k for k in self.plan if k not in self._matched]

    def _share(self, sm: ShardedModule, cap: _Captured) -> None:
        """Make ``sm`` use the local shards of tensors sharded by earlier graphs; record new ones."""
        for fqn, full in cap.tensors.items():
            i = id(full)
            pls = sm._placements[fqn]
            if i in self._local and self._full[i]() is full:
                if self._placement[i] != pls:
                    raise ShardingError(
                        f"fxshard.backend: {fqn!r} is placed {pls} in this graph but {self._placement[i]} in an "
                        f"earlier one (as {self._fqn[i]!r}); give tied/reused tensors one plan entry"
                    )
                shared = self._local[i]
                *path, leaf = fqn.split(".")
                owner = sm.get_submodule(".".join(path)) if path else sm
                if isinstance(shared, nn.Parameter):
                    owner.register_parameter(leaf, shared)
                else:
                    owner.register_buffer(leaf, shared)
            else:
                self._local[i] = sm._lookup(fqn)
                self._full[i] = weakref.ref(full)
                self._placement[i] = pls
                self._fqn[i] = fqn


@contextlib.contextmanager
def _outside_dynamo() -> Iterator[None]:
    """Trace as if no compilation were under way: dynamo's tracing context (its fake mode and shape
    environment) would otherwise leak into fxshard's own tracing and make static sizes symbolic."""
    with torch._guards.tracing(None):
        yield


def backend(mesh: DeviceMesh, plan: Optional[Mapping[str, Any]] = None, *, inner: Any = "inductor",
            overlap: bool = False, **shard_options: Any) -> FxshardBackend:
    """A torch.compile backend that shards what TorchDynamo captures:
    ``torch.compile(model, backend=fxshard.backend(mesh, plan))``.

    ``plan`` is the plan ``fxshard.shard`` takes (FQN globs relative to the compiled module ->
    ``P(...)``/placements/ParallelStyles); ``shard_options`` are ``fxshard.shard``'s keyword
    arguments except ``example_inputs`` (``in_specs``/``out_specs`` refer to the captured graph's
    tensor inputs in the order dynamo lifts them - for a full graph, ``forward``'s tensor
    arguments - and to its flat tuple of outputs). Each rank's sharded program is compiled with
    ``inner`` (a torch.compile backend name or callable, default ``"inductor"``; ``None`` runs it
    eagerly); ``overlap=True`` reorders it with :func:`overlap`.

    Parameters - read this before training. The model keeps its full parameters; the compiled
    model computes with this rank's *local shards*, which the backend owns:

    * build the optimizer over ``b.parameters()`` (``b`` the returned backend), not
      ``model.parameters()``; compilation is lazy, so call the compiled model once first
      (``b.parameters()`` raises until a graph was compiled). Gradients land in the local shards
      (``.grad`` = this rank's slice of the single-device gradient); the model's full parameters
      get no gradient and are never updated.
    * the full parameters stay allocated on every rank (fxshard never shrinks the user's
      tensors): the backend is for compiling an existing model; to keep only shards in memory
      use ``fxshard.shard`` (and ``torch.compile`` the ShardedModule).
    * the local shards are sliced from the full parameters when a graph is first compiled; every
      later graph (recompilation, graph break, tied use) reuses the same shards.

    Graph breaks are handled: every captured graph is sharded on its own with replicated inputs
    and outputs at the graph boundaries (so the program is correct, but each break costs the
    collectives that make its values replicated); parameters shared between graphs keep one shard.
    Plan entries that match nothing in a graph are skipped for it (``b.unmatched_plan_entries()``
    lists those that never matched). Dynamic shapes are rejected with a ShardingError: compile with
    ``dynamic=False`` (a new shape is then sharded and compiled once more).

    Style constraints at module boundaries (``ColwiseParallel``'s output layout, ``SequenceParallel``,
    ``PrepareModule*``) are applied where values cross a module call's nodes in the captured graph
    (``nn_module_stack``): a module with several tensor inputs gets its positional input specs in
    the order the graph first reads those inputs; keyword-input layouts are not supported.
    """
    return FxshardBackend(mesh, plan, inner=inner, overlap=overlap, **shard_options)


# the backend ``backend="fxshard"`` resolves to, set by backend_options (a context variable: per thread
# and asyncio task, restored by ``with``)
_ACTIVE: ContextVar[Optional[FxshardBackend]] = ContextVar("fxshard_backend", default=None)


class _Options:
    """Returned by :func:`backend_options`: the active backend, usable as a context manager."""

    def __init__(self, b: FxshardBackend, token: Token) -> None:
        self.backend = b
        self._token = token

    def __enter__(self) -> FxshardBackend:
        return self.backend

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self._token)

    def __getattr__(self, name: str) -> Any:  # parameters(), modules, ... of the backend
        return getattr(self.backend, name)


def backend_options(mesh: DeviceMesh, plan: Optional[Mapping[str, Any]] = None, **options: Any) -> _Options:
    """Set the mesh, plan and options of ``torch.compile(model, backend="fxshard")``.

    Takes the arguments of :func:`backend`. Calling it sets them for this process (the setter);
    used as ``with fxshard.backend_options(mesh, plan) as b:`` they are restored on exit. Either
    way the return value gives the backend (``.parameters()`` for the optimizer, ``.modules``).
    Compilation is lazy: the options must be set when the compiled model is first *called*, not
    when ``torch.compile`` is.
    """
    _register()
    b = backend(mesh, plan, **options)
    return _Options(b, _ACTIVE.set(b))


def _named_backend(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    active = _ACTIVE.get()
    if active is None:
        raise ShardingError(
            'backend="fxshard" needs a mesh and a plan: call fxshard.backend_options(mesh, plan) before the '
            "compiled model's first call, or pass backend=fxshard.backend(mesh, plan)"
        )
    return active(gm, example_inputs, **kwargs)


def _register() -> None:
    """Make ``backend="fxshard"`` resolve without an installed entry point (the package also declares
    one, ``torch_dynamo_backends``). Done on first use so ``import fxshard`` does not import Dynamo."""
    from torch._dynamo.backends import registry

    if "fxshard" not in registry._COMPILER_FNS:
        registry.register_backend(_named_backend, name="fxshard")


# ---------------------------------------------------------------------------------------------------
# overlap: issue collectives early, wait late

def overlap(sm: Any) -> Any:
    """Reorder every program of a ShardedModule (or of the ``fxshard.backend`` modules) in place
    with :func:`reorder_for_overlap`; returns ``sm``. Results are unchanged; collective buffers live
    from issue to wait, so peak memory can grow by the in-flight collectives."""
    for prog in sm._programs():
        reorder_for_overlap(prog.gm)  # the OVERLAP pass of fxshard.pipeline, on a finished module
    return sm


def _is_compute(n: fx.Node) -> bool:
    if n.op != "call_function" or COMM_KEY in n.meta or n.target is c10d.wait_tensor.default:
        return False
    return not (is_op(n.target, OpClass.VIEW) or is_op(n.target, OpClass.SHAPE_ONLY))


def overlap_report(sm: Any) -> list[dict]:
    """Per collective of each program: where it is issued and waited (node positions) and the
    compute nodes that run in between (``overlapped``)."""
    rows = []
    for prog in sm._programs():
        nodes = list(prog.gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        for c, w in collective_groups(prog.gm.graph):
            between = [n.name for n in nodes[pos[c] + 1: pos[w]] if _is_compute(n)]
            rows.append(dict(program=prog.label, node=c.name, kind=c.meta[COMM_KEY]["kind"], issue=pos[c],
                             wait=pos[w], overlapped=between))
    return rows
