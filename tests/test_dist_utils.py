"""The rank pool behind ``run_ranks``: reuse, per-call reset, and recovery after a broken call.

Cheap on purpose (trivial rank bodies, 2 ranks). The basic contract (results in rank
order, RankError with the first-raising rank's traceback, timeouts with stack dumps,
no zombies) is in test_support.py.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests import dist_utils
from tests.dist_utils import RankError, run_ranks
from tests.test_support import _zombie_children

# ----------------------------------------------------------------- rank bodies (module level: pickled by reference)


def _identity(rank: int, world_size: int) -> dict:
    dist.barrier()
    return {"pid": os.getpid(), "groups": len(dist.distributed_c10d._world.pg_map)}


def _dirty_state(rank: int, world_size: int) -> None:
    """Leave behind everything a later call must not see."""
    torch.manual_seed(1234)
    torch.rand(3)
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["RUN_RANKS_LEFTOVER"] = "1"
    os.environ["RANK"] = "99"
    os.chdir("/")
    warnings.simplefilter("ignore")
    _warn_here()  # recorded in this module's __warningregistry__ (filter "ignore")
    # a subgroup, as a 2-D mesh makes, and a shorter default-group timeout, as init_mesh(timeout=...) sets
    dist.new_group(ranks=list(range(world_size)))
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=5))
    import fxshard.planner.propagate as propagate

    propagate._WARNED.set(propagate._WARNED.get() | {"aten.flip.default"})


def _warn_here() -> None:
    warnings.warn("pool-sentinel-warning", UserWarning)


def _fresh_state(rank: int, world_size: int) -> dict:
    import fxshard.planner.propagate as propagate

    with warnings.catch_warnings(record=True) as caught:
        _warn_here()  # the default filters show it: nothing recorded it before
    return {
        "pid": os.getpid(),
        "rand": torch.rand(3),
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "leftover": os.environ.get("RUN_RANKS_LEFTOVER"),
        "rank_env": os.environ["RANK"],
        "cwd": os.getcwd(),
        "warned": [str(w.message) for w in caught],
        "once_registry": sorted(propagate._WARNED.get()),
        "groups": len(dist.distributed_c10d._world.pg_map),
    }


def _raise_on_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        raise KeyError("pool-sentinel-raise")
    dist.barrier()


def _exit_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(7)
    dist.barrier()  # rank 0 is blocked here when rank 1 disappears


def _hang_on_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def _break_default_group(rank: int, world_size: int) -> str:
    """Rank 0 times out in an all_reduce that rank 1 never joins, and returns normally."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=2))
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1))
        except Exception as e:  # noqa: BLE001  (gloo's timeout error; its type varies)
            return type(e).__name__
        return "no timeout"
    time.sleep(4)  # outlive rank 0's timeout, so the group's sequence numbers no longer match
    return "skipped"


def _print_marker(rank: int, world_size: int, marker: str) -> None:
    print(f"{marker} from rank {rank}", flush=True)
    print(f"{marker} on stderr from rank {rank}", file=sys.stderr, flush=True)


def _pool_pids(world_size: int = 2) -> list[int]:
    pool = dist_utils._POOLS.get(world_size)
    return [p.pid for p in pool.procs] if pool is not None else []


# ----------------------------------------------------------------- tests


def test_pool_reuses_workers_and_resets_state_per_call() -> None:
    first = run_ranks(_identity, 2)
    assert [r["pid"] for r in first] == _pool_pids()  # the pool kept the workers
    run_ranks(_dirty_state, 2)
    again = run_ranks(_fresh_state, 2)
    assert [r["pid"] for r in again] == [r["pid"] for r in first]  # same processes ...
    expected_rand = torch.Generator().manual_seed(0)
    for rank, r in enumerate(again):  # ... yet each call sees what a fresh process would
        assert torch.equal(r["rand"], torch.rand(3, generator=expected_rand.manual_seed(0)))
        assert r["threads"] == 1 and r["dtype"] == torch.float32 and r["grad"] is True
        assert r["leftover"] is None and r["rank_env"] == str(rank)
        assert r["cwd"] == os.getcwd()
        assert r["warned"] == ["pool-sentinel-warning"] and r["once_registry"] == []
        assert r["groups"] == first[rank]["groups"]  # the subgroup of _dirty_state was destroyed


def test_fresh_call_uses_new_processes_and_keeps_the_pool() -> None:
    pooled = [r["pid"] for r in run_ranks(_identity, 2)]
    fresh = [r["pid"] for r in run_ranks(_identity, 2, fresh=True)]
    assert not set(fresh) & set(pooled)
    assert _pool_pids() == pooled
    assert _zombie_children() == []


@pytest.mark.parametrize(
    "body, rank, match",
    [
        (_raise_on_rank0, 0, r"(?s)rank 0 of 2 raised in _raise_on_rank0.*KeyError: 'pool-sentinel-raise'"),
        (_exit_on_rank1, 1, r"rank 1 of 2 running _exit_on_rank1 exited with code 7 without reporting"),
        (_hang_on_rank0, None, r"timed out after 5 s running _hang_on_rank0 on 2 ranks; ranks without a result: \[0\]"),
    ],
    ids=["raise", "os_exit", "timeout"],
)
def test_a_failed_call_discards_the_pool_and_the_next_call_works(body, rank, match) -> None:
    before = [r["pid"] for r in run_ranks(_identity, 2)]
    with pytest.raises(RankError, match=match) as info:
        run_ranks(body, 2, timeout=5)
    assert info.value.rank == rank
    assert dist_utils._POOLS.get(2) is None and _zombie_children() == []
    after = [r["pid"] for r in run_ranks(_identity, 2)]
    assert not set(after) & set(before)  # fresh workers


def test_a_call_that_breaks_the_default_group_retires_the_pool(capfd: pytest.CaptureFixture[str]) -> None:
    before = [r["pid"] for r in run_ranks(_identity, 2)]
    assert run_ranks(_break_default_group, 2, timeout=60)[1] == "skipped"  # the call itself succeeds
    assert "discarding the 2-rank pool" in capfd.readouterr().err
    assert _zombie_children() == []
    after = [r["pid"] for r in run_ranks(_identity, 2)]  # and the next one gets a healthy group
    assert not set(after) & set(before)


def test_rank_output_is_captured_under_the_running_test(capfd: pytest.CaptureFixture[str]) -> None:
    run_ranks(_identity, 2)  # the pool exists before this capture starts
    capfd.readouterr()
    run_ranks(_print_marker, 2, "pool-sentinel-print")
    out, err = capfd.readouterr()
    assert "pool-sentinel-print from rank 0" in out and "pool-sentinel-print from rank 1" in out
    assert "pool-sentinel-print on stderr from rank 1" in err
