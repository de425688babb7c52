"""Run a function on N real ``torch.distributed`` ranks (gloo, CPU) from a test.

Usage (``tests`` is a package: ``from tests.dist_utils import run_ranks``)::

    # module level in a test file: ``fn`` is pickled *by reference*, so it must
    # be importable by name in a fresh interpreter (no lambdas, no closures,
    # no functions defined inside a test).
    def _allreduce(rank: int, world_size: int, scale: float) -> torch.Tensor:
        t = torch.full((2,), float(rank + 1)) * scale
        dist.all_reduce(t)
        return t

    def test_allreduce() -> None:
        out = run_ranks(_allreduce, 2, 3.0)      # -> [tensor, tensor], rank order
        assert out[0].tolist() == [9.0, 9.0]

Each rank is a separate process started with the ``spawn`` start method (fork
is unsafe once torch/OpenMP threads exist in the parent). Children inherit the
parent's ``sys.path`` (multiprocessing passes it along), so a test module's
functions and its sibling helper modules import in the child the same way
they do under pytest.

Measured cost (torch 2.13.0+cpu, 2-core machine): a trivial 2-rank
``run_ranks`` (spawn, init gloo, one all_reduce, destroy, join) takes about
1.1-2.0 s wall time (10 runs: 1.14 to 1.87 s, median ~1.6 s). Nearly all of it is
the two children importing torch at once on two cores plus gloo rendezvous
(fn starts ~1.1-1.5 s after launch); children skip interpreter teardown with
``os._exit`` after reporting, which saves ~0.5 s per run (see ``_FAST_EXIT``).
Under pytest add the import of the test module that defines ``fn`` (and
whatever it imports) in every child. Keep multi-process tests few and put
several checks in one ``fn`` where it reads well.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable

__all__ = ["RankError", "find_free_port", "run_ranks"]

# A child that died without reporting is declared lost after this grace period
# (its last queue message may still be in the pipe when we first see it dead).
_DEAD_CHILD_GRACE_S = 2.0
# How long a timed-out child gets to dump its Python stacks before SIGKILL.
_STACK_DUMP_GRACE_S = 0.5
# After the first error report, how long to wait for the other ranks' reports
# (the earliest-raised error is reported as the root cause).
_ERROR_SETTLE_S = 1.0
_POLL_S = 0.05
# Children leave with os._exit(0) once their report is flushed, skipping
# interpreter teardown (atexit handlers, e.g. coverage in children, do not
# run). Set RUN_RANKS_CLEAN_EXIT=1 to exit normally instead.
_FAST_EXIT = os.environ.get("RUN_RANKS_CLEAN_EXIT") != "1"


class RankError(RuntimeError):
    """A rank failed: it raised, crashed, or the run timed out.

    Attributes:
        rank: the failing rank, or ``None`` for a timeout of the whole run.
        child_traceback: the child's formatted traceback ("" when unavailable).
    """

    def __init__(self, message: str, rank: int | None = None, child_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.child_traceback = child_traceback


def find_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    Ensures: the port was obtained by binding port 0, so the kernel chose it.
    There is a small window in which another process could take it; callers
    that cannot tolerate that must retry.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _to_cpu(value: Any) -> Any:
    """Detach every tensor in a (nested list/tuple/dict) value and move it to CPU."""
    import torch
    from torch.utils._pytree import tree_map

    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu")
        return x

    return tree_map(conv, value)


def _run_rank(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bytes:
    """Set up the rank, run ``fn``, return its pickled (CPU) result.

    The result is pickled here with the standard pickler (tensors become
    self-contained bytes), not by the queue's ForkingPickler, which would
    share tensor storage through file descriptors that die with this process.
    If ``fn`` raises, the process group is deliberately *not* destroyed: the
    error is timestamped and reported before peers see connections drop, so
    the parent can tell the root cause from its consequences.
    """
    import faulthandler

    # The parent sends SIGUSR1 to a hung child to get its Python stacks.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    result = fn(rank, world_size, *args, **kwargs)
    payload = pickle.dumps(_to_cpu(result), protocol=pickle.HIGHEST_PROTOCOL)
    dist.destroy_process_group()
    return payload


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    result_queue: Any,
) -> None:
    """Process target of one rank. Never raises: reports once, then exits.

    Puts exactly one message on ``result_queue``:
    ``(rank, "ok", pickled_result, 0.0)`` or
    ``(rank, "err", formatted_traceback, time_raised)``; then exits (see
    ``_FAST_EXIT``).
    """
    try:
        msg = (rank, "ok", _run_rank(fn, rank, world_size, port, timeout, args, kwargs), 0.0)
    except BaseException:  # everything, including SystemExit/KeyboardInterrupt
        msg = (rank, "err", traceback.format_exc(), time.time())
    result_queue.put(msg)
    if _FAST_EXIT:
        # Interpreter teardown with torch loaded costs ~0.5 s per run; the
        # report is all the parent needs, so flush it and leave at once.
        result_queue.close()
        result_queue.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _rank_error(errors: dict[int, tuple[float, str]], world_size: int, fn_name: str) -> RankError:
    """Build the RankError for the rank that raised first; mention the others.

    Requires ``errors`` non-empty, mapping rank -> (time raised, traceback text).
    """
    first = min(errors, key=lambda r: (errors[r][0], r))
    tb = errors[first][1]
    others = [
        f"rank {r}: {errors[r][1].strip().splitlines()[-1]}" for r in sorted(errors) if r != first
    ]
    note = (
        f" (first of {len(errors)} failing ranks; later failures, usually consequences: "
        + "; ".join(others)
        + ")"
        if others
        else ""
    )
    return RankError(
        f"rank {first} of {world_size} raised in {fn_name}{note}:\n{tb}",
        rank=first,
        child_traceback=tb,
    )


def _stop(procs: list[Any], dump_stacks: bool = False) -> None:
    """Terminate (then kill) every live process and reap all of them.

    Ensures: every process in ``procs`` has been joined, so none is a zombie.
    With ``dump_stacks`` (requires ``procs`` indexed by rank) live children
    first get SIGUSR1, one at a time, and faulthandler prints their Python
    stacks to the inherited stderr under a header naming the rank.
    """
    if dump_stacks and hasattr(signal, "SIGUSR1"):
        for rank, p in enumerate(procs):
            if not p.is_alive():
                continue
            print(f"\n=== run_ranks: Python stacks of hung rank {rank} (pid {p.pid}) ===",
                  file=sys.stderr, flush=True)
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            time.sleep(_STACK_DUMP_GRACE_S)  # one at a time, so dumps do not interleave
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for p in procs:
        p.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 180,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Requires:
        * ``fn`` is a module-level function (picklable by reference; lambdas,
          closures and functions nested in a test do not work), importable in a
          fresh interpreter from the parent's ``sys.path``.
        * ``args``/``kwargs`` are picklable; ``fn``'s return value is picklable
          after tensors in it (nested in lists/tuples/dicts) are detached and
          moved to CPU, which this helper does.
        * ``fn`` does not initialize or destroy the default process group.

    In each child, before ``fn``: env vars RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port) are set,
    ``dist.init_process_group("gloo")`` is called (collective timeout =
    ``timeout``), ``torch.manual_seed(0)`` and ``torch.set_num_threads(1)``.
    The process group is destroyed after ``fn`` returns (not if it raises:
    the process exits instead).

    Ensures:
        * returns the ranks' return values as a list in rank order;
        * if a rank raises, raises :class:`RankError` (a RuntimeError) whose
          message carries the rank and the full formatted traceback of the
          rank that raised *first* (other ranks failing in a collective
          because a peer died are listed by their last line), after killing
          the remaining ranks;
        * if the ranks do not all finish within ``timeout`` seconds, dumps the
          live children's Python stacks to stderr, kills all, raises RankError;
        * on every path all child processes are joined (no zombies).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_child_main,
            args=(fn, rank, world_size, port, timeout, args, kwargs, result_queue),
            name=f"run_ranks-{getattr(fn, '__name__', 'fn')}-rank{rank}",
        )
        for rank in range(world_size)
    ]
    results: dict[int, bytes] = {}
    errors: dict[int, tuple[float, str]] = {}
    first_seen_dead: dict[int, float] = {}
    settle_until: float | None = None  # set by the first error report
    fn_name = getattr(fn, "__qualname__", repr(fn))
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            if settle_until is not None and time.monotonic() >= settle_until:
                break
            try:
                rank, status, payload, t_raised = result_queue.get(timeout=_POLL_S)
            except queue_mod.Empty:
                if settle_until is None:
                    _check_dead_or_late(procs, results, first_seen_dead, deadline, timeout, fn_name)
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = (t_raised, payload)
                if settle_until is None:
                    # Give the other ranks a moment to report, to find the root cause.
                    settle_until = time.monotonic() + _ERROR_SETTLE_S
        if errors:
            raise _rank_error(errors, world_size, fn_name)
        for p in procs:
            p.join(timeout=30)
        return [pickle.loads(results[r]) for r in range(world_size)]
    finally:
        _stop([p for p in procs if _started(p)])
        result_queue.close()
        result_queue.join_thread()


def _check_dead_or_late(
    procs: list[Any],
    results: dict[int, bytes],
    first_seen_dead: dict[int, float],
    deadline: float,
    timeout: float,
    fn_name: str,
) -> None:
    """Raise RankError if a rank died without reporting or the run is past its deadline.

    A dead rank is given ``_DEAD_CHILD_GRACE_S`` for its last message to
    arrive. On timeout the live ranks' stacks are dumped and all are killed.
    """
    world_size = len(procs)
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if rank in results or p.is_alive():
            continue
        first_seen_dead.setdefault(rank, now)
        if now - first_seen_dead[rank] > _DEAD_CHILD_GRACE_S:
            raise RankError(
                f"rank {rank} of {world_size} running {fn_name} exited with code "
                f"{p.exitcode} without reporting a result: it crashed, was signalled, "
                f"called os._exit, or failed before reaching fn (e.g. the spawned "
                f"interpreter could not re-import the parent's __main__ or fn's "
                f"module; run from a file, not stdin). See stderr for its output.",
                rank=rank,
            )
    if now > deadline:
        pending = [r for r in range(world_size) if r not in results]
        _stop(procs, dump_stacks=True)
        raise RankError(
            f"run_ranks timed out after {timeout:g} s running {fn_name} on "
            f"{world_size} ranks; ranks without a result: {pending}, finished: "
            f"{sorted(results)}. Python stacks of the hung ranks were dumped to "
            f"stderr (see captured stderr). A rank waiting in a collective that "
            f"another rank never reaches is the usual cause.",
            rank=None,
        )


def _started(p: Any) -> bool:
    """Whether ``p.start()`` was called (an unstarted Process cannot be joined)."""
    try:
        return p.pid is not None
    except ValueError:  # already closed
        return False


def _timing_probe(rank: int, world_size: int) -> float:
    """Trivial rank body for timing: one all_reduce of a scalar."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


if __name__ == "__main__":  # quick timing: python tests/dist_utils.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_utils import _timing_probe  # noqa: E402  (import by module name, not __main__)

    t0 = time.perf_counter()
    out = run_ranks(_timing_probe, 2)
    print(f"2-rank run_ranks: {time.perf_counter() - t0:.2f} s, results {out}")
