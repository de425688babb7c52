"""MILPs solved by HiGHS (``scipy.optimize.milp``) in a child process, so that a solver crash cannot corrupt the caller.

HiGHS's MIP search has had heap-corruption bugs (e.g. FlexMeasures issue 2527: aborts in HiGHS 1.12 and
1.15 that depend on the search path, hence on time limits and load). Inside a rank a corrupted heap does not
fail the solve: it aborts the rank later, at some unrelated ``malloc`` ("unaligned tcache chunk detected"),
and its peers then fail on a closed connection. So the planner's MILPs run in long-lived child processes
(``milp_child.py``: numpy and scipy only), one per solve running at once (threads solving at the same time
each get their own, so their MILPs run in parallel), started on first use or by :func:`prestart`, reused,
and ended when this process ends. A child that dies mid-solve is replaced and the problem solved once more with
presolve off (another search path); a second death is a :class:`~fxshard.core.errors.ShardingError`.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..core.errors import ShardingError

__all__ = ["Result", "solve", "prestart", "trim", "stop"]

LOG = logging.getLogger("fxshard.planner.milp")
_SCRIPT = Path(__file__).with_name("milp_child.py")
_LOCK = threading.Lock()
_idle: list[subprocess.Popen] = []  # started children no solve is using
_inherited: list[subprocess.Popen] = []  # a forked process's copy of its parent's children: never used, never ended
# HiGHS options beyond scipy's five, passed to HiGHS verbatim (dropped where this scipy's HiGHS lacks one). The
# planner's MILPs close their gap in a few nodes; the RINS/RENS sub-MIPs at the root took a third of each solve
# of auto-sharding's budgeted 1-layer Llama (66 s against 99 s for its first 4 MILPs, the same plans) and
# nothing measurable on the 8B-shape auto plan's 23 MILPs (66 s both ways).
HIGHS_TUNING: dict[str, Any] = {"mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False}


def _after_fork_in_child() -> None:
    """A forked process must not talk to its parent's children (their pipes carry the parent's requests) nor
    end them at exit: it starts its own."""
    global _LOCK
    _LOCK = threading.Lock()
    _inherited.extend(_idle)
    _idle.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class Result:
    """What ``scipy.optimize.milp`` returned: ``x`` (None when no solution was found), HiGHS's ``status``
    (0 optimal, 1 time or iteration limit), ``success``, ``message`` and the relative ``mip_gap``."""

    x: Any
    status: int
    success: bool
    message: str
    mip_gap: Optional[float]


def _command() -> list[str]:
    # -P: the script's directory (fxshard/, holding e.g. inspect.py) must not shadow the standard library
    return [sys.executable, "-P", str(_SCRIPT)]


def _start() -> subprocess.Popen:
    return subprocess.Popen(_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _take() -> subprocess.Popen:
    """An idle live child, or a new one; the caller owns it until :func:`_give_back` or :func:`_discard`."""
    with _LOCK:
        while _idle:
            child = _idle.pop()
            if child.poll() is None:
                return child
            _discard(child)
    return _start()


def _give_back(child: subprocess.Popen) -> None:
    with _LOCK:
        _idle.append(child)


def _discard(child: subprocess.Popen) -> str:
    """Kill ``child`` if it still runs, close its pipes, and say how it ended (it must not be idle)."""
    if child.poll() is None:
        child.kill()
    code = child.wait()
    for pipe in (child.stdin, child.stdout):
        try:
            pipe.close()
        except OSError:
            pass
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def prestart() -> None:
    """Start the solver's process now, so that its imports (about half a second) overlap the caller's work.

    Ensures: an idle child exists (unless starting one raised OSError, which the first solve reports)."""
    with _LOCK:
        if any(child.poll() is None for child in _idle):
            return
    try:
        _give_back(_start())
    except OSError:
        pass


def trim(keep: int) -> None:
    """End idle children beyond ``keep`` (after a burst of parallel solves). Requires ``keep >= 0``."""
    with _LOCK:
        extra = _idle[keep:]
        del _idle[keep:]
    for child in extra:
        _discard(child)


def stop() -> None:
    """End every idle child (a child in use ends when its solve returns and this process ends)."""
    trim(0)


atexit.register(stop)


def _sent(request: dict) -> subprocess.Popen:
    """A child that has been sent ``request``. A child that died while idle (e.g. the OOM killer) fails on
    the send, before reading anything: it is replaced once, and its death is not this problem's."""
    for attempt in range(2):
        try:
            child = _take()
        except OSError as e:
            raise ShardingError(f"the global planner could not start its MILP solver's process "
                                f"({' '.join(_command())}: {e}); use planner='greedy'") from e
        try:
            pickle.dump(request, child.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            child.stdin.flush()
            return child
        except OSError as e:
            how = _discard(child)
            if attempt:
                raise ShardingError(f"the global planner could not send a MILP to its solver's process (it "
                                    f"{how}: {e}); use planner='greedy', and please report it") from e
        except BaseException:
            _discard(child)
            raise
    raise AssertionError("unreachable")


def solve(cost: Sequence[float], integer: Sequence[int], lb: Sequence[float], ub: Sequence[float],
          rows: Sequence[int], cols: Sequence[int], coef: Sequence[float], row_lb: Sequence[float],
          row_ub: Sequence[float], options: dict[str, Any]) -> Result:
    """Minimise ``cost @ x`` subject to ``lb <= x <= ub``, ``row_lb <= A @ x <= row_ub`` (``A[rows[k], cols[k]] =
    coef[k]``, duplicates summed) and ``x[i]`` integral where ``integer[i]``, with ``scipy.optimize.milp``'s
    ``options`` and HiGHS's :data:`HIGHS_TUNING`, in the solver's process.

    Ensures: the result scipy would give in this process. Raises ShardingError when scipy does not import
    in the solver's process, when building or solving raised there, or when the process died on the
    problem twice (the second time with presolve off)."""
    req = {"cost": cost, "integer": integer, "lb": lb, "ub": ub, "rows": rows, "cols": cols, "coef": coef,
           "row_lb": row_lb, "row_ub": row_ub, "highs": HIGHS_TUNING}
    deaths: list[str] = []
    for opts in (options, {**options, "presolve": False}):
        child = _sent({**req, "options": opts})
        try:
            reply = pickle.load(child.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            deaths.append(_discard(child))
            continue
        except BaseException:  # e.g. KeyboardInterrupt: the child's next reply would answer this request
            _discard(child)
            raise
        _give_back(child)
        if "import_error" in reply:
            raise ShardingError(f"planner='global' solves a MILP with HiGHS through scipy, which does not import in "
                                f"the solver's process `{' '.join(_command())}` ({reply['import_error']}); pip install "
                                f"'scipy>=1.11' (a dependency of fxshard) for that interpreter, or use planner='greedy'")
        if "error" in reply:
            raise ShardingError(f"internal: the global planner's MILP raised in scipy ({reply['error']}); use "
                                f"planner='greedy' and please report this model")
        if deaths:
            LOG.warning("the MILP solver's process %s on a problem of %d variables and %d rows; solved again "
                        "with presolve off", deaths[0], len(cost), len(row_lb))
        return Result(**reply)
    raise ShardingError(f"the global planner's MILP solver (HiGHS via scipy) crashed twice on a problem of "
                        f"{len(cost)} variables and {len(row_lb)} rows (its process {'; then '.join(deaths)}; this "
                        f"process is unharmed); use planner='greedy', and please report the model")
