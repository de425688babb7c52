"""Plans: FQN globs mapped to PartitionSpecs, placements or ParallelStyles.

``resolve_plan`` turns a user plan into per-parameter/buffer placements,
checking every entry before any tracing work: a glob that matches nothing, an
unknown mesh axis, a spec longer than the tensor's rank, a shard dim out of
range, a style on a module it does not support, and conflicting entries are
all ShardingErrors naming the entry. A style on a module whose weight or bias is computed by
``torch.nn.utils.parametrize`` (weight norm, spectral norm, orthogonal) pins the computed tensor's
layout at the parametrization's output instead of placing a parameter. A ParallelStyle that is not one of
torch's (e.g. torchtitan's ``NoParallel``) is read by applying it to a meta copy (``custom_styles.py``).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Optional, Sequence

import torch.nn as nn
from torch.distributed.tensor import Placement, Shard
from torch.nn.utils.parametrize import is_parametrized
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from .custom_styles import read_style
from ..core.errors import ShardingError
from ..core.spec import split_ok
from ..core.symbolic import is_concrete
from ..core.mesh import MeshInfo
from ..core.placements import P, Part, Pl, R, Replicated, S, from_torch
from .styles import AxisSpec, Boundary, boundary_of, reads_as_torch_style

__all__ = ["resolve_plan", "resolve_boundaries", "to_placements", "is_spec_leaf", "style_axis", "constraint_placements", "check_divisible"]


def is_spec_leaf(x: Any) -> bool:
    """True for anything that describes one tensor's layout (P, a placement, a tuple of placements)."""
    if isinstance(x, (P, Placement, Replicated, S, Part)):
        return True
    return isinstance(x, (tuple, list)) and len(x) > 0 and all(isinstance(p, (Placement, Replicated, S, Part)) for p in x)


def to_placements(spec: Any, mesh: MeshInfo, ndim: int, what: str) -> tuple[Pl, ...]:
    """Per-mesh-axis placements for one tensor of rank ``ndim`` described by ``spec``.

    Accepts None (replicated), a ``P(...)``, one placement (1-D meshes), or one
    placement per mesh axis. ``what`` names the tensor/entry in errors.
    """
    k = len(mesh.sizes)
    if spec is None:
        return (R,) * k
    if isinstance(spec, P):
        return spec.to_placements(mesh.names, ndim, what)
    if isinstance(spec, (Placement, Replicated, S, Part)):
        if k != 1:
            raise ShardingError(
                f"{what}: a single placement {spec!r} is ambiguous on the {k}-D mesh {mesh.names}; give one "
                f"placement per mesh axis, e.g. (Replicate(), Shard(0)), or a P(...) naming the axes"
            )
        spec = (spec,)
    if isinstance(spec, (tuple, list)):
        if len(spec) != k:
            raise ShardingError(
                f"{what}: {len(spec)} placements given for a mesh with {k} axes {mesh.names}; give exactly one "
                f"placement per mesh axis"
            )
        out = []
        for p in spec:
            q = from_torch(p, ndim)
            if isinstance(q, S) and not 0 <= q.dim < ndim:
                raise ShardingError(
                    f"{what}: {p!r} names dim {getattr(p, 'dim', q.dim)} but the tensor has {ndim} dims; "
                    f"use a dim in [-{ndim}, {ndim - 1}]"
                )
            out.append(q)
        kinds = sorted({q.op for q in out if isinstance(q, Part)})
        if len(kinds) > 1:
            raise ShardingError(
                f"{what}: {spec!r} mixes partial reductions ({', '.join(kinds)}) over different mesh axes; their "
                f"order would decide the value (max of sums is not sum of maxes), so fxshard does not take them: "
                f"reduce one of them first (e.g. all-reduce the value over one axis before passing it) or use one "
                f"kind of Partial on every axis"
            )
        return tuple(out)
    raise ShardingError(
        f"{what}: {spec!r} is not a sharding spec; use P('tp', None), Shard(0), Replicate() or a ParallelStyle"
    )


def constraint_placements(spec: Any, mesh: MeshInfo, ndim: int, what: str) -> tuple[Optional[Pl], ...]:
    """Placements a constraint asks for; ``None`` marks a mesh axis it leaves free."""
    if isinstance(spec, AxisSpec):
        pls: list[Optional[Pl]] = [None] * len(mesh.sizes)
        p = from_torch(spec.placement, ndim)
        if isinstance(p, S) and not 0 <= p.dim < ndim:
            raise ShardingError(f"{what}: {spec.placement!r} names a dim the {ndim}-dim tensor does not have")
        pls[spec.axis] = p
        return tuple(pls)
    if isinstance(spec, (tuple, list)) and not isinstance(spec, P) and any(p is None for p in spec):
        if len(spec) != len(mesh.sizes):
            raise ShardingError(f"{what}: {len(spec)} placements given for a mesh with {len(mesh.sizes)} axes")
        return tuple(None if p is None else from_torch(p, ndim) for p in spec)
    return to_placements(spec, mesh, ndim, what)


def style_axis(style: Any, mesh: MeshInfo, key: str) -> int:
    """The mesh axis a ParallelStyle acts on: its ``mesh_axis`` if set, else ``tp``, else the only axis."""
    name = getattr(style, "mesh_axis", None)
    if name is not None:
        if name not in mesh.names:
            raise ShardingError(f"plan entry {key!r}: mesh axis {name!r} is not one of {mesh.names}")
        return mesh.names.index(name)
    if "tp" in mesh.names:
        return mesh.names.index("tp")
    if len(mesh.names) == 1:
        return 0
    raise ShardingError(
        f"plan entry {key!r}: {type(style).__name__} acts on the mesh axis named 'tp', but the mesh axes are "
        f"{mesh.names}; name one axis 'tp' or give the style mesh_axis=..."
    )


def _style_param_dims(style: Any, module: nn.Module, key: str, fqn: str) -> dict[str, Optional[int]]:
    """Which dim of each parameter of ``module`` a Colwise/Rowwise style splits (None: replicated)."""
    col = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        return {"weight": 0, "bias": 0} if col else {"weight": 1, "bias": None}
    if isinstance(module, nn.Embedding):
        return {"weight": 1} if col else {"weight": 0}
    raise ShardingError(
        f"plan entry {key!r}: {type(style).__name__} supports nn.Linear and nn.Embedding, but {fqn!r} is "
        f"{type(module).__name__}; shard its parameters with P(...) specs instead"
    )


def resolve_plan(plan: Optional[Mapping[str, Any]], model: nn.Module, mesh: MeshInfo) -> dict[str, tuple[Pl, ...]]:
    """FQN of each planned parameter/buffer -> its placements (see module doc)."""
    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise ShardingError(
            f"plan must be a dict of FQN globs to specs or styles (or 'hf' for a transformers model's own "
            f"plan), got {plan!r}; e.g. {{'net1': ColwiseParallel(), 'head.weight': P('tp', None)}}"
        )
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    modules = dict(model.named_modules(remove_duplicate=False))
    out: dict[str, tuple[Pl, ...]] = {}
    origin: dict[str, str] = {}

    def assign(fqn: str, pls: tuple[Pl, ...], key: str) -> None:
        if fqn in out and out[fqn] != pls:
            raise ShardingError(
                f"plan entries {origin[fqn]!r} and {key!r} both place {fqn!r}, differently ({out[fqn]} vs {pls}); "
                f"make the globs disjoint"
            )
        check_divisible(fqn, tuple(tensors[fqn].shape), pls, mesh)
        out[fqn] = pls
        origin[fqn] = key

    for key, spec in plan.items():
        if not isinstance(key, str):
            raise ShardingError(f"plan key {key!r} is not a string; keys are FQN globs like 'layers.*.wq'")
        if isinstance(spec, ParallelStyle):
            axis = style_axis(spec, mesh, key)
            for fqn in _style_hits(key, spec, modules, model):
                if not reads_as_torch_style(spec):  # another library's style: what it does to a meta copy
                    for pname, placement in read_style(spec, modules[fqn], mesh, axis, key, fqn).params.items():
                        name = f"{fqn}.{pname}" if fqn else pname
                        if name not in tensors:
                            raise ShardingError(
                                f"plan entry {key!r}: {type(spec).__qualname__} gives {fqn!r} a tensor {pname!r} "
                                f"the module does not have; fxshard places the model's own tensors only: create "
                                f"it in the model, or write this entry with torch's styles or P(...) specs")
                        pls = [R] * len(mesh.sizes)
                        pls[axis] = from_torch(placement, tensors[name].dim())
                        assign(name, tuple(pls), key)
                    continue
                if not isinstance(spec, (ColwiseParallel, RowwiseParallel)):
                    continue  # SequenceParallel and Prepare* keep parameters replicated
                for pname, dim in _style_param_dims(spec, modules[fqn], key, fqn).items():
                    if is_parametrized(modules[fqn], pname):
                        continue  # its computed value is constrained instead (resolve_boundaries)
                    t = getattr(modules[fqn], pname, None)
                    if t is None:
                        continue
                    pls = [R] * len(mesh.sizes)
                    if dim is not None:
                        pls[axis] = S(dim)
                    assign(f"{fqn}.{pname}", tuple(pls), key)
            continue
        hits = [t for t in tensors if fnmatch.fnmatchcase(t, key)]
        if not hits:
            hint = ""
            if any(fnmatch.fnmatchcase(m, key) for m in modules if m):
                hint = f" (it names a module: use '{key}.weight' for its weight, or a ParallelStyle)"
            raise ShardingError(
                f"plan entry {key!r} matches no parameter or buffer of {type(model).__name__}{hint}; "
                f"names look like {_examples(tensors)}"
            )
        for fqn in hits:
            assign(fqn, to_placements(spec, mesh, tensors[fqn].dim(), f"plan entry {key!r} ({fqn})"), key)
    return out


def _style_hits(key: str, style: Any, modules: Mapping[str, nn.Module], model: nn.Module) -> list[str]:
    hits = [m for m in modules if fnmatch.fnmatchcase(m, key)]
    if not hits:
        raise ShardingError(
            f"plan entry {key!r} ({type(style).__name__}) matches no submodule of {type(model).__name__}; "
            f"module names look like {_examples(modules)}"
        )
    return hits


def resolve_boundaries(plan: Optional[Mapping[str, Any]], model: nn.Module, mesh: MeshInfo) -> dict[str, list[Boundary]]:
    """Module FQN -> the input/output constraints its styles impose (in plan order)."""
    out: dict[str, list[Boundary]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for key, spec in (plan or {}).items():
        if isinstance(spec, ParallelStyle):
            axis = style_axis(spec, mesh, key)
            for fqn in _style_hits(key, spec, modules, model):
                if not reads_as_torch_style(spec):
                    out.setdefault(fqn, []).append(read_style(spec, modules[fqn], mesh, axis, key, fqn).boundary)
                    continue
                out.setdefault(fqn, []).append(boundary_of(spec, modules[fqn], axis, key))
                if not isinstance(spec, (ColwiseParallel, RowwiseParallel)):
                    continue
                for pname, dim in _style_param_dims(spec, modules[fqn], key, fqn).items():
                    if dim is not None and is_parametrized(modules[fqn], pname):
                        # torch.nn.utils.parametrize computes the tensor from other parameters in forward:
                        # the style's layout is pinned on that value, the parameters are the plan's (or R)
                        out.setdefault(f"{fqn}.parametrizations.{pname}", []).append(
                            Boundary([], {}, [AxisSpec(axis, Shard(dim))]))
    return out


def check_divisible(name: str, shape: Sequence, pls: Sequence[Pl], mesh: MeshInfo, uneven: bool = True,
                    even_why: str = "") -> None:
    """Raise a ShardingError naming ``name`` when ``pls`` cannot split ``shape`` on ``mesh``.

    With ``uneven``, a dim split over one mesh axis may be cut unevenly (``torch.chunk`` pieces; see
    ``spec.can_split``); a dim split over several axes, a strided split, or a symbolic size must
    divide evenly. Without it every split must divide, and ``even_why`` says why in the message.
    """
    for d, size in enumerate(shape):
        axes = [a for a, p in enumerate(pls) if isinstance(p, S) and p.dim == d and mesh.sizes[a] > 1]
        f = 1
        for a in axes:
            f *= mesh.sizes[a]
        outer = max([pls[a].outer for a in axes], default=1)
        shared = outer > 1 and len(axes) > 1  # legal inside a program ([B*H] merges), not as a user's layout
        if f == 1 or (not shared and split_ok((size,), [S(0, pls[a].outer) for a in axes],
                                              [mesh.sizes[a] for a in axes], uneven=uneven)):
            continue
        names = " x ".join(f"'{mesh.names[a]}' ({mesh.sizes[a]})" for a in axes)
        if shared:
            why = f"a packed dim ({outer} blocks) is split over one mesh axis only"
        elif outer > 1:
            why = f"each of its {outer} packed blocks must split evenly ({outer} x {f} must divide {size})"
        elif not uneven:
            why = even_why or "this split must divide evenly"
        elif len(axes) > 1:
            why = "a dim split over several mesh axes must divide evenly"
        elif not is_concrete(size):
            why = "a symbolic size must provably divide (declare the dynamic dim as a multiple, e.g. 2*Dim('b'))"
        else:
            why = f"an uneven split needs at least one element on each of the {f} ranks"
        raise ShardingError(
            f"{name} dim {d} (size {size}) cannot be split over mesh axis {names}: {why}; "
            f"use a mesh whose split divides {size} or leave dim {d} unsplit"
        )


def _examples(names: Mapping[str, Any]) -> str:
    shown = [n for n in names if n][:4]
    return ", ".join(repr(n) for n in shown) + (", ..." if len(names) > 4 else "")
