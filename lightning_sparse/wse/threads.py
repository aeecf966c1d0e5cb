"""How many threads the device's kernels use: torch's count, less the cores others keep busy.

A parallel region waits for its slowest thread; beside another process that keeps a core busy,
a thread sharing that core runs at a fraction of its speed and stalls every region it is in (and
OpenMP threads spinning at a barrier take time from the core they share). So each kernel call asks
`kernel_threads()`: every ``INTERVAL`` seconds it samples ``/proc/stat`` (all CPUs' busy time)
and this process's own CPU time, takes the difference as the cores other processes keep busy,
and `policy.kernel_threads` turns that into a count. The kernels' results do not depend on the
thread count (fixed token ranges and summation order), so the policy changes speed only.

``LIGHTNING_SPARSE_WSE_THREADS=fixed`` (read once per process) always uses torch's count.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from lightning_sparse.wse import policy

__all__ = ["ENV", "INTERVAL", "LoadMonitor", "kernel_threads"]

ENV = "LIGHTNING_SPARSE_WSE_THREADS"
"""Set to "fixed" to run every kernel on torch's thread count."""
INTERVAL = 0.5
"""Seconds between two samples of the machine's load."""
_STAT = Path("/proc/stat")


def _busy_seconds(text: str) -> float | None:
    """CPU-seconds all CPUs spent busy (``/proc/stat``'s first line, all but idle and iowait)."""
    fields = [int(v) for v in text.split("\n", 1)[0].split()[1:9]]
    if len(fields) < 5:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (sum(fields) - fields[3] - fields[4]) / ticks


class LoadMonitor:
    """The cores other processes keep busy, sampled at most every ``interval`` seconds.

    Args:
        stat: the ``/proc/stat`` file (tests pass another).
        interval: seconds between samples.
    """

    def __init__(self, stat: Path = _STAT, interval: float = INTERVAL) -> None:
        self.stat, self.interval = stat, interval
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.others: float | None = None  # cores busy with other processes, last window
        self._last: tuple[float, float, float] | None = None  # (wall, all busy, own CPU)
        self._free = 1 << 30  # threads the last sample allows
        self._next = 0.0  # when to sample again

    def sample(self) -> float | None:
        """Update ``others`` if ``interval`` passed since the last sample; return it."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.others
        try:
            busy = _busy_seconds(self.stat.read_text())
        except (OSError, ValueError):
            busy = None
        if busy is None:
            return self.others
        own = time.process_time()
        if self._last is not None and now > self._last[0]:
            wall = now - self._last[0]
            others = (busy - self._last[1] - (own - self._last[2])) / wall
            self.others = min(max(others, 0.0), float(os.cpu_count() or self.cpus))
        self._last = (now, busy, own)
        return self.others

    def threads(self) -> int:
        """Threads for a kernel call now (`policy.kernel_threads` of torch's current count; the
        load is re-sampled at most every ``interval`` seconds, a few microseconds otherwise)."""
        requested = torch.get_num_threads()
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            self._free = policy.kernel_threads(1 << 30, self.cpus, self.sample())
        return max(1, min(requested, self._free))


_MONITOR = LoadMonitor()
_FIXED = os.environ.get(ENV, "") == "fixed"


def kernel_threads() -> int:
    """The thread count of the device's next kernel call (see the module docstring)."""
    if _FIXED:
        return torch.get_num_threads()
    return _MONITOR.threads()
