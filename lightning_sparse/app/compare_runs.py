"""The runs of `lightning-sparse compare`: one ``lightning-sparse fit`` process per method and
seed, several at once where cores allow, each reused when it finished with the same command.

Run ``(method, seed)`` lives in ``<out>/<method>/seed_<seed>/``: the recipe's relative output
paths land there, with ``summary.json`` (the run's summary), ``run.json`` (written when the run
finished: its command), ``attempt.json`` (the command of the attempt under way) and ``fit.log``
(its output). A finished run is read back, not trained again; an interrupted one (same command in
``attempt.json``) continues from its last checkpoint with ``--ckpt_path last``.

The command sets ``--seed_everything <seed>``, which seeds the model's initialization, the data
order (`ByteTextDataModule`'s ``seed=None``) and the masks (the algorithms' ``seed=None``)
together. A W&B logger puts the run in group ``<method>`` (``WANDB_RUN_GROUP``; job type
``fit``, tag ``seed_<seed>``), so W&B groups the seeds of one method.

Parallel runs split the cores: ``--jobs K`` processes with ``cores // K`` torch threads each
(``LIGHTNING_SPARSE_THREADS``, unless you set it or ``OMP_NUM_THREADS``). Two threads per run
thrash beside another busy core (`lightning_sparse.app.threads`), so the default is one process
per idle core.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sparse.app.common import RUN_ENV
from lightning_sparse.app.threads import ENV as THREADS_ENV
from lightning_sparse.app.threads import busy_cores, choose_threads

__all__ = ["Run", "default_jobs", "fit_command", "plan_runs", "run_all", "run_threads"]


@dataclass
class Run:
    """One training run of a comparison: ``method`` with ``seed``, in ``run_dir``."""

    method: str
    seed: int
    recipe: Path
    run_dir: Path
    command: list[str]
    summary: dict[str, Any] | None = None
    seconds: float | None = None
    reused: bool = False

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def record_path(self) -> Path:
        return self.run_dir / "run.json"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "fit.log"

    @property
    def label(self) -> str:
        return f"{self.method} seed {self.seed}"

    def record(self) -> dict[str, Any]:
        """What ``comparison.json`` keeps of the run (its summary included)."""
        return {
            "name": self.method,
            "seed": self.seed,
            "command": self.command,
            "run_dir": str(self.run_dir),
            "process_time_s": self.seconds,
            "summary": self.summary,
        }


def fit_command(
    recipe: Path, summary_path: Path, seed: int, steps: int | None, extra: list[str]
) -> list[str]:
    """The ``lightning-sparse fit`` command of one run (``extra``: overrides for every run)."""
    command = ["lightning-sparse", "fit", "--config", str(recipe)]
    command += ["--summary.path", str(summary_path), "--seed_everything", str(seed)]
    if steps is not None:
        command += ["--trainer.max_steps", str(steps)]
        command += ["--trainer.val_check_interval", str(max(1, steps // 10))]
    return command + list(extra)


def plan_runs(
    recipes: dict[str, Path], seeds: list[int], out: Path, steps: int | None, extra: list[str]
) -> list[Run]:
    """Every ``(method, seed)`` run, seed by seed (so the first seed of every method, which
    the paired differences need, comes first)."""
    runs = []
    for seed in seeds:
        for method, recipe in recipes.items():
            run_dir = out / method / f"seed_{seed}"
            command = fit_command(recipe, run_dir / "summary.json", seed, steps, extra)
            runs.append(Run(method, seed, recipe, run_dir, command))
    return runs


def reuse_finished(run: Run) -> bool:
    """Load ``run``'s summary if it finished with the same command (``run.json``); True then."""
    if not (run.summary_path.is_file() and run.record_path.is_file()):
        return False
    record = json.loads(run.record_path.read_text())
    if record.get("command") != run.command:
        return False
    run.summary = json.loads(run.summary_path.read_text())
    run.seconds, run.reused = record.get("process_time_s"), True
    return True


def available_cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_jobs(pending: int) -> int:
    """One process per idle core (at least one), at most ``pending``."""
    return max(1, min(pending, choose_threads(available_cores(), busy_cores())))


def run_threads(jobs: int) -> tuple[int, str]:
    """Torch threads per run and why: ``LIGHTNING_SPARSE_THREADS`` or ``OMP_NUM_THREADS`` when
    set (`child_env` passes them on unchanged), else the cores shared by the ``jobs`` runs."""
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value), f"{name}={value}"
    cores = available_cores()
    return max(1, cores // jobs), f"{cores} core(s) / {jobs}"


def child_env(method: str, seed: int, threads: int) -> dict[str, str]:
    """The environment of one run: its torch threads and its W&B group, job type and tag. Each
    run is a fit of its own: a run directory decided by a fit in this process (`RUN_ENV`, meant
    for its DDP workers) is not passed on."""
    env = dict(os.environ)
    env.pop(RUN_ENV, None)
    if not (env.get(THREADS_ENV) or env.get("OMP_NUM_THREADS")):
        env[THREADS_ENV] = str(threads)
    env["WANDB_RUN_GROUP"] = method
    env["WANDB_JOB_TYPE"] = "fit"
    env["WANDB_TAGS"] = f"seed_{seed}"
    return env


@contextmanager
def _terminate_on_exit(running: dict[int, tuple[Run, subprocess.Popen, float]]) -> Iterator[None]:
    """SIGTERM ends ``compare`` through ``finally`` (Python's default would skip it), and the
    runs still going are ended with it; their finished neighbours stay finished."""
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        for _, process, _ in running.values():
            if process.poll() is None:
                process.terminate()
        for _, process, _ in running.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def resumable(run: Run) -> Path | None:
    """The checkpoint an interrupted attempt of ``run`` left (same command, ``attempt.json``),
    or None: ``--ckpt_path last`` continues it (`lightning_sparse.app.run_dirs`)."""
    attempt = run.run_dir / "attempt.json"
    if not attempt.is_file() or json.loads(attempt.read_text()).get("command") != run.command:
        return None
    found = sorted(run.run_dir.rglob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _start(run: Run, threads: int, force: bool) -> subprocess.Popen:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    run.summary_path.unlink(missing_ok=True)
    run.record_path.unlink(missing_ok=True)
    argv = run.command[1:]
    checkpoint = None if force else resumable(run)
    if checkpoint is not None:  # an interrupted attempt: continue it, bit for bit
        print(f"compare: {run.label}: resuming from {checkpoint}", flush=True)
        argv = [*argv, "--ckpt_path", "last"]
    (run.run_dir / "attempt.json").write_text(json.dumps({"command": run.command}) + "\n")
    python = [sys.executable, "-m", "lightning_sparse.app.cli"]
    log = open(run.log_path, "a" if checkpoint else "w")  # noqa: SIM115  (the child holds it)
    process = subprocess.Popen(
        python + argv,
        cwd=run.run_dir,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env(run.method, run.seed, threads),
    )
    log.close()  # the child holds its own copy of the file descriptor
    return process


def _finish(run: Run, code: int, seconds: float) -> str | None:
    """Record a run that ended; the failure message, or None."""
    if code != 0 or not run.summary_path.is_file():
        tail = run.log_path.read_text(errors="replace").splitlines()[-15:]
        return f"{run.label} failed (exit code {code}); the end of {run.log_path}:\n" + "\n".join(
            f"    {line}" for line in tail
        )
    run.summary, run.seconds = json.loads(run.summary_path.read_text()), seconds
    record = {"name": run.method, "seed": run.seed, "command": run.command}
    run.record_path.write_text(json.dumps({**record, "process_time_s": seconds}, indent=1) + "\n")
    return None


def run_all(runs: list[Run], jobs: int | None = None, force: bool = False) -> list[str]:
    """Train every run not finished already, ``jobs`` at a time; returns the failures.

    Finished runs (``summary.json`` and ``run.json`` from the same command) are read back, and
    interrupted ones continue from their last checkpoint (`resumable`), unless ``force``. A
    failed run does not stop the others.
    """
    pending = [run for run in runs if force or not reuse_finished(run)]
    for run in runs:
        if run.reused:
            print(f"compare: {run.label}: reusing the finished run in {run.run_dir}")
    if not pending:
        return []
    jobs = default_jobs(len(pending)) if jobs is None else max(1, min(jobs, len(pending)))
    threads, why = run_threads(jobs)
    print(
        f"compare: {len(pending)} run(s) to train, {jobs} at a time, {threads} torch thread(s) "
        f"each ({why}); each run's output goes to <run dir>/fit.log",
        flush=True,
    )
    failures: list[str] = []
    running: dict[int, tuple[Run, subprocess.Popen, float]] = {}
    done = len(runs) - len(pending)
    with _terminate_on_exit(running):
        while pending or running:
            while pending and len(running) < jobs:
                run = pending.pop(0)
                print(f"compare: {run.label}: {' '.join(run.command)}", flush=True)
                process = _start(run, threads, force)
                running[process.pid] = (run, process, time.perf_counter())
            time.sleep(0.2)
            for pid, (run, process, start) in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                del running[pid]
                done += 1
                failure = _finish(run, code, time.perf_counter() - start)
                if failure:
                    failures.append(failure)
                    print(f"compare: {failure}", flush=True)
                else:
                    loss = (run.summary or {}).get("val", {}).get("loss")
                    shown = "n/a" if loss is None else f"{loss:.4f}"
                    print(
                        f"compare: [{done}/{len(runs)}] {run.label} finished in "
                        f"{run.seconds:.0f} s (val loss {shown})",
                        flush=True,
                    )
    return failures
