"""Initialization that never builds a full tensor: each rank generates only the tiles it holds.

The global tensor is cut into fixed tiles (their shape depends only on the global shape). For each tile a rank
needs, ``init(fqn, t)`` (e.g. ``nn.init.trunc_normal_(t, std=0.02)``) runs on ``t``, a stand-in that reports
the *global* shape (so fan-in and bounds are computed as in the unsharded model) and computes on the tile:
elementwise ops (``normal_``, ``uniform_``, ``mul_``, ``clamp_``, ``where``, ``copy_`` from a tensor that
broadcasts to the global shape, cut to the tile, ...) and the ``any``/``all`` tests of rejection sampling
run on the tile; random ops draw from a generator seeded by ``(seed, fqn, tile index)``. A value therefore depends on its
global position and the seed, never on the mesh, and a rank holds one tile at a time besides its shard.
Anything else (views of ``t``, reductions, matrix ops: ``orthogonal_``, ``eye_``) is a ShardingError that
points to the exact mode.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from ..core.torch_compat import pytree

from .checkpoint import Piece
from ..core.errors import ShardingError
from ..core.torch_compat import TorchDispatchMode, disabled_torch_function_impl

__all__ = ["fill", "tile_shape", "tiled_init", "draw_seed"]

InitFn = Callable[[str, torch.Tensor], Any]
_TILE_ELEMENTS = 1 << 18
_ALLOWED = {"fill_", "zero_", "copy_", "empty_like", "zeros_like", "ones_like", "full_like", "where", "detach",
            "alias", "clone", "any", "all", "_to_copy", "_local_scalar_dense", "lift_fresh"}


def _refusal(fqn: str, what: str) -> ShardingError:
    return ShardingError(
        f"init_parameters: init({fqn!r}, t) {what}; the default (tiled) mode runs init on each rank's tiles and "
        f"supports elementwise and random ops on t (normal_, uniform_, mul_, clamp_, where, copy_ from a tensor "
        f"broadcasting to t's global shape: every nn.init function except orthogonal_/eye_/dirac_/sparse_). Use "
        f"init_parameters(init, exact=True) to run init on the full tensor (one tensor at a time)"
    )


class _Tile(torch.Tensor):
    """Stands for the global tensor in ``init``; holds one tile and computes on it (see module doc)."""

    _tile: torch.Tensor
    _ctx: dict

    @staticmethod
    def __new__(cls, tile: torch.Tensor, ctx: dict) -> "_Tile":
        r = torch.Tensor._make_wrapper_subclass(cls, ctx["shape"], dtype=tile.dtype, device=tile.device)
        r._tile, r._ctx = tile, ctx
        return r

    __torch_function__ = disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"TileOf(shape={tuple(self.shape)}, tile={tuple(self._tile.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        ctx = next(x._ctx for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, _Tile))
        name = func.__name__.split(".")[0]
        random = "generator" in [a.name for a in func._schema.arguments]
        if not (torch.Tag.pointwise in func.tags or random or name in _ALLOWED):
            raise _refusal(ctx["fqn"], f"applies {func}, which is not elementwise")

        def unwrap(x: Any) -> Any:
            if isinstance(x, _Tile):
                return x._tile
            if isinstance(x, torch.Tensor) and x.numel() != 1:
                try:
                    return x.expand(ctx["shape"])[ctx["box"]].to(ctx["root"].device)
                except RuntimeError:
                    raise _refusal(ctx["fqn"], f"applies {func} with a tensor of shape {tuple(x.shape)}, which does "
                                               f"not broadcast to t's global shape {ctx['shape']}") from None
            return x

        a, kw = pytree.tree_map(unwrap, (args, kwargs))
        if random:
            kw = {**kw, "generator": ctx["gen"]}
        if func._schema.is_mutable and a and isinstance(a[0], torch.Tensor) and a[0].data_ptr() == ctx["root"].data_ptr():
            ctx["written"] = True
        out = func(*a, **kw)
        if func._schema.is_mutable and args and isinstance(args[0], _Tile):
            return args[0]  # in place: the same stand-in (``t is result`` holds as in eager)
        tile_shape_ = tuple(ctx["root"].shape)
        return pytree.tree_map(
            lambda y: _Tile(y, ctx) if isinstance(y, torch.Tensor) and tuple(y.shape) == tile_shape_ and
            (name != "any" and name != "all") else y, out)


def tile_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The tiles of a tensor of ``shape`` (a function of the shape alone): about 256 Ki elements each."""
    if not shape:
        return ()
    edge = max(1, round(_TILE_ELEMENTS ** (1 / len(shape))))
    return tuple(max(1, min(int(s), edge)) for s in shape)


def _generator(seed: int, fqn: str, tile: tuple[int, ...]) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}|{fqn}|{tile}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


class _Guard(TorchDispatchMode):
    """Refuses random draws that do not go through the stand-in: each tile would draw its own (see module doc)."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not any(isinstance(x, _Tile) for x in pytree.tree_leaves((args, kwargs))) and (
                torch.Tag.nondeterministic_seeded in func.tags):
            raise _refusal(self.fqn, f"draws random numbers with {func} outside t (each tile would draw its own "
                                     f"full-size tensor); draw into t instead (t.normal_(), nn.init.*_(t))")
        return func(*args, **kwargs)


def fill(out: torch.Tensor, fqn: str, shape: Sequence[int], init: InitFn, pieces: Sequence[Piece],
         seed: int) -> bool:
    """Write into ``out`` the boxes ``pieces`` of the tiled init of ``fqn`` (global ``shape``; ``src`` boxes
    index the global tensor, ``dst`` boxes index ``out``), building one tile (on CPU) at a time. Returns False,
    writing nothing, when ``init`` does not write ``t``."""
    shape = tuple(int(n) for n in shape)
    edges = tile_shape(shape)
    for piece in pieces:
        ranges = [range(s.start // e, -(-s.stop // e)) if s.stop > s.start else range(0)
                  for s, e in zip(piece.src, edges)]
        for idx in itertools.product(*ranges):
            lo = [i * e for i, e in zip(idx, edges)]
            hi = [min(a + e, n) for a, e, n in zip(lo, edges, shape)]
            tile = torch.empty([b - a for a, b in zip(lo, hi)], dtype=out.dtype)
            ctx = {"fqn": fqn, "shape": shape, "box": tuple(slice(a, b) for a, b in zip(lo, hi)),
                   "gen": _generator(seed, fqn, idx), "root": tile, "written": False}
            with _Guard(fqn):
                init(fqn, _Tile(tile, ctx))
            if not ctx["written"]:
                return False
            a = [max(s.start, t) for s, t in zip(piece.src, lo)]  # the part of this tile inside the piece
            b = [min(s.stop, t) for s, t in zip(piece.src, hi)]
            in_tile = tuple(slice(x - t, y - t) for x, y, t in zip(a, b, lo))
            in_out = tuple(slice(d.start + x - s.start, d.start + y - s.start)
                           for x, y, s, d in zip(a, b, piece.src, piece.dst))
            out[in_out].copy_(tile[in_tile])
    return True


def tiled_init(model: nn.Module, init: InitFn, *, seed: int) -> None:
    """Fill an ordinary (unsharded) model's parameters and buffers exactly as ``sm.init_parameters(init,
    seed=seed)`` fills a ShardedModule of it at any mesh; tensors ``init`` does not write stay as they are."""
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for fqn, t in named.items():
            whole = tuple(slice(0, int(s)) for s in t.shape)
            fill(t, fqn, t.shape, init, [Piece(whole, whole)], seed)


def draw_seed(seed: Optional[int]) -> int:
    """``seed``, or one drawn from torch's default generator."""
    return int(torch.randint(0, 2**62, ())) if seed is None else int(seed)
