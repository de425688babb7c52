"""torch.compile integration: ``fxshard.backend`` (a TorchDynamo backend that shards the captured
graph), ``fxshard.backend_options`` (the same, for ``backend="fxshard"``), ``overlap`` and
``overlap_report``. Reading a captured graph (FQNs, module calls, its nn.Module view) is
``capture.py``; overlap scheduling is the pipeline pass ``passes/overlap.py``.

Compiling an already sharded module needs only ``INDUCTOR_OPTIONS`` from this file (to keep the overlap
schedule under inductor; ``sm.compile()`` applies them): ``torch.compile(sm)`` (any backend,
``fullgraph=True`` works) traces through ``ShardedModule.forward`` and the autograd function that runs
the sharded forward/backward programs, so each rank compiles its own program.

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
   with the inner backend (default ``"inductor"``, with ``INDUCTOR_OPTIONS``) with ``fullgraph=True``.
4. The returned callable feeds that ShardedModule the user inputs and this rank's *local*
   parameter shards; the full parameters dynamo passes in are ignored.

Overlap: fxshard's redistribute pass puts each collective directly before its wait, right before
the first consumer (buffers die early, seed 002). The pipeline's last pass (``passes/overlap.py``, in
``fxshard.passes.pipeline.DEFAULT``) then reschedules each emitted per-rank program so every collective is
issued as soon as its inputs exist and waited only when nothing independent is left to run
(``reorder_for_overlap``), where that keeps the program's modelled peak memory (within 1%);
``backend(..., overlap=False)`` keeps the redistribute order. Inductor keeps the schedule only with
``INDUCTOR_OPTIONS`` (its peak-memory reordering otherwise puts every wait back next to its collective):
the backend passes them to an inductor inner backend, and ``sm.compile()`` (``ShardedModule.compile``)
passes them to ``torch.compile``; a plain ``torch.compile(sm)`` needs ``options=dict(INDUCTOR_OPTIONS)``.
``overlap(sm)`` applies the schedule to every program of a module unconditionally; ``overlap_report(sm)``
lists, per collective, its issue and wait positions and the compute between.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar, Token
import weakref
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from .capture import Captured, View
from ..runtime.description import Sharded, sharding_of
from ..core.ir import COMM_KEY, OpClass, is_op
from ..passes.overlap import INDUCTOR_OPTIONS, collective_groups, reorder_for_overlap
from ..core.errors import ShardingError
from ..core.mesh import MeshInfo
from ..runtime.sharded_module import ShardedModule
from ..runtime.state_interop import tensor_at
from ..core.placements import to_torch
from ..core.torch_compat import guards_tracing, register_dynamo_backend

__all__ = ["backend", "backend_options", "FxshardBackend", "overlap", "overlap_report", "reorder_for_overlap",
           "INDUCTOR_OPTIONS"]

c10d = torch.ops._c10d_functional


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
                 inner: Any = "inductor", overlap: bool = True, **shard_options: Any) -> None:
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
        cap = Captured(gm, list(example_inputs))
        view = View(cap)
        plan = self._plan_for(view, cap)
        from ..plans.plan import resolve_boundaries

        bounds = resolve_boundaries(plan, view, MeshInfo.of(self.mesh))
        object.__setattr__(view, "_bounds", bounds)
        from .shard import shard

        from ..passes.pipeline import DEFAULT, OVERLAP

        options = dict(self.shard_options)
        pipeline = options.pop("pipeline", DEFAULT)
        with _outside_dynamo():
            sm = shard(view, self.mesh, plan, example_inputs=tuple(cap.inputs),
                       pipeline=pipeline.with_pass(OVERLAP) if self.overlap else _without_overlap(pipeline),
                       **options)
        self._record(sm, cap)
        self.modules.append(sm)
        if self.inner in (None, "none"):
            run = sm
        else:  # inductor keeps the overlap schedule only with INDUCTOR_OPTIONS
            extra = {"options": dict(INDUCTOR_OPTIONS)} if self.inner == "inductor" and self.overlap else {}
            run = torch.compile(sm, backend=self.inner, fullgraph=True, **extra)
        positions = [i for i, k in enumerate(cap.kinds) if k[0] == "input"]

        def sharded_graph(*args: Any) -> Any:  # dynamo passes the full parameters too: only inputs go on
            return run(*[args[i] for i in positions])

        sharded_graph.sharded_module = sm  # type: ignore[attr-defined]
        return sharded_graph

    def _plan_for(self, view: View, cap: Captured) -> dict:
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

    def _record(self, sm: ShardedModule, cap: Captured) -> None:
        """Record the local shards of the tensors ``sm`` holds that no earlier graph sharded (``shard()`` gave
        ``sm`` the earlier graphs' local shards of the others: ``sources.py``, laid out alike by ``_plan_for``)."""
        placements = sm.sharding.placements
        for fqn, full in cap.tensors.items():
            i = id(full)
            if i in self._local and self._full[i]() is full:
                continue
            self._local[i] = tensor_at(sm, fqn)
            self._full[i] = weakref.ref(full)
            self._placement[i] = placements[fqn]
            self._fqn[i] = fqn


@contextlib.contextmanager
def _outside_dynamo() -> Iterator[None]:
    """Trace as if no compilation were under way: dynamo's tracing context (its fake mode and shape
    environment) would otherwise leak into fxshard's own tracing and make static sizes symbolic."""
    with guards_tracing(None):
        yield


def _without_overlap(pipeline: Any) -> Any:
    return pipeline.without("overlap") if "overlap" in pipeline.names else pipeline


def backend(mesh: DeviceMesh, plan: Optional[Mapping[str, Any]] = None, *, inner: Any = "inductor",
            overlap: bool = True, **shard_options: Any) -> FxshardBackend:
    """A torch.compile backend that shards what TorchDynamo captures:
    ``torch.compile(model, backend=fxshard.backend(mesh, plan))``.

    ``plan`` is the plan ``fxshard.shard`` takes (FQN globs relative to the compiled module ->
    ``P(...)``/placements/ParallelStyles); ``shard_options`` are ``fxshard.shard``'s keyword
    arguments except ``example_inputs`` (``in_specs``/``out_specs`` refer to the captured graph's
    tensor inputs in the order dynamo lifts them - for a full graph, ``forward``'s tensor
    arguments - and to its flat tuple of outputs). Each rank's sharded program is compiled with
    ``inner`` (a torch.compile backend name or callable, default ``"inductor"``; ``None`` runs it
    eagerly); by default its collectives are scheduled for overlap where that keeps peak memory
    (the pipeline's ``overlap`` pass); ``overlap=False`` keeps each right before its first consumer.
    With ``inner="inductor"`` (the name) and ``overlap=True`` inductor gets ``INDUCTOR_OPTIONS``, which
    keep that schedule; a callable inner backend compiles with whatever options it applies.

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
    register_dynamo_backend(_named_backend, "fxshard")


# ---------------------------------------------------------------------------------------------------
# overlap: issue collectives early, wait late

def overlap(sm: Sharded) -> Any:
    """Reorder every program of a ShardedModule (or of the ``fxshard.backend`` modules) in place
    with :func:`reorder_for_overlap`; returns ``sm``. Results are unchanged; collective buffers live
    from issue to wait, so peak memory can grow by the in-flight collectives."""
    for prog in sharding_of(sm, "fxshard.frontends.backend.overlap").programs:
        reorder_for_overlap(prog.gm)  # the OVERLAP pass of fxshard.passes.pipeline, on a finished module
    return sm


def _is_compute(n: fx.Node) -> bool:
    if n.op != "call_function" or COMM_KEY in n.meta or n.target is c10d.wait_tensor.default:
        return False
    return not (is_op(n.target, OpClass.VIEW) or is_op(n.target, OpClass.SHAPE_ONLY))


def overlap_report(sm: Sharded) -> list[dict]:
    """Per collective of each program: where it is issued and waited (node positions) and the
    compute nodes that run in between (``overlapped``)."""
    rows = []
    for prog in sharding_of(sm, "fxshard.frontends.backend.overlap_report").programs:
        nodes = list(prog.gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        for c, w in collective_groups(prog.gm.graph):
            between = [n.name for n in nodes[pos[c] + 1: pos[w]] if _is_compute(n)]
            rows.append(dict(program=prog.label, node=c.name, kind=c.meta[COMM_KEY]["kind"], issue=pos[c],
                             wait=pos[w], overlapped=between))
    return rows
