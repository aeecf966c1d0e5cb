"""The CLI's thread choice: one torch thread per idle core, overridable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_sparse.app import threads


def test_one_thread_per_idle_core() -> None:
    assert threads.choose_threads(2, 0.05) == 2  # idle machine
    assert threads.choose_threads(2, 1.0) == 1  # one core busy elsewhere
    assert threads.choose_threads(2, 1.9) == 1  # never fewer than one
    assert threads.choose_threads(4, 1.4) == 3
    assert threads.choose_threads(2, None) == 2  # unknown load: all


def test_busy_cores_from_proc_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two samples of /proc/stat's first line: 50% busy on a 2-core machine = 1 busy core."""
    stat = tmp_path / "stat"
    samples = iter(["cpu 100 0 100 800 0 0 0 0 0 0\n", "cpu 150 0 150 900 0 0 0 0 0 0\n"])
    monkeypatch.setattr(threads, "_cpu_times", lambda path: threads._parse(next(samples)))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    assert threads.busy_cores(stat=stat) == pytest.approx(1.0)


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv(threads.ENV, "1")
    try:
        line = threads.set_threads()
        assert torch.get_num_threads() == 1 and f"{threads.ENV}=1" in line
    finally:
        torch.set_num_threads(before)
