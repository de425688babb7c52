"""Progress messages of long work (``shard()`` tracing and sharding a large model)."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, Union

import torch.distributed as dist

__all__ = ["Progress", "reporter"]

Progress = Optional[Union[Callable[[str], None], bool]]


def _quiet(msg: str) -> None:
    pass


def reporter(progress: Progress) -> Callable[[str], None]:
    """What to call with each stage's message. ``progress`` is a callable (used as is), ``False`` (silent),
    ``True`` (timestamped lines on stderr), or ``None``, the default: like ``True`` when stderr is a terminal
    and this is rank 0 (or no process group exists), so interactive runs show progress while tests, logs
    and the other ranks stay quiet."""
    if callable(progress):
        return progress
    if progress is None:
        progress = sys.stderr.isatty() and (not dist.is_initialized() or dist.get_rank() == 0)
    if not progress:
        return _quiet
    start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"fxshard [{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return say
