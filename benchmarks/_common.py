"""Helpers shared by the benchmark scripts: repo path, interleaved timing rounds, medians, tables.

Every benchmark measures its contenders in the same run and interleaves them:
round ``r`` runs each contender once, in an order rotated by ``r``, so slow
drift of a shared, noisy machine (other jobs starting and stopping) hits every
contender alike. Results are medians over rounds; ratios are medians of the
per-round ratios (each computed from two measurements taken seconds apart).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOCS = os.path.join(ROOT, "docs")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def rotated(items: Sequence[Any], r: int) -> list[Any]:
    """``items`` rotated left by ``r`` (round ``r``'s running order)."""
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def interleaved(contenders: Mapping[str, Callable[[], float]], rounds: int,
                before_each: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Run ``rounds`` rounds; in each, call every contender once (rotated order); collect what it returns."""
    names = list(contenders)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in rotated(names, r):
            if before_each is not None:
                before_each()
            out[n].append(float(contenders[n]()))
    return out


def ratio_median(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of the per-round ratios ``num[i] / den[i]``."""
    return median([a / b for a, b in zip(num, den)])


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain-text table with right-aligned numbers."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def git_commit() -> str:
    """The repository's HEAD, with ``+dirty`` when fxshard/ has uncommitted changes ("" outside git)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "fxshard"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "load_avg_at_start": list(os.getloadavg()), "commit": git_commit()}


def write_json(name: str, data: Any) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return path


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Stopwatch:
    """``with Stopwatch() as sw: ...``; then ``sw.s`` is the wall time in seconds."""

    def __enter__(self) -> "Stopwatch":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = time.perf_counter() - self.t0


def load_result(name: str):
    """The JSON a benchmark wrote to ``benchmarks/results/<name>``, or None if it has not run yet."""
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
