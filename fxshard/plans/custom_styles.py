"""ParallelStyles that are not torch's own (e.g. torchtitan's ``NoParallel``): read by applying them.

``parallelize_module`` calls ``style._apply(module, device_mesh)``, which turns parameters into DTensors
and registers forward pre/post hooks that lay out the module's inputs and outputs. fxshard does the same to
a copy of the module whose parameters and buffers are on the meta device (no memory, no communication: DTensor
ops on meta tensors move nothing) and reads back what the style produced:

* each parameter/buffer the style made a DTensor: its placement on the style's mesh axis (``Shard(d)`` or
  ``Replicate()``), as a ``ColwiseParallel`` entry places its weight;
* each positional input the new pre-hooks turn into a DTensor (or into a local tensor through
  ``DTensor.to_local``, whose autograd record keeps the layout): the layout the module computes with, as
  ``desired_input_layouts``;
* what the new post-hooks make of an output: the layout the output leaves with, as ``output_layouts``.

The hooks are called on meta tensors of two ranks (3 and 4 dims) so that a ``Shard(-1)`` is told from a
``Shard(2)``. Anything else (a hook that fails on such inputs, a value it returns that is neither the probe
nor a DTensor's layout, a ``Partial`` layout, a DTensor on another mesh) is a ShardingError naming the style.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..core.errors import ShardingError
from ..core.mesh import MeshInfo
from .styles import AxisSpec, Boundary
from ..core.torch_compat import resolve_process_group

__all__ = ["StyleReading", "read_style"]

_RANKS = (3, 4)  # the probe tensors' numbers of dims (two, to tell Shard(-1) from Shard(2))
_ADVICE = ("fxshard reads a ParallelStyle of another library by applying it to a meta copy of the module and "
           "calling the hooks it registers on meta tensors; write this entry with torch's styles instead "
           "(ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput/Output/InputOutput), or give "
           "the parameters' layouts as P(...) specs and the activations' with fxshard.constrain")


@dataclass
class StyleReading:
    """What a style does to one module: the placement on its mesh axis of each parameter/buffer it
    distributed (by name relative to the module), and the constraints at the module's boundary."""

    params: dict[str, Placement]
    boundary: Boundary


def _fail(key: str, style: Any, fqn: str, what: str) -> ShardingError:
    return ShardingError(f"plan entry {key!r}: fxshard cannot read what {type(style).__qualname__} does to "
                         f"{fqn!r}: {what}; {_ADVICE}")


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors of the same shapes (the
    originals are not copied)."""
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _axis_mesh(info: MeshInfo, axis: int) -> DeviceMesh:
    """The 1-D DeviceMesh of mesh axis ``axis`` (what ``parallelize_module`` is given for a TP style)."""
    return DeviceMesh.from_group(resolve_process_group(info.group_names[axis]), info.device_type,
                                 mesh_dim_names=(info.names[axis],))


def _arities(module: nn.Module) -> list[int]:
    """Numbers of positional inputs to probe ``module``'s input hooks with: its forward's required positional
    parameters, then all of them."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return [1]
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in pos)
    return sorted({max(required, 1), max(len(pos), 1)})


def _layout(value: Any, probe: Any, mesh: DeviceMesh) -> tuple[bool, Optional[Placement]]:
    """(readable, placement) of a value a hook returned for ``probe``: None when it left the probe alone."""
    if value is probe:
        return True, None
    if isinstance(value, DTensor):
        return (value.device_mesh == mesh and len(value.placements) == 1), value.placements[0]
    spec = getattr(getattr(value, "grad_fn", None), "dtensor_spec", None)  # DTensor.to_local()'s record
    if isinstance(value, torch.Tensor) and spec is not None:
        return (spec.mesh == mesh and len(spec.placements) == 1), spec.placements[0]
    return False, None


def _call_hooks(mod: nn.Module, pre: list, post: list, args: tuple, out: Any) -> tuple[tuple, Any]:
    """Run the given forward pre-hooks on ``args`` and post-hooks on ``out``, as ``nn.Module.__call__`` would."""
    kwargs: dict[str, Any] = {}
    for hid, hook in pre:
        if hid in mod._forward_pre_hooks_with_kwargs:
            res = hook(mod, args, kwargs)
            if res is not None:
                args, kwargs = res
        else:
            res = hook(mod, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
    for hid, hook in post:
        res = hook(mod, args, kwargs, out) if hid in mod._forward_hooks_with_kwargs else hook(mod, args, out)
        if res is not None:
            out = res
    return args, out


def _probe(mod: nn.Module, pre: list, post: list, mesh: DeviceMesh, n_args: int, ndim: int, key: str,
           style: Any, fqn: str) -> tuple[list[Optional[Placement]], Optional[Placement]]:
    """The layouts the hooks give ``n_args`` positional inputs and one output of ``ndim`` dims."""
    size = 2 * mesh.size()
    probes = tuple(torch.empty((size,) * ndim, device="meta", requires_grad=True) for _ in range(n_args))
    out_probe = DTensor.from_local(torch.empty((size,) * ndim, device="meta", requires_grad=True), mesh,
                                   [Replicate()], run_check=False)
    args, out = _call_hooks(mod, pre, post, probes, out_probe)
    if len(args) != n_args:
        raise _fail(key, style, fqn, f"its input hook turned {n_args} inputs into {len(args)}")
    ins: list[Optional[Placement]] = []
    for i, (a, p) in enumerate(zip(args, probes)):
        ok, pl = _layout(a, p, mesh)
        if not ok:
            raise _fail(key, style, fqn, f"its input hook returned {type(a).__name__} for input {i}, not a DTensor "
                                         f"on the mesh axis it was given or the input itself")
        ins.append(pl)
    ok, pl_out = _layout(out, out_probe, mesh)
    if not ok:
        raise _fail(key, style, fqn, f"its output hook returned {type(out).__name__}, not a DTensor on the mesh "
                                     f"axis it was given or a local tensor of one")
    return ins, (None if out is out_probe else pl_out)


def _merge(a: Optional[Placement], b: Optional[Placement], key: str, style: Any, fqn: str,
           what: str) -> Optional[Placement]:
    """One layout from the readings at ``_RANKS`` dims (a Shard counted from the end is given negative)."""
    if a is None and b is None:
        return None
    if isinstance(a, Replicate) and isinstance(b, Replicate):
        return Replicate()
    if isinstance(a, Shard) and isinstance(b, Shard):
        if a.dim == b.dim:
            return Shard(a.dim)
        if b.dim - a.dim == _RANKS[1] - _RANKS[0]:
            return Shard(a.dim - _RANKS[0])
    raise _fail(key, style, fqn, f"it lays out {what} as {a} at {_RANKS[0]} dims and {b} at {_RANKS[1]} "
                                 f"(fxshard takes Shard(d) and Replicate() for a module's inputs and outputs)")


def read_style(style: Any, module: nn.Module, info: MeshInfo, axis: int, key: str, fqn: str) -> StyleReading:
    """Requires: ``style`` a ParallelStyle, ``module`` the submodule at ``fqn`` the plan entry ``key``
    applies it to, ``axis`` its mesh axis. Ensures: what ``style._apply`` does to a meta copy of ``module``
    on the 1-D mesh of ``axis`` (module doc), or a ShardingError naming the style and what to write instead.
    Collective-free; every rank reads the same."""
    mesh = _axis_mesh(info, axis)
    mod = _meta_copy(module)
    pre_before, post_before = set(mod._forward_pre_hooks), set(mod._forward_hooks)
    try:
        got = style._apply(mod, mesh)
    except ShardingError:
        raise
    except Exception as e:  # the style's own check (module type, arguments): say which
        raise _fail(key, style, fqn, f"{type(style).__qualname__}._apply raised {type(e).__name__}: {e}") from e
    mod = got if isinstance(got, nn.Module) else mod
    params: dict[str, Placement] = {}
    for name, t in list(mod.named_parameters()) + list(mod.named_buffers()):
        if not isinstance(t, DTensor):
            continue
        if t.device_mesh != mesh or len(t.placements) != 1 or not isinstance(t.placements[0], (Shard, Replicate)):
            raise _fail(key, style, fqn, f"it made {name!r} a DTensor placed {t.placements} on {t.device_mesh}; "
                                         f"fxshard takes Shard(d) or Replicate() on the mesh axis it gives the style")
        params[name] = t.placements[0]
    pre = [(h, f) for h, f in mod._forward_pre_hooks.items() if h not in pre_before]
    post = [(h, f) for h, f in mod._forward_hooks.items() if h not in post_before]
    if not pre and not post:
        return StyleReading(params, Boundary())
    readings, errors = None, []
    for n in _arities(module):
        try:
            readings = [_probe(mod, pre, post, mesh, n, d, key, style, fqn) for d in _RANKS]
            break
        except ShardingError:
            raise
        except Exception as e:  # the hooks refused this many inputs: try the next count
            errors.append(f"with {n} positional input(s): {type(e).__name__}: {e}")
    if readings is None:
        raise _fail(key, style, fqn, "its hooks failed on meta tensors " + "; ".join(errors))
    (ins_a, out_a), (ins_b, out_b) = readings
    inputs = [_merge(a, b, key, style, fqn, f"input {i}") for i, (a, b) in enumerate(zip(ins_a, ins_b))]
    out = _merge(out_a, out_b, key, style, fqn, "the output")
    to_spec = lambda p: None if p is None else AxisSpec(axis, p)  # noqa: E731
    while inputs and inputs[-1] is None:
        inputs.pop()
    return StyleReading(params, Boundary([to_spec(p) for p in inputs], {}, [to_spec(out)] if out else []))
