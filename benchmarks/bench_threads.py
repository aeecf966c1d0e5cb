"""Training speed of the main job under thread settings, idle and beside a busy core.

Runs ``lightning-sparse fit --trainer.max_steps 200`` (the default recipe, validation off, CSV
logger, at most 90 s of training) in a fresh process per setting, with a `StepTimer` callback that
measures steps/s from step 20 to the last one, (a) with nothing else running and (b) beside one
busy-looping process pinned to CPU 0 (``taskset -c 0``). Settings: the CLI's own choice
(``auto``: see ``lightning_sparse.app.threads``), two threads with the default OpenMP wait
policy, two threads with ``OMP_WAIT_POLICY=PASSIVE``, and one thread. Goals on 2 cores (issue
11): (a) no slower than two default threads on the idle machine; (b) at least 70% of (a) beside
the busy process. Results: benchmarks/README.md.

    python benchmarks/bench_threads.py [--steps 200] [--settings auto,default,passive,one]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

HERE = Path(__file__).resolve().parent
SETTINGS: dict[str, dict[str, str]] = {
    "auto": {},
    "default": {"LIGHTNING_SPARSE_THREADS": "2"},
    "passive": {"LIGHTNING_SPARSE_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "one": {"LIGHTNING_SPARSE_THREADS": "1"},
}


class StepTimer(pl.Callback):
    """Writes steps/s between step 20 and the last step to ``$STEP_TIMER_OUT``."""

    def __init__(self) -> None:
        self.start: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        now = (trainer.global_step, time.perf_counter())
        if self.start is None and trainer.global_step >= 20:
            self.start = now
        self.last = now

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.start is None or self.last is None or self.last[0] == self.start[0]:
            return
        rate = (self.last[0] - self.start[0]) / (self.last[1] - self.start[1])
        threads = int(os.environ.get("LIGHTNING_SPARSE_THREADS_CHOSEN", "0"))
        Path(os.environ["STEP_TIMER_OUT"]).write_text(
            json.dumps({"steps_per_s": rate, "threads": threads})
        )


def run_fit(setting: str, steps: int, busy: bool) -> dict[str, float]:
    """One fit in a fresh process; returns its StepTimer figures."""
    cli = shutil.which("lightning-sparse") or str(Path(sys.executable).parent / "lightning-sparse")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rate.json"
        env = {**os.environ, **SETTINGS[setting], "STEP_TIMER_OUT": str(out)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        env.setdefault("WANDB_MODE", "offline")
        hog = None
        if busy:
            hog = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
            time.sleep(1.0)
        try:
            subprocess.run(
                [
                    cli,
                    "fit",
                    f"--trainer.max_steps={steps}",
                    "--trainer.limit_val_batches=0",
                    "--trainer.logger=CSVLogger",
                    "--trainer.logger.save_dir=.",
                    "--trainer.callbacks+=bench_threads.StepTimer",
                ],
                cwd=tmp,
                env=env,
                check=True,
                capture_output=True,
                text=True,
                timeout=1800,
            )
        except subprocess.CalledProcessError as err:
            sys.exit(f"bench_threads: {setting} failed:\n{err.stderr[-3000:]}")
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--settings", default="auto,default,passive,one")
    args = parser.parse_args()
    settings = args.settings.split(",")
    print(
        f"date {time.strftime('%Y-%m-%dT%H:%M:%S')}; {os.cpu_count()} cores; "
        f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
        f"lightning-sparse fit --trainer.max_steps {args.steps}, steps/s from step 20"
    )
    results = {}
    for setting in settings:
        idle = run_fit(setting, args.steps, busy=False)
        busy = run_fit(setting, args.steps, busy=True)
        results[setting] = (idle, busy)
        print(
            f"{setting:8s} idle {idle['steps_per_s']:6.2f} steps/s ({idle['threads']} thr)  "
            f"busy {busy['steps_per_s']:6.2f} steps/s ({busy['threads']} thr)  "
            f"busy/idle {busy['steps_per_s'] / idle['steps_per_s']:.2f}",
            flush=True,
        )
    if "default" in results:
        base = results["default"][0]["steps_per_s"]
        for setting, (idle, busy) in results.items():
            a, b = idle["steps_per_s"], busy["steps_per_s"]
            verdict = "PASS" if a >= 0.97 * base and b >= 0.7 * a else "FAIL"
            print(
                f"goal {setting:8s} (a) idle {a / base:.2f} x default-idle (>= 1, 3% noise); "
                f"(b) busy {b / a:.2f} x own idle (>= 0.70): {verdict}"
            )


if __name__ == "__main__":
    main()
