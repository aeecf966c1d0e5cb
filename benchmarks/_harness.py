"""Shared pieces of the per-step benchmarks (`bench_step_cost.py`, `bench_dynamic_cost.py`).

The benchmark model and batches, the plain training loop timed by phase, the interleaved
round-robin driver and the machine facts every report starts with. Importing this module also
puts the repository root on ``sys.path``, so the scripts run from a checkout without installing.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import multiprocessing
import os
import platform
import random
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import lightning
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lightning_sparse.models.llama import Llama, LlamaConfig  # noqa: E402

LR = 1e-3
PHASES = ("forward", "backward", "optimizer")


def loop_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every per-step benchmark shares (model, batch, loop)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=21, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--preset", default="small", help="LlamaConfig preset")
    parser.add_argument(
        "--dim", type=int, default=None, help="override the preset's width (1024: about 50M)"
    )
    return parser


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


class StepGate(pl.Callback):
    """Runs a Trainer one optimizer step at a time on the driver's signal, timing each step.

    The trainer thread parks in ``on_train_batch_end`` (and before the first batch) until the
    driver releases it, so the loop's own work between batches (fetching the next batch) runs
    while the driver waits, never beside another variant's timed step. Put it last in the
    callbacks, so every other callback's batch-end work is inside the timed step.

    Args:
        clock: seconds, read in the trainer thread (``time.thread_time`` = that thread's CPU).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.ready = threading.Semaphore(0)  # trainer -> driver: reached the first batch
        self.go = threading.Semaphore(0)  # driver -> trainer: run one step
        self.done = threading.Semaphore(0)  # trainer -> driver: step finished (or fit failed)
        self.elapsed, self.started, self._start = 0.0, False, 0.0
        self.error: BaseException | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.started:
            self.started = True
            self.ready.release()
            self.go.acquire()
        self._start = self.clock()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.elapsed = self.clock() - self._start
        self.done.release()
        self.go.acquire()


class SteppedFit:
    """``Trainer.fit(module)`` on ``batches`` in a background thread, one step per `step()`.

    Args:
        module: the LightningModule.
        callbacks: the run's callbacks (a `StepGate` is appended).
        batches: the training batches, in order (one per step).
        clock: see `StepGate`.
        **trainer_kwargs: e.g. ``accelerator``; single-device, no logger, checkpoints or bars.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        callbacks: list[pl.Callback],
        batches: list[torch.Tensor],
        clock: Callable[[], float] = time.perf_counter,
        **trainer_kwargs: Any,
    ) -> None:
        self.gate = StepGate(clock)
        self.module = module
        self.trainer = pl.Trainer(
            callbacks=[*callbacks, self.gate],
            devices=1,
            max_steps=len(batches),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **trainer_kwargs,
        )
        self.loader = DataLoader(batches, batch_size=None, shuffle=False)
        self.finished = False  # ``fit`` returned
        self.thread: threading.Thread | None = None
        if not _fit_deferred:  # else `IsolatedRun`'s process runs `fit_here` in its main thread
            self.thread = threading.Thread(target=self._fit, args=(self.loader,), daemon=True)
            self.thread.start()
            self._wait(self.gate.ready)

    def fit_here(self) -> None:
        """Run ``fit`` in the calling thread (while another thread steps it)."""
        self._fit(self.loader)

    def _fit(self, loader: DataLoader) -> None:
        try:
            self.trainer.fit(self.module, train_dataloaders=loader)
        except BaseException as error:  # noqa: BLE001 - handed to the driver thread
            self.gate.error = error
        finally:
            self.finished = True
            self.gate.ready.release()
            self.gate.done.release()

    def _wait(self, semaphore: threading.Semaphore) -> None:
        semaphore.acquire()
        if self.gate.error is not None:
            raise RuntimeError("a Trainer run failed") from self.gate.error

    def step(self, batch: torch.Tensor) -> float:
        """One optimizer step (the trainer draws the same ``batch`` from its loader)."""
        self.gate.go.release()
        self._wait(self.gate.done)
        return self.gate.elapsed

    def close(self) -> None:
        self.gate.go.release()  # let the parked trainer leave its last step and finish
        if self.thread is not None:
            self.thread.join(timeout=120)


class IsolatedRun:
    """A run built and stepped in a process of its own (spawned), driven over a pipe, so that
    variants interleaved by `run_interleaved` still share nothing but the machine.

    A Trainer parked in a thread of the measuring process is not free (measured, not explained:
    most likely each thread that runs torch ops keeps its own OpenMP team, and with more OpenMP
    threads than cores GNU OpenMP stops spinning between parallel regions, so each of the
    thousands of small ops of every other variant's step pays a wake-up; benchmarks/README.md,
    the first row, says what it did to `bench_step_cost.py`). Here each process has one thread
    running torch, as a user's training has.

    Args:
        factory: builds the run in the child (a module-level callable: it is pickled by name).
        args: ``factory``'s arguments (picklable: configs, tensors, builtin clocks).
        threads: ``torch.set_num_threads`` in the child.
        summary: ``summary(run)`` in the child after ``run.close()``, a picklable dict kept as
            ``self.summary`` (what the driver reads of the run afterwards).
    """

    def __init__(
        self,
        factory: Callable[..., Any],
        args: tuple[Any, ...],
        threads: int,
        summary: Callable[[Any], dict[str, Any]] | None = None,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve_run, args=(child, factory, args, threads, summary), daemon=True
        )
        self._process.start()
        child.close()
        self.summary: dict[str, Any] = {}
        self._receive()

    def _receive(self) -> Any:
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"an isolated run failed in its process: {value}")
        return value

    def step(self, batch: torch.Tensor) -> float:
        self._conn.send(("step", batch))
        return float(self._receive())

    def reset_records(self) -> None:
        self._conn.send(("reset", None))
        self._receive()

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("close", None))
            self.summary = self._receive()
            self._process.join(timeout=120)


# Set in an `IsolatedRun`'s process: a `SteppedFit` built there does not start its own thread;
# the process's main thread runs its ``fit`` (`fit_here`), the thread that torch's OpenMP team
# and the device's kernels were set up in, while a thread that runs no torch op steps it.
_fit_deferred = False


def _serve_run(
    conn: Any,
    factory: Callable[..., Any],
    args: tuple[Any, ...],
    threads: int,
    summary: Callable[[Any], dict[str, Any]] | None,
) -> None:
    """The child of an `IsolatedRun`: build the run, then step / reset / close it on request.
    One thread runs torch: this one (a plain loop is stepped here; a Trainer's ``fit`` runs here
    while the requests are served from a thread that runs no torch op)."""
    global _fit_deferred
    _fit_deferred = True
    torch.set_num_threads(threads)
    quiet()
    try:
        run = factory(*args)
    except BaseException as error:  # noqa: BLE001 - reported to the driver, which raises
        conn.send(("error", f"{type(error).__name__}: {error}"))
        return
    if not isinstance(run, SteppedFit):
        _serve(conn, run, summary)
        return
    server = threading.Thread(target=_serve, args=(conn, run, summary, run.gate.ready), daemon=True)
    server.start()
    run.fit_here()
    server.join()


def _serve(
    conn: Any,
    run: Any,
    summary: Callable[[Any], dict[str, Any]] | None,
    ready: threading.Semaphore | None = None,
) -> None:
    """Answer ``step`` / ``reset`` / ``close`` requests on ``conn`` until ``close``."""
    try:
        if ready is not None:
            run._wait(ready)  # the Trainer reached its first batch
        conn.send(("ready", None))
        while True:
            command, payload = conn.recv()
            if command == "step":
                conn.send(("ok", run.step(payload)))
            elif command == "reset":
                reset = getattr(run, "reset_records", None)
                if reset is not None:
                    reset()
                conn.send(("ok", None))
            else:
                if ready is None:
                    run.close()
                while ready is not None and not run.finished:  # let ``fit`` return, step by step
                    run.gate.go.release()
                    run.gate.done.acquire()
                conn.send(("ok", summary(run) if summary is not None else {}))
                return
    except BaseException as error:  # noqa: BLE001 - reported to the driver, which raises
        conn.send(("error", f"{type(error).__name__}: {error}"))
        if ready is not None:
            run.gate.go.release()  # let a parked ``fit`` end


def run_interleaved(
    runs: Mapping[str, Steppable],
    batches: list[torch.Tensor],
    warmup: int,
    steps: int,
    progress: Callable[[str], object] | None = None,
) -> dict[str, list[float]]:
    """Warm up every run, then time ``steps`` rounds of one step each, in a new order each round
    (a permutation from a fixed seed).

    The order spreads background load over the variants alike, and no variant always follows the
    same one: a step after another process's (`IsolatedRun`) finds cold caches and sleeping
    threads, which a rotation would have charged to the same variant every round. Runs with
    ``reset_records()``
    (`PlainRun`'s phase records) are reset after the warm-up, so records cover the timed rounds.
    ``progress``, if given, is told the seconds of each warm-up step (the first compiles) and of
    every tenth timed round, so a run stopped at a time limit says where it was.
    """
    names = list(runs)
    for i in range(warmup):
        for name in names:
            began = time.perf_counter()
            runs[name].step(batches[i])
            if progress is not None:
                progress(f"warm-up {i + 1}/{warmup} {name}: {time.perf_counter() - began:.2f} s")
    for run in runs.values():
        reset = getattr(run, "reset_records", None)
        if reset is not None:
            reset()
    times: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for r in range(steps):
        for name in order.sample(names, len(names)):
            times[name].append(runs[name].step(batches[warmup + r]))
        if progress is not None and ((r + 1) % 10 == 0 or r + 1 == steps):
            progress(f"timed round {r + 1}/{steps}")
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
