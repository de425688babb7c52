"""Call-time checks of a ShardedModule's local inputs against the shapes it was sharded for.

The sharded programs bake in every static size and the divisibility facts the
plan relied on, so an input of another size must be stopped before it runs:
otherwise it fails deep inside with an unreadable shape error, or, worse, runs.
Static dims must match exactly (this rank's ``torch.chunk`` piece when split), and
so must dtypes (the program's ops were traced for them) and the device type (meta
tensors hold no data). For the same reason a call under another autocast state than the one traced raises
(``core/precision.py``; ``fxshard.jit`` refuses autocast, ``frontends/jit.py``).
A dynamic dim (``dynamic_shapes``) may take any size that satisfies its
declaration, e.g. ``2*Dim('seq')`` needs an even global size, within its
``min``/``max``, and equal wherever the same symbol appears.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import sympy
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..comm.failures import guard_collective
from ..core.errors import ShardingError
from ..core.mesh import MeshInfo
from ..core.placements import Pl
from ..comm.replicas import check_replicas
from .sources import SHARED
from ..core.spec import local_shape, shard_factor
from ..core.symbolic import Dim, is_concrete, sym_shape

__all__ = ["InputCheck", "check_replicated_values"]


@dataclass(frozen=True)
class _DimRule:
    """Input ``index`` dim ``dim``: global size ``size`` (int or sympy), split ``factor`` ways."""

    index: int
    dim: int
    size: Dim
    factor: int
    local: Dim  # this rank's expected size (static dims)
    linear: Optional[tuple[sympy.Symbol, int, int]]  # size == a*sym + b


class InputCheck:
    """Built once at ``shard()`` from the traced input placeholders; ``check(tensors)`` on every call."""

    def __init__(self, indices: Sequence[int], vals: Sequence[Any], placements: Sequence[Sequence[Pl]],
                 info: MeshInfo, ranges: Optional[dict] = None):
        self._indices = list(indices)  # user input numbers, for messages
        self._device_type = info.device_type
        self._dtypes = [val.dtype if isinstance(val, torch.Tensor) else None for val in vals]
        self._ndims: list[int] = []
        self._rules: list[_DimRule] = []
        self._ranges = dict(ranges or {})
        self._placements = [tuple(p) for p in placements]
        self._values_checked = False
        for i, (val, pls) in enumerate(zip(vals, placements)):
            shape = sym_shape(val) if isinstance(val, torch.Tensor) else ()
            self._ndims.append(len(shape))
            local = local_shape(shape, pls, info.sizes, info.coords)
            for d, size in enumerate(shape):
                self._rules.append(_DimRule(i, d, size, shard_factor(pls, info.sizes, d), local[d], _linear(size)))

    @staticmethod
    def from_placeholders(indices: Sequence[int], vals: Sequence[Any], placements: Sequence[Sequence[Pl]],
                          info: MeshInfo) -> "InputCheck":
        """Like the constructor, reading symbol ranges from the fake tensors' ShapeEnv when there is one."""
        ranges: dict = {}
        for v in vals:
            env = getattr(getattr(v, "fake_mode", None), "shape_env", None)
            if env is not None:
                for sym, vr in env.var_to_range.items():
                    ranges[sym] = (vr.lower, vr.upper)
                break
        return InputCheck(indices, vals, placements, info, ranges)

    def check(self, tensors: Sequence[Any], mesh: Optional[DeviceMesh] = None) -> None:
        """Raise a ShardingError naming the input, dim and declaration that ``tensors`` (one per
        index given at construction, in that order) violate. With ``mesh`` (the module's) and dynamic
        dims, every rank of it must call this (one small all-reduce per mesh dim): the ranks' values of
        each dynamic size must agree, since one program runs on all of them (a rank given a piece of
        another size would compute, or exchange, with a size its peers do not have)."""
        for i, x, nd, dtype in zip(self._indices, tensors, self._ndims, self._dtypes):
            if not isinstance(x, torch.Tensor):
                continue
            if x.device.type == "meta":
                raise ShardingError(
                    f"input {i} is a meta tensor: it has a shape but no data, so the sharded program cannot run "
                    f"on it; pass real tensors on {self._device_type} (meta tensors are fine as example_inputs "
                    f"for shard())"
                )
            if x.device.type != self._device_type:
                raise ShardingError(f"input {i} is on {x.device}, but the sharded module runs on "
                                    f"{self._device_type} (the mesh's device type); move it there first")
            if dtype is not None and x.dtype != dtype:
                raise ShardingError(
                    f"input {i} has dtype {x.dtype}, but the module was sharded for {dtype} (the example input's "
                    f"dtype) and its program was traced for it; cast the input (x.to({dtype})) or shard with an "
                    f"example input of dtype {x.dtype}"
                )
            if x.dim() != nd:
                raise ShardingError(f"input {i} has {x.dim()} dims but the module was sharded for {nd}; pass "
                                    f"inputs shaped like example_inputs")
        bound: dict = {}
        for r in self._rules:
            n = int(tensors[r.index].shape[r.dim])
            what = f"input {self._indices[r.index]} dim {r.dim}"
            if is_concrete(r.size):
                if n != int(r.local):
                    split = (f" ({int(r.size)} split {r.factor} ways: this rank holds {int(r.local)})"
                             if r.factor > 1 else "")
                    if r.factor > 1 and n == int(r.size):
                        raise ShardingError(
                            f"{what} has size {n}, the GLOBAL size the module was sharded for{split}: a "
                            f"ShardedModule takes this rank's local piece (x.chunk({r.factor}, {r.dim})[i] for "
                            f"its coordinate i). If the example_inputs given to shard() were already local "
                            f"pieces, shard with the global ones instead: example_inputs always have global "
                            f"shapes (meta tensors work), calls take local pieces"
                        )
                    raise ShardingError(
                        f"{what} has local size {n}, but the module was sharded for global size "
                        f"{int(r.size)}{split}; pass that size, or declare the dim dynamic with "
                        f"dynamic_shapes when sharding, or shard the model again with an example input of this "
                        f"size ({SHARED})"
                    )
                continue
            glob = n * r.factor
            if r.linear is None:
                continue
            sym, a, b = r.linear
            if (glob - b) % a:
                raise ShardingError(
                    f"{what} has global size {glob}, but it was declared as {r.size}: "
                    f"{glob} is not of that form, which the sharding relies on (e.g. to split it evenly); "
                    f"pass a size of the form {r.size}"
                )
            v = (glob - b) // a
            lo, hi = self._ranges.get(sym, (None, None))
            if (lo is not None and _finite(lo) and v < int(lo)) or (hi is not None and _finite(hi) and v > int(hi)):
                floor = (" (torch.export treats sizes 0 and 1 as special, so a dynamic size starts at 2 "
                         "even if its Dim says min=1)") if v < 2 and lo is not None and _finite(lo) and int(lo) == 2 else ""
                raise ShardingError(
                    f"{what} has global size {glob} ({sym} = {v}), outside the declared "
                    f"range {sym} in [{lo}, {hi}]{floor}; pass a size in range or widen the Dim's min/max"
                )
            if bound.setdefault(sym, (v, r))[0] != v:
                first = bound[sym][1]
                raise ShardingError(
                    f"{what} gives {sym} = {v}, but input {self._indices[first.index]} dim {first.dim} gave "
                    f"{sym} = {bound[sym][0]}; dims declared with the same Dim must agree"
                )
        if bound and mesh is not None:
            torch.compiler.disable(self._agree)(bound, mesh)  # here, not at import: it imports TorchDynamo
        # not inside a TorchDynamo trace: the check's collectives and data-dependent raise would break its graph
        if not self._values_checked and mesh is not None and not torch.compiler.is_compiling():
            check_replicated_values(tensors, self._placements, [f"input {i}" for i in self._indices], mesh)
            self._values_checked = True

    def _agree(self, bound: dict, mesh: DeviceMesh) -> None:
        syms = sorted(bound, key=str)
        values = [bound[s][0] for s in syms]
        t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=self._device_type)
        for d in range(mesh.ndim):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
        for k, (sym, v) in enumerate(zip(syms, values)):
            hi, lo = int(t[k]), -int(t[len(syms) + k])
            if hi != lo:
                r = bound[sym][1]
                raise ShardingError(
                    f"input {self._indices[r.index]} dim {r.dim} gives {sym} = {v} on this rank, but the ranks "
                    f"of the mesh disagree ({sym} from {lo} to {hi}): one program runs on every rank, so each "
                    f"must pass its piece of the same global tensor (x.chunk(n, dim)[i], equal pieces) and the "
                    f"same sizes in dims that are not split"
                )


_COMPARING = "comparing the replicated inputs across ranks (the first collective of a program's first call)"
_WHY = ("one program runs on every rank and takes a replicated input to be the same tensor everywhere, so the "
        "result would be no model's. Pass every rank of a group the same values (e.g. sample data per "
        "data-parallel rank, not per process: DistributedSampler(num_replicas=<dp size>, rank=<dp rank>)), or "
        "declare how the input is split (in_specs=P('dp') for a batch split over 'dp'); in_specs default to "
        "replicated. Checked on the first call of each program")


def check_replicated_values(tensors: Sequence[Any], placements: Sequence[Sequence[Pl]], names: Sequence[str],
                            mesh: DeviceMesh) -> None:
    """Requires: every rank of ``mesh`` calls this with its local ``tensors`` (``placements`` and ``names``, for
    messages, per tensor; non-tensors are skipped). Ensures: returns when every tensor laid out replicated over a
    mesh axis holds the same values on all ranks of that axis, else raises a ShardingError on every rank of
    ``mesh`` naming those that do not (``replicas.check_replicas``: one checksum per tensor, exchanged per
    mesh axis; nothing on one process or the fake process group)."""
    named = {n: t for n, t in zip(names, tensors) if isinstance(t, torch.Tensor)}
    guard_collective(lambda: check_replicas(named, dict(zip(names, placements)), mesh, _WHY), _COMPARING)


def _finite(x: Any) -> bool:
    return isinstance(x, int) or bool(getattr(x, "is_Integer", False))


def _linear(size: Dim) -> Optional[tuple[sympy.Symbol, int, int]]:
    """``(sym, a, b)`` with ``size == a*sym + b`` for a one-symbol linear size, else None."""
    if is_concrete(size) or len(size.free_symbols) != 1:
        return None
    (sym,) = size.free_symbols
    poly = sympy.Poly(size, sym)
    if poly.degree() != 1 or not all(c.is_Integer for c in poly.all_coeffs()):
        return None
    a, b = (int(c) for c in poly.all_coeffs())
    return sym, a, b
