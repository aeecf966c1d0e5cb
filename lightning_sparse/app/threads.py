"""How many torch threads the `lightning-sparse` command uses: the cores that are idle now.

Two torch threads on two cores train the main job about 1.5x faster than one, but beside a
process that keeps one core busy, OpenMP's spin-waiting makes them many times slower than one
thread (issue 11; ``benchmarks/bench_threads.py`` measures it). So the command samples the
machine once at start (``/proc/stat`` over 0.25 s) and runs one thread per idle core.
``LIGHTNING_SPARSE_THREADS=N`` (or ``OMP_NUM_THREADS``) overrides the choice. Only the CLI does
this; importing the package changes nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["busy_cores", "choose_threads", "set_threads"]

ENV = "LIGHTNING_SPARSE_THREADS"


def _parse(text: str) -> tuple[int, int]:
    """(idle + iowait, total) jiffies of all CPUs from ``/proc/stat``'s first line."""
    fields = [int(v) for v in text.split("\n", 1)[0].split()[1:]]
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])


def _cpu_times(stat: Path) -> tuple[int, int]:
    return _parse(stat.read_text())


def busy_cores(interval: float = 0.25, stat: Path = Path("/proc/stat")) -> float | None:
    """Cores kept busy by other processes over ``interval`` seconds, or None where unknown."""
    try:
        idle0, total0 = _cpu_times(stat)
        time.sleep(interval)
        idle1, total1 = _cpu_times(stat)
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def choose_threads(available: int, busy: float | None) -> int:
    """One thread per idle core (a core counts as busy from 0.5 of it used), at least one."""
    if busy is None:
        return available
    return max(1, min(available, available - round(busy)))


def set_threads() -> str:
    """Set torch's intra-op threads for this run; returns the line the CLI prints (on stderr:
    stdout carries the command's results, e.g. ``--print_config``'s YAML)."""
    import torch  # here, not at the top: `busy_cores` serves `compare`, which never loads torch

    if os.environ.get(ENV):
        n = int(os.environ[ENV])
        why = f"{ENV}={n}"
    elif os.environ.get("OMP_NUM_THREADS"):
        n = torch.get_num_threads()
        why = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    else:
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        available = min(available, torch.get_num_threads())
        busy = busy_cores()
        n = choose_threads(available, busy)
        why = (
            f"{available - n} of {available} cores busy at start"
            if busy is not None
            else "machine load unknown"
        )
    torch.set_num_threads(n)
    os.environ[f"{ENV}_CHOSEN"] = str(n)
    return f"lightning-sparse: {n} torch thread(s) ({why}; {ENV}=N to choose)"
