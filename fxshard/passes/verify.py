"""The verifier: checks the facts a pipeline's passes ensure, after each pass.

Each pass of a :class:`fxshard.passes.pipeline.Pipeline` declares the facts it requires and ensures
(names below); with ``FXSHARD_VERIFY=1`` in the environment (the test suite sets it) the
pipeline calls :func:`verify` after every pass with every fact in force, and a broken fact
raises a ShardingError naming the pass and the node. The facts:

* ``traced``: every placeholder carries ``meta["val"]`` (a fake tensor of global shape);
* ``global``: no collective fxshard inserted in the graph yet (shapes and values are global; the
  model's own collectives, allowed under ``no_grad``, run as written);
* ``specs``: every tensor-valued node fxshard did not insert has a Spec of its traced global shape
  (a tuple of them for multi-output ops), all over the same number of mesh axes;
* ``arrive``: every inserted collective carries its reason (``COMM_KEY``) and is read by exactly
  one ``wait_tensor``; every inserted ``wait_tensor`` waits on a collective; every op reads each input in the
  layout its strategy requires (``IN_KEY``) on this rank, or a lowering replaced the input;
* ``local``: shape arguments hold this rank's sizes (checked by running, not here);
* ``clean``: the graph lints;
* ``scheduled``: collectives issue early and wait late (the ``arrive`` check covers the dataflow).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Sequence

import torch
import torch.fx as fx

from ..comm.collectives import all_reduce_into_input
from ..core.context import ShardContext
from ..core.errors import ShardingError
from ..core.ir import COMM_KEY, IN_KEY, INSERTED_KEY, META_KEY, sharding
from ..core.placements import Part, R
from ..rules.registry import tensor_inputs
from ..core.spec import Spec
from ..core.symbolic import sym_shape

__all__ = ["verify", "enabled", "FACTS", "COLLECTIVES"]

c10d = torch.ops._c10d_functional
COLLECTIVES = frozenset({
    c10d.all_reduce.default, all_reduce_into_input, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
    c10d.all_to_all_single.default, c10d.broadcast.default,
})


def enabled() -> bool:
    """Whether ``FXSHARD_VERIFY`` asks for the verifier (any value but empty/0)."""
    return os.environ.get("FXSHARD_VERIFY", "") not in ("", "0")


class _Broken(Exception):
    pass


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise _Broken(msg)


def _same_local(have: tuple, want: tuple, coords: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether a value laid out as ``have`` is, on this rank, already laid out as ``want``: equal, on an
    axis of one rank (where every layout is the whole value), or replicated where a max/min Partial (or a
    sum Partial on coordinate 0, the others hold zeros) is wanted."""
    return all(h == w or k == 1 or (h == R and isinstance(w, Part) and (w.op != "sum" or c == 0))
               for h, w, c, k in zip(have, want, coords, sizes))


def _traced(gm: fx.GraphModule, ctx: ShardContext, facts: set[str]) -> None:
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            _need("val" in n.meta, f"placeholder {n.name} has no meta['val']")


def _inserted_collective(n: fx.Node) -> bool:
    """A collective fxshard put there (the model's own collectives, under no_grad, run as written)."""
    return n.target in COLLECTIVES and bool(n.meta.get(INSERTED_KEY) or COMM_KEY in n.meta)


def _global(gm: fx.GraphModule, ctx: ShardContext, facts: set[str]) -> None:
    for n in gm.graph.nodes:
        _need(not _inserted_collective(n), f"{n.name} is an inserted collective in a global program")


def _specs(gm: fx.GraphModule, ctx: ShardContext, facts: set[str]) -> None:
    k = len(ctx.mesh.sizes)
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "call_function") or n.meta.get(INSERTED_KEY):
            continue
        val, spec = n.meta.get("val"), n.meta.get(META_KEY)
        if isinstance(val, torch.Tensor):
            _need(isinstance(spec, Spec), f"{n.name} has no spec")
            _need(tuple(spec.shape) == sym_shape(val), f"{n.name}: spec shape {spec.shape} != {sym_shape(val)}")
            _need(len(spec.placements) == k, f"{n.name}: {spec} does not have one placement per mesh axis ({k})")
        elif isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val):
            _need(isinstance(spec, tuple) and len(spec) == len(val), f"{n.name} has no specs")
            for v, s in zip(val, spec):
                _need(isinstance(s, Spec) == isinstance(v, torch.Tensor), f"{n.name}: specs {spec}")


def _arrive(gm: fx.GraphModule, ctx: ShardContext, facts: set[str]) -> None:
    coords = ctx.mesh.coords
    for n in gm.graph.nodes:
        if _inserted_collective(n):
            _need(COMM_KEY in n.meta and bool(n.meta[COMM_KEY].get("consumer")), f"{n.name} has no reason")
            users = list(n.users)
            _need(len(users) == 1 and users[0].target is c10d.wait_tensor.default, f"{n.name} has users {users}")
        if n.target is c10d.wait_tensor.default and n.meta.get(INSERTED_KEY):
            _need(n.args[0].target in COLLECTIVES, f"{n.name} waits on {n.args[0]}")
        req = n.meta.get(IN_KEY)
        if req is None or n.op == "placeholder":  # a split program's saved value keeps its producer's meta
            continue
        ins = tensor_inputs(n)
        lowered = bool(sharding(n).lowerings)
        if len(ins) != len(req):
            _need(lowered and "local" in facts, f"{n.name}: {len(ins)} tensor inputs but {len(req)} requirements")
        for i, (inp, want) in enumerate(zip(ins, req)):
            spec = inp.meta.get(META_KEY)
            # a saved value fxshard inserted (a layout copy) is local already and carries no spec
            if isinstance(spec, Spec) and (inp.op == "placeholder" or len(ins) == len(req)):
                _need(_same_local(spec.placements, tuple(want), coords, ctx.mesh.sizes),
                      f"{n.name} reads input {i} {inp.name} laid out {spec} but needs {want}")


def _clean(gm: fx.GraphModule, ctx: ShardContext, facts: set[str]) -> None:
    try:
        gm.graph.lint()
    except Exception as e:  # noqa: BLE001 - lint's own message says what is wrong
        raise _Broken(f"the graph does not lint: {e}") from None


def _nothing(gm: fx.GraphModule, ctx: ShardContext, facts: set[str]) -> None:
    return None


FACTS: dict[str, Callable[[fx.GraphModule, ShardContext, set[str]], None]] = {
    "traced": _traced, "global": _global, "specs": _specs, "arrive": _arrive, "local": _nothing,
    "clean": _clean, "scheduled": _nothing,
}


def verify(gm: fx.GraphModule, ctx: ShardContext, facts: Iterable[str], after: str) -> None:
    """Check every fact in ``facts`` on ``gm``; raise a ShardingError naming the pass ``after`` which ran last.

    Requires fact names from ``FACTS``; ensures nothing is changed.
    """
    held = set(facts)
    for fact in sorted(held):
        try:
            FACTS[fact](gm, ctx, held)
        except _Broken as e:
            raise ShardingError(f"internal: after pass {after!r} ({ctx.label} program) the fact {fact!r} does "
                                f"not hold: {e}; please report this model") from None
