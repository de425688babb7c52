"""Run a function on N real ``torch.distributed`` ranks (gloo, CPU) from a test.

Usage (``tests`` is a package: ``from tests.dist_utils import run_ranks``)::

    # module level in a test file: ``fn`` is pickled *by reference*, so it must
    # be importable by name in another interpreter (no lambdas, no closures,
    # no functions defined inside a test).
    def _allreduce(rank: int, world_size: int, scale: float) -> torch.Tensor:
        t = torch.full((2,), float(rank + 1)) * scale
        dist.all_reduce(t)
        return t

    def test_allreduce() -> None:
        out = run_ranks(_allreduce, 2, 3.0)      # -> [tensor, tensor], rank order
        assert out[0].tolist() == [9.0, 9.0]

Ranks are worker processes kept in a pool, one pool per world size, for the
whole pytest session: the first ``run_ranks(fn, n)`` spawns ``n`` workers
(``spawn`` start method: fork is unsafe once torch/OpenMP threads exist in the
parent), which import torch and join one gloo default process group; every
later call with the same ``n`` sends ``(fn, args)`` to the same workers. A
worker imports a test module the first time one of its functions arrives
(workers get the parent's current ``sys.path`` with every call, so modules
collected after the pool started import the same way as under pytest).

Before each call a worker resets what a fresh process would give ``fn``:
``torch.manual_seed(0)``, ``torch.set_num_threads(1)``, the float32 default
dtype and grad mode, the environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and nothing a previous call set), the
working directory, the warning filters (and every ``__warningregistry__``),
the warn-once registries of fxshard (module-level ContextVars named ``_WARNED``),
torch._dynamo's caches and counters, DTensor's RNG tracker, the default group's collective
timeout (= this call's ``timeout``) and the process's stdout/stderr (this
call's, so pytest captures a rank's output under the running test). After a
call that succeeded everywhere the ranks check the default group with one
all_reduce and destroy the process groups the call created (e.g. a 2-D mesh's
axis groups); if that check fails or hangs, the pool is discarded. After any
failure (a rank raised, died or the call timed out) the pool is killed, so the
next call gets fresh workers and one broken test cannot poison the next.

What a pool does *not* reset: module-level state of test modules and of
libraries other than the above (caches, ``lru_cache``), Python's ``random``.
A test that needs a brand-new process (it breaks or re-creates the default
process group, lets collectives time out on purpose, relies on first-import
state or on per-process high-water marks such as ``ru_maxrss``) passes ``fresh=True``: it gets its own workers, discarded after
the call, exactly as before pooling. ``RUN_RANKS_POOL=0`` in the environment
makes every call fresh (to compare, or to rule the pool out when debugging).

Measured cost (torch 2.13.0+cpu, 2-core machine): spawning a 2-rank pool
(spawn, import torch, init gloo) takes ~1.1-2.0 s on a quiet machine, plus
the import of the test module and torch.export/dynamo's first-use warm-up in
each rank (several seconds for the first fxshard.shard); a pooled call pays
none of that: a trivial pooled 2-rank call (one all_reduce) takes a few ms.
On the whole suite pooling saved about a third of the wall time
(see ``scripts/test.sh`` output, ``--durations``). Workers leave with
``os._exit`` (no interpreter teardown, ~0.5 s each); set
``RUN_RANKS_CLEAN_EXIT=1`` to exit normally (e.g. for coverage in ranks).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from contextvars import ContextVar
from multiprocessing import connection, reduction
from typing import Any, Callable

__all__ = ["RankError", "find_free_port", "pool_summary", "run_ranks", "shutdown_pools"]

# After the first failure (a rank raised or died), how long to wait for the
# other ranks' reports; the earliest failure is reported as the root cause.
_ERROR_SETTLE_S = 1.0
# How long a timed-out rank gets to dump its Python stacks before SIGKILL.
_STACK_DUMP_GRACE_S = 0.5
# Collective timeout of the health check after a call (both ranks are idle and
# start it together, so this is generous even under load; a false alarm only
# costs a respawn), and how long the parent waits for the ranks to finish it;
# past either the pool is discarded.
_CHECK_TIMEOUT_S = 5.0
_FINISH_WAIT_S = 20.0
# Workers leave with os._exit(0), skipping interpreter teardown (atexit
# handlers, e.g. coverage in ranks, do not run); RUN_RANKS_CLEAN_EXIT=1 exits normally.
_FAST_EXIT = os.environ.get("RUN_RANKS_CLEAN_EXIT") != "1"


class RankError(RuntimeError):
    """A rank failed: it raised, crashed, or the run timed out.

    Attributes:
        rank: the failing rank, or ``None`` for a timeout of the whole run.
        child_traceback: the rank's formatted traceback ("" when unavailable).
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


# ------------------------------------------------------------------ worker side


def _leave(conn: Any, code: int = 0) -> None:
    """End this worker: flush what it printed, then exit (fast unless RUN_RANKS_CLEAN_EXIT=1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _FAST_EXIT:
        os._exit(code)
    conn.close()
    sys.exit(code)


def _take_stdio(conn: Any) -> None:
    """Point fds 1 and 2 at the files the parent's fds 1 and 2 point at now (sent with the call).

    The parent's pytest redirects its fds 1/2 per test (capture); this puts a
    rank's output under the test that is running, as for a freshly spawned child.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    for target in (1, 2):
        fd = reduction.recv_handle(conn)
        os.dup2(fd, target)
        os.close(fd)


class _Baseline:
    """The state a fresh worker had right after joining the process group; restored before every call."""

    def __init__(self) -> None:
        import warnings

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.filters = list(warnings.filters)

    def restore(self, timeout: float, sys_path: list[str]) -> None:
        import warnings
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        sys.path[:] = sys_path
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        warnings.filters[:] = self.filters
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()
        getattr(warnings, "_onceregistry", {}).clear()
        for name, module in list(sys.modules.items()):
            registry = getattr(module, "__warningregistry__", None)
            if isinstance(registry, dict):
                registry.clear()
            if name == "fxshard" or name.startswith("fxshard."):
                once = getattr(module, "_WARNED", None)
                if isinstance(once, ContextVar):
                    once.set(frozenset())
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        dtensor_random = sys.modules.get("torch.distributed.tensor._random")
        if dtensor_random is not None:
            dtensor_random._rng_tracker = None
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))


def _finish(world_size: int) -> str:
    """After a successful call: check the default group, destroy the groups the call made.

    Returns "" when the pool can serve another call, else why not.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    c10d._set_pg_timeout(timedelta(seconds=_CHECK_TIMEOUT_S))
    probe = torch.ones(1)
    dist.all_reduce(probe)
    if probe.item() != world_size:
        return f"the default group's health check gave {probe.item()} instead of {world_size}"
    for pg in list(c10d._world.pg_map):
        if pg is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(pg)
    return ""


def _worker_main(conn: Any, rank: int, world_size: int, port: int, init_timeout: float) -> None:
    """Process target of one pooled rank: join the gloo group, then serve calls until told to leave.

    Messages from the parent (pickled tuples): ``("call", call_id, timeout,
    sys_path, task)`` followed by two fds (the parent's stdout, stderr), where
    ``task`` pickles ``(fn, args, kwargs)``; ``("finish", call_id)``;
    ``("exit",)``. Replies: ``("ok", call_id, pickled_result)``,
    ``("err", call_id, traceback_text, time_raised)`` (then the worker exits:
    peers blocked in a collective with it fail fast instead of hanging),
    ``("finished", call_id, why_not_reusable)``.
    """
    import faulthandler

    # A rank that crashes (SIGSEGV, SIGABRT from a heap check) prints every thread's Python stack to fd 2,
    # which each call points at the parent's stderr.
    faulthandler.enable(all_threads=True)
    # The parent sends SIGUSR1 to a hung rank to get its Python stacks.
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
    init_error = ""
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=init_timeout))
        baseline = _Baseline()
    except BaseException:
        init_error = traceback.format_exc()
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent is gone
            _leave(conn)
        if msg[0] == "exit":
            _leave(conn)
        call_id = msg[1]
        if msg[0] == "finish":
            try:
                why = _finish(world_size)
            except BaseException:
                why = traceback.format_exc()
            conn.send_bytes(pickle.dumps(("finished", call_id, why)))
            continue
        _, call_id, timeout, sys_path, task = msg
        _take_stdio(conn)
        try:
            if init_error:
                raise RuntimeError(f"rank {rank} could not join the gloo process group:\n{init_error}")
            baseline.restore(timeout, sys_path)
            fn, args, kwargs = pickle.loads(task)
            result = fn(rank, world_size, *args, **kwargs)
            # Pickled here with the standard pickler (tensors become bytes).
            reply = ("ok", call_id, pickle.dumps(_to_cpu(result), protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException:  # everything, including SystemExit/KeyboardInterrupt
            # The process group is deliberately left alone: the error is timestamped and
            # reported before peers see connections drop, so the parent can tell the root
            # cause from its consequences.
            raised = time.time()
            reply = ("err", call_id, traceback.format_exc(), raised)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        if reply[0] == "err":
            _leave(conn)


# ------------------------------------------------------------------ parent side


class _RankPool:
    """``world_size`` worker processes sharing one gloo default group; see the module docstring."""

    def __init__(self, world_size: int, init_timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.calls = 0
        port = find_free_port()
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_worker_main,
                    args=(child_end, rank, world_size, port, init_timeout),
                    name=f"run_ranks-{world_size}-rank{rank}",
                )
                p.start()
                child_end.close()
                self.procs.append(p)
                self.conns.append(parent_end)
        except BaseException:
            self.kill()
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _send_all(self, msg: tuple[Any, ...], stdio: bool = False) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns)):
            try:
                conn.send_bytes(data)
                if stdio:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    for fd in (1, 2):
                        reduction.send_handle(conn, fd, p.pid)
            except OSError:
                pass  # a dead rank: found by its sentinel while waiting for replies

    def run(self, fn_name: str, task: bytes, timeout: float, deadline: float) -> list[Any]:
        """Run one call on every rank; return the results in rank order or raise RankError.

        On RankError the caller must kill the pool (some ranks may be blocked or gone).
        """
        self.calls += 1
        self._send_all(("call", self.calls, timeout, list(sys.path), task), stdio=True)
        results: dict[int, bytes] = {}
        failures: dict[int, tuple[float, str, str]] = {}  # rank -> (time, traceback, message)
        settle_until: float | None = None
        watching = {conn: rank for rank, conn in enumerate(self.conns)}
        watching.update({p.sentinel: rank for rank, p in enumerate(self.procs)})
        while len(results) + len(failures) < self.world_size:
            now = time.monotonic()
            if settle_until is not None and now >= settle_until:
                break
            if settle_until is None and now >= deadline:
                self._timeout(fn_name, timeout, results)
            wait_until = settle_until if settle_until is not None else deadline
            for ready in connection.wait(list(watching), timeout=max(0.0, wait_until - now)):
                rank = watching.get(ready)
                if rank is None or rank in results or rank in failures:
                    continue
                conn = self.conns[rank]
                if ready is conn or conn.poll():  # a dead rank's last reply is still readable
                    try:
                        reply = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        reply = None
                    if reply is not None and reply[1] == self.calls:
                        if reply[0] == "ok":
                            results[rank] = reply[2]
                        else:
                            failures[rank] = (reply[3], reply[2], "")
                        continue
                if not self.procs[rank].is_alive() or ready is conn:
                    self.procs[rank].join(timeout=1)
                    failures[rank] = (time.time(), "", _died_message(rank, self.world_size, fn_name,
                                                                      self.procs[rank].exitcode))
                    watching = {k: r for k, r in watching.items() if r != rank}
            if failures and settle_until is None:
                # Give the other ranks a moment to report, to find the root cause.
                settle_until = time.monotonic() + _ERROR_SETTLE_S
        if failures:
            raise _rank_error(failures, self.world_size, fn_name)
        return [pickle.loads(results[r]) for r in range(self.world_size)]

    def finish(self) -> bool:
        """After a successful call: have the ranks check the default group and drop the call's groups.

        Returns whether the pool can serve another call (if not, the caller kills it).
        """
        self._send_all(("finish", self.calls))
        deadline = time.monotonic() + _FINISH_WAIT_S
        for rank, conn in enumerate(self.conns):
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not conn.poll(left):
                    raise TimeoutError(f"no answer within {_FINISH_WAIT_S:g} s")
                reply = pickle.loads(conn.recv_bytes())
                why = reply[2] if reply[:2] == ("finished", self.calls) else f"unexpected reply {reply[:2]}"
            except (EOFError, OSError, TimeoutError) as e:
                why = repr(e)
            if why:
                print(f"\nrun_ranks: discarding the {self.world_size}-rank pool after call {self.calls} "
                      f"(rank {rank}: {why.strip().splitlines()[-1]}); the next call starts fresh workers",
                      file=sys.stderr, flush=True)
                return False
        return True

    def _timeout(self, fn_name: str, timeout: float, results: dict[int, bytes]) -> None:
        pending = [r for r in range(self.world_size) if r not in results]
        self.kill(dump_stacks=True)
        raise RankError(
            f"run_ranks timed out after {timeout:g} s running {fn_name} on "
            f"{self.world_size} ranks; ranks without a result: {pending}, finished: "
            f"{sorted(results)}. Python stacks of the hung ranks were dumped to "
            f"stderr (see captured stderr). A rank waiting in a collective that "
            f"another rank never reaches is the usual cause.",
            rank=None,
        )

    def close(self) -> None:
        """Ask the workers to leave; kill the ones that do not within a few seconds."""
        self._send_all(("exit",))
        for p in self.procs:
            p.join(timeout=5)
        self.kill()

    def kill(self, dump_stacks: bool = False) -> None:
        """Terminate (then kill) every live worker and reap all of them.

        Ensures: every worker has been joined, so none is a zombie. With
        ``dump_stacks`` live workers first get SIGUSR1, one at a time, and
        faulthandler prints their Python stacks to stderr under a header naming the rank.
        """
        if dump_stacks and hasattr(signal, "SIGUSR1"):
            for rank, p in enumerate(self.procs):
                if not p.is_alive():
                    continue
                print(f"\n=== run_ranks: Python stacks of hung rank {rank} (pid {p.pid}) ===",
                      file=sys.stderr, flush=True)
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    continue
                time.sleep(_STACK_DUMP_GRACE_S)  # one at a time, so dumps do not interleave
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for p in self.procs:
            p.close()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def _died_message(rank: int, world_size: int, fn_name: str, exitcode: int | None) -> str:
    return (
        f"rank {rank} of {world_size} running {fn_name} exited with code "
        f"{exitcode} without reporting a result: it crashed, was signalled, "
        f"called os._exit, or failed before reaching fn (e.g. the spawned "
        f"interpreter could not re-import the parent's __main__; run from a "
        f"file, not stdin). See stderr for its output."
    )


# How gloo words an error caused by a peer's connection going away (the peer raised and
# left, or died): such an error is a consequence, never the root cause.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _lost_peer(tb: str) -> bool:
    lines = tb.strip().splitlines()
    return bool(lines) and any(text in lines[-1] for text in _PEER_LOST)


def _rank_error(failures: dict[int, tuple[float, str, str]], world_size: int, fn_name: str) -> RankError:
    """Build the RankError for the rank that failed first; mention the others.

    Requires ``failures`` non-empty, mapping rank -> (time of failure, traceback
    text, message); a rank that raised has a traceback and an empty message, a
    rank that died without reporting has a message and no traceback. "First" is
    the earliest failure that is not gloo losing a peer (else the earliest).
    """
    first = min(failures, key=lambda r: (_lost_peer(failures[r][1]), failures[r][0], r))
    _, tb, died = failures[first]

    def last_line(r: int) -> str:
        return (failures[r][1] or failures[r][2]).strip().splitlines()[-1]

    others = [f"rank {r}: {last_line(r)}" for r in sorted(failures) if r != first]
    note = (
        f" (first of {len(failures)} failing ranks; later failures, usually consequences: "
        + "; ".join(others)
        + ")"
        if others
        else ""
    )
    if died:
        return RankError(died + note, rank=first)
    return RankError(f"rank {first} of {world_size} raised in {fn_name}{note}:\n{tb}",
                     rank=first, child_traceback=tb)


_POOLS: dict[int, _RankPool] = {}
# Counts for the end-of-session summary (conftest.py prints ``pool_summary()``).
_STATS = {"calls": 0, "fresh": 0, "pools": 0, "discarded": 0}


def pool_summary() -> str:
    """One line: how many run_ranks calls ran and how many worker sets they started ("" if none)."""
    st = _STATS
    if not st["calls"]:
        return ""
    return (f"run_ranks: {st['calls']} calls, {st['pools']} worker sets started "
            f"({st['fresh']} fresh=True, {st['discarded']} pools discarded after a failed or unclean call)")


def shutdown_pools() -> None:
    """Stop every pooled worker (registered with atexit; safe to call any time)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(shutdown_pools)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 180,
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Requires:
        * ``fn`` is a module-level function (picklable by reference; lambdas,
          closures and functions nested in a test do not work), importable
          from the parent's ``sys.path``.
        * ``args``/``kwargs`` are picklable; ``fn``'s return value is picklable
          after tensors in it (nested in lists/tuples/dicts) are detached and
          moved to CPU, which this helper does.
        * ``fn`` does not initialize or destroy the default process group
          (unless ``fresh=True``).

    In each rank, before ``fn``: env vars RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT are set, the gloo
    default process group exists with collective timeout ``timeout``,
    ``torch.manual_seed(0)`` and ``torch.set_num_threads(1)`` have run, and the
    rest of the state listed in the module docstring is reset. The ranks are
    pooled workers reused across calls, or with ``fresh=True`` (or
    ``RUN_RANKS_POOL=0``) new processes used for this call only.

    Ensures:
        * returns the ranks' return values as a list in rank order;
        * if a rank raises or dies, raises :class:`RankError` (a RuntimeError)
          for the rank that failed *first*: its rank and the full formatted
          traceback (or, for a rank that died without reporting, its exit
          code); other ranks failing in a collective because of it are listed
          by their last line. The remaining ranks are killed;
        * if the ranks do not all finish within ``timeout`` seconds (counted
          from this call, including starting workers if needed), dumps the
          live ranks' Python stacks to stderr, kills all, raises RankError;
        * after any failure the pool is discarded (the next call starts fresh
          workers); on every path all killed workers are joined (no zombies).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    fn_name = getattr(fn, "__qualname__", repr(fn))
    task = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    pooled = not fresh and os.environ.get("RUN_RANKS_POOL", "1") != "0"
    deadline = time.monotonic() + timeout
    pool = _POOLS.pop(world_size, None) if pooled else None
    if pool is not None and not pool.alive():
        pool.kill()
        pool = None
        _STATS["discarded"] += 1
    if pool is None:
        pool = _RankPool(world_size, timeout)
        _STATS["pools"] += 1
    _STATS["calls"] += 1
    _STATS["fresh"] += not pooled
    try:
        results = pool.run(fn_name, task, timeout, deadline)
    except BaseException:
        pool.kill()
        _STATS["discarded"] += pooled
        raise
    if pooled and pool.finish():
        _POOLS[world_size] = pool
    else:
        _STATS["discarded"] += pooled
        pool.close()
    return results


def _timing_probe(rank: int, world_size: int) -> float:
    """Trivial rank body for timing: one all_reduce of a scalar."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


if __name__ == "__main__":  # quick timing: python tests/dist_utils.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_utils import _timing_probe, run_ranks  # noqa: E402  (by module name, not __main__)

    for label in ("first call (spawns the pool)", "second call (pooled)", "fresh=True"):
        t0 = time.perf_counter()
        out = run_ranks(_timing_probe, 2, fresh=label.startswith("fresh"))
        print(f"2-rank run_ranks, {label}: {time.perf_counter() - t0:.3f} s, results {out}")
