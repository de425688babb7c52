"""Device meshes: creating one with named axes, and the facts passes need about it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import ShardingError

__all__ = ["init_mesh", "MeshInfo", "default_device_type", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = timedelta(minutes=10)


def default_device_type() -> str:
    """``cuda`` when CUDA is available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_mesh(*, timeout: Optional[Union[float, timedelta]] = None, **axes: int) -> DeviceMesh:
    """A torch DeviceMesh with named axes, e.g. ``init_mesh(dp=2, tp=2)``.

    Requires the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) or
    an initialized default process group; the product of the axis sizes must
    equal the world size. Uses NCCL + the rank's own GPU (LOCAL_RANK) when CUDA
    is available, gloo + CPU otherwise.

    ``timeout`` (seconds or a ``timedelta``) bounds how long a collective waits for the
    other ranks, so a rank that skips or reorders a call makes its peers fail with a
    ShardingError naming the collective instead of hanging. When init_mesh creates the
    process group it uses ``timeout`` or ``DEFAULT_TIMEOUT`` (10 minutes) for it and for
    every mesh axis's group; with an existing process group, a given ``timeout`` is set on
    the mesh's groups and ``None`` leaves them as they are. (On NCCL a timed-out collective
    is handled by NCCL's watchdog, which by default ends the process with its own report.)
    """
    if not axes:
        raise ShardingError("init_mesh() got no axes; call it like init_mesh(tp=2) or init_mesh(dp=2, tp=2)")
    for name, size in axes.items():
        if not isinstance(size, int) or size < 1:
            raise ShardingError(f"init_mesh: axis {name!r} has size {size!r}; sizes must be positive ints")
    if timeout is not None and not isinstance(timeout, timedelta):
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ShardingError(f"init_mesh: timeout={timeout!r}; give seconds (a positive number) or a timedelta")
        timeout = timedelta(seconds=timeout)
    device_type = default_device_type()
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE") if v not in os.environ]
        if missing:
            raise ShardingError(
                f"init_mesh: no process group and {', '.join(missing)} not set; "
                f"launch with torchrun (e.g. torchrun --nproc-per-node 2 script.py) or call "
                f"torch.distributed.init_process_group first"
            )
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timeout or DEFAULT_TIMEOUT
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    world = dist.get_world_size()
    total = 1
    for s in axes.values():
        total *= s
    if total != world:
        raise ShardingError(
            f"init_mesh{axes}: the axis sizes multiply to {total} but the world has {world} ranks; "
            f"choose sizes whose product is {world}"
        )
    mesh = init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes.keys()))
    if timeout is not None:
        set_timeout(mesh, timeout)
    return mesh


def set_timeout(mesh: DeviceMesh, timeout: timedelta) -> None:
    """Give the process group of every axis of ``mesh`` ``timeout`` (torch creates sub-groups with its
    own default, not the world's)."""
    if dist.get_backend() != "fake":
        for i in range(mesh.ndim):
            dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(i))


@dataclass(frozen=True)
class MeshInfo:
    """What the passes need to know about a mesh, from the calling rank's view.

    ``coords[i]`` is this rank's index along axis ``i``; ``group_names[i]`` the
    process group the functional collectives of axis ``i`` run on; ``links[i]`` the speed of axis
    ``i``'s link as ``cost.Link`` (empty: every axis alike; ``shard(bandwidth=..., latency=...)``);
    ``reduce_dtype``: the dtype Partial sums of narrower floats are reduced in (``shard()`` under
    ``torch.autocast``: ``precision.REDUCE_DTYPE``), None: in their own dtype.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    coords: tuple[int, ...]
    group_names: tuple[str, ...]
    device_type: str
    rank: int
    links: tuple = ()
    reduce_dtype: Optional[torch.dtype] = None

    @staticmethod
    def of(mesh: DeviceMesh) -> "MeshInfo":
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(
                f"expected a torch DeviceMesh, got {type(mesh).__name__}; create one with fxshard.init_mesh(tp=2)"
            )
        names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
        coord = mesh.get_coordinate()
        if coord is None:
            raise ShardingError(f"rank {dist.get_rank()} is not part of the mesh {mesh}; shard only on mesh ranks")
        groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
        return MeshInfo(tuple(names), tuple(mesh.shape), tuple(coord), groups, mesh.device_type, dist.get_rank())

    def axis(self, name: str) -> int:
        if name not in self.names:
            raise ShardingError(f"mesh axis {name!r} does not exist; the mesh axes are {self.names}")
        return self.names.index(name)
