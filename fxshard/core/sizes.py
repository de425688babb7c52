"""Memory sizes as users write them (``"8GiB"``, ``512 * 2**20``) and as messages print them."""

from __future__ import annotations

import re
from typing import Optional, Union

from .errors import ShardingError

__all__ = ["parse_bytes", "fmt_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Union[int, float, str, None], name: str) -> Optional[int]:
    """Bytes from ``value``: a positive number of bytes, or a string like ``"8GiB"``, ``"512 MiB"``,
    ``"1.5GB"`` (None stays None). Anything else is a ShardingError naming the argument ``name``."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ShardingError(f"{name}={value!r} is not a memory size; give bytes per rank as a positive "
                            f"number or a string such as '8GiB', '512MiB' or '1.5GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """``n`` bytes as ``"12 B"``, ``"3.50 MiB"``, ``"1.25 GiB"``."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
