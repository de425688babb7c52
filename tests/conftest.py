"""Shared fixtures: a fake process group (one process, any world size, no real communication).

``fake_world(n)`` is a context manager that initializes torch's ``"fake"``
process group with ``n`` ranks (this process acts as ``rank``) and yields a
DeviceMesh over it; on exit it destroys the default group, so the next test
(or the next ``with``) can pick another world size. The ``fake_mesh``
fixture is a factory around it whose teardown runs even when the test fails;
``mesh2`` is the common 1-D ``tp=2`` case.

Collectives on the fake group are shape-correct no-ops: use it to plan, to
inspect graphs and to count collectives, never to check numbers (those tests
use ``tests.dist_utils.run_ranks``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional, Sequence

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

# every pipeline in the suite runs under the verifier (fxshard/passes/verify.py), rank processes too
os.environ.setdefault("FXSHARD_VERIFY", "1")


@contextlib.contextmanager
def fake_world(world_size: int = 2, rank: int = 0, shape: Optional[Sequence[int]] = None,
               names: Sequence[str] = ("tp",)) -> Iterator[DeviceMesh]:
    """A fake default process group of ``world_size`` ranks seen from ``rank``, and a CPU mesh over it.

    ``shape``/``names`` give the mesh layout (default: one axis ``tp`` of all ranks).
    Requires that no default process group exists; destroys it on exit.
    """
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; a test leaked one (destroy it on teardown)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", tuple(shape or (world_size,)), mesh_dim_names=tuple(names))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_mesh() -> Iterator[Callable[..., DeviceMesh]]:
    """Factory ``fake_mesh(world_size=2, rank=0, shape=None, names=("tp",)) -> DeviceMesh``.

    Call it once per test; the process group is destroyed at teardown.
    """
    with contextlib.ExitStack() as stack:
        yield lambda *a, **kw: stack.enter_context(fake_world(*a, **kw))


@pytest.fixture
def mesh2(fake_mesh) -> DeviceMesh:
    """A 1-D mesh ``tp=2`` on the fake process group, this process being rank 0."""
    return fake_mesh(2)


def pytest_terminal_summary(terminalreporter) -> None:
    """Say how many rank processes the session's run_ranks calls started (see tests/dist_utils.py)."""
    from tests.dist_utils import pool_summary

    line = pool_summary()
    if line:
        terminalreporter.write_line(line)
