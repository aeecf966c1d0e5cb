"""Shared pieces of the per-step benchmarks (`bench_step_cost.py`, `bench_dynamic_cost.py`).

The benchmark model and batches, the plain training loop timed by phase, the interleaved
round-robin driver and the machine facts every report starts with. Importing this module also
puts the repository root on ``sys.path``, so the scripts run from a checkout without installing.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import lightning
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lightning_sparse.models.llama import Llama, LlamaConfig  # noqa: E402

LR = 1e-3
PHASES = ("forward", "backward", "optimizer")


def adamw(params: Iterable[torch.Tensor], fused: bool) -> torch.optim.AdamW:
    """The optimizer of every variant: PyTorch's default AdamW, or its fused kernel."""
    return torch.optim.AdamW(params, lr=LR, **({"fused": True} if fused else {}))


def build_model(cfg: LlamaConfig, seed: int) -> Llama:
    torch.manual_seed(seed)  # same seed, same initial weights in every variant
    return Llama(cfg)


def make_batches(cfg: LlamaConfig, n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``n`` random token batches ``[batch, seq + 1]`` (inputs and shifted targets)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator) for _ in range(n)
    ]


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of batch [B, T + 1], as `LitCausalLM.loss` computes it."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def quiet() -> None:
    """Silence Lightning's banner lines and advisory warnings (they are not results)."""
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


class Steppable(Protocol):
    def step(self, batch: torch.Tensor) -> float: ...


class PlainRun:
    """A plain training loop; `step(batch)` runs one optimizer step and returns its seconds.

    Args:
        model: the model, already sparsified (or prepared) if the variant needs it.
        optimizer: AdamW over the model's parameters, with any sparsity hooks installed.
        after_step: called after every optimizer step inside the timed region (torch.ao's
            ``sparsifier.step()``).
        before_step: called between backward and ``optimizer.step()``, inside the timed region
            and timed on its own too (``extra``): a mask update driven by hand.
        prepare: called before each step, outside the timed region.
        clock: seconds, ``time.perf_counter`` (wall clock) or ``time.thread_time`` (CPU time
            of this thread: all of the work when torch runs one thread).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        after_step: Callable[[], Any] | None = None,
        before_step: Callable[[], Any] | None = None,
        prepare: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.net, self.optimizer, self.after_step = model, optimizer, after_step
        self.before_step, self.prepare, self.clock = before_step, prepare, clock
        self.phases: list[tuple[float, float, float]] = []  # seconds per step, as PHASES
        self.extra: list[float] = []  # seconds of before_step per step

    def step(self, batch: torch.Tensor) -> float:
        if self.prepare is not None:
            self.prepare()
        clock = self.clock
        start = clock()
        # 1. forward
        loss = lm_loss(self.net, batch)
        forward = clock()
        # 2. backward (a sparse variant's post-accumulate-grad hooks run here)
        loss.backward()
        backward = clock()
        # 3. optimizer step (sparsity step pre/post hooks run inside it), then clear gradients
        if self.before_step is not None:
            self.before_step()
            self.extra.append(clock() - backward)
        self.optimizer.step()
        if self.after_step is not None:
            self.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        end = clock()
        self.phases.append((forward - start, backward - forward, end - backward))
        return end - start

    def reset_records(self) -> None:
        self.phases.clear()
        self.extra.clear()

    def close(self) -> None:
        pass


def run_interleaved(
    runs: Mapping[str, Steppable],
    batches: list[torch.Tensor],
    warmup: int,
    steps: int,
) -> dict[str, list[float]]:
    """Warm up every run, then time ``steps`` rounds of one step each, rotating the order.

    Rotation spreads background load over the variants alike. Runs with ``reset_records()``
    (`PlainRun`'s phase records) are reset after the warm-up, so records cover the timed rounds.
    """
    names = list(runs)
    for i in range(warmup):
        for name in names:
            runs[name].step(batches[i])
    for run in runs.values():
        reset = getattr(run, "reset_records", None)
        if reset is not None:
            reset()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(steps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(runs[name].step(batches[warmup + r]))
    return times


def median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def min_ms(seconds: list[float]) -> float:
    return 1e3 * min(seconds)


def print_ratio_table(times: Mapping[str, list[float]], baseline: Mapping[str, str]) -> None:
    """One row per variant: median and min ms, and each as a ratio to the row's baseline."""
    med = {name: median_ms(ts) for name, ts in times.items()}
    low = {name: min_ms(ts) for name, ts in times.items()}
    print(f"{'variant':<18} {'median ms':>10} {'ratio':>7} {'min ms':>8} {'min ratio':>9}  vs")
    for name in times:
        base = baseline[name]
        print(
            f"{name:<18} {med[name]:>10.1f} {med[name] / med[base]:>7.3f} {low[name]:>8.1f} "
            f"{low[name] / low[base]:>9.3f}  {base}"
        )


def print_phases(runs: Mapping[str, PlainRun], note: str) -> None:
    """Median ms of each phase of each plain run (``note`` says what the phases include)."""
    print(f"\nplain loops by phase, median ms ({note})")
    print(f"{'variant':<18} " + " ".join(f"{p:>10}" for p in PHASES))
    for name, run in runs.items():
        cols = zip(*run.phases, strict=True)
        print(f"{name:<18} " + " ".join(f"{median_ms(list(c)):>10.1f}" for c in cols))


def machine_facts() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"date {datetime.datetime.now().isoformat(timespec='seconds')}; CPU {cpu!r}, {cores} "
        f"cores visible, torch threads {torch.get_num_threads()}; load average {load_average()}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, lightning "
        f"{lightning.__version__}"
    )


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


__all__ = [
    "LR",
    "PHASES",
    "Llama",
    "LlamaConfig",
    "PlainRun",
    "adamw",
    "build_model",
    "lm_loss",
    "load_average",
    "machine_facts",
    "make_batches",
    "median_ms",
    "min_ms",
    "print_phases",
    "print_ratio_table",
    "quiet",
    "run_interleaved",
]
