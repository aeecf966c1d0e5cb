"""This machine's CPU caches, read once from sysfs: the sizes the kernels' tiles are cut to.

``/sys/devices/system/cpu/cpu0/cache/index*/{level,type,size}`` lists cpu0's caches (Linux); the
first-level data cache, the second level and the last level are what `policy.tile_budgets` and
`policy.decode_stream_copies` read. Where sysfs is absent (another OS, a container without it)
or unreadable, a size is None and the policy falls back to its defaults.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CacheSizes", "cache_sizes", "parse_size"]

_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class CacheSizes:
    """Bytes of cpu0's caches; None where unknown.

    Attributes:
        l1d: the first-level data cache (per core).
        l2: the second level (per core on current x86 and Arm server cores).
        last_level: the largest level found (shared).
    """

    l1d: int | None = None
    l2: int | None = None
    last_level: int | None = None


def parse_size(text: str) -> int | None:
    """Bytes of a sysfs cache size ("48K", "2048K", "480M", "64"), None if it is not one."""
    text = text.strip()
    unit = _UNITS.get(text[-1:].upper(), 1) if text else 1
    number = text.rstrip("KMGkmg")
    return int(number) * unit if number.isdigit() else None


@functools.cache
def cache_sizes(root: Path = _SYSFS) -> CacheSizes:
    """cpu0's cache sizes from ``root`` (sysfs); read once per process and root."""
    found: dict[tuple[int, str], int] = {}
    for index in sorted(root.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if size is not None and kind in ("Data", "Unified"):
            found[(level, kind)] = size
    levels = {level: size for (level, _), size in found.items()}
    return CacheSizes(
        l1d=found.get((1, "Data")) or found.get((1, "Unified")),
        l2=levels.get(2),
        last_level=levels[max(levels)] if levels else None,
    )
