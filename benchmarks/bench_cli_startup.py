"""Start-up time of the `lightning-sparse` command: ``--help`` and each subcommand's ``--help``.

Each command runs in a fresh process (``python -m lightning_sparse.app.cli <args>``, stdout and
stderr discarded), ``--rounds`` times, the commands interleaved round by round so that a change
in the machine's load hits all of them alike; the table gives the median and the fastest run,
in seconds of wall clock. Two reference rows give the floor a LightningCLI subcommand cannot go
under: ``import torch`` and ``import lightning.pytorch`` alone (``fit --help`` builds
LightningCLI's parser, which needs both). Goal (issue 34.6): ``lightning-sparse --help`` <= 3 s.
Every row runs with an empty help cache (`lightning_sparse.app.help_cache`), so ``fit --help``
is its first call; ``fit --help (cached)`` is every call after the first (the cache filled
once, untimed, before the rounds).

``--repo PATH`` (repeatable) times other checkouts instead of this one, each command of each
checkout in the same interleaved rounds: a before/after in the same window. Results:
benchmarks/README.md.

    python benchmarks/bench_cli_startup.py [--rounds 5] [--repo PATH ...] [--only help,fit]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from _harness import machine_facts  # this process's imports do not count: each run is a new one

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 3.0

COMMANDS: dict[str, list[str]] = {
    "help": ["-m", "lightning_sparse.app.cli", "--help"],
    "fit": ["-m", "lightning_sparse.app.cli", "fit", "--help"],
    "fit cached": ["-m", "lightning_sparse.app.cli", "fit", "--help"],
    "compare": ["-m", "lightning_sparse.app.cli", "compare", "--help"],
    "sweep": ["-m", "lightning_sparse.app.cli", "sweep", "--help"],
    "export": ["-m", "lightning_sparse.app.cli", "export", "--help"],
    "generate": ["-m", "lightning_sparse.app.cli", "generate", "--help"],
    "import torch": ["-c", "import torch"],
    "import lightning.pytorch": ["-c", "import lightning.pytorch"],
}


def time_once(args: list[str], repo: Path, cache: Path) -> float:
    """Wall-clock seconds of ``python <args>`` with ``repo`` first on ``PYTHONPATH`` and
    ``cache`` as the help cache (`lightning_sparse.app.help_cache`)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), _pythonpath()])),
        "LIGHTNING_SPARSE_CACHE": str(cache),
    }
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *args],
        cwd=repo,  # python -m puts the working directory first on sys.path
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr.decode()}")
    return elapsed


def _pythonpath() -> str:
    return os.environ.get("PYTHONPATH", "")


def machine() -> str:
    """`_harness.machine_facts` (CPU, cores, load, torch and lightning versions) and the versions
    of what start-up imports besides."""
    versions = ", ".join(f"{n} {_version(n)}" for n in ("jsonargparse", "wandb", "transformers"))
    return f"{machine_facts()}\n{versions}"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of each command")
    parser.add_argument(
        "--repo", type=Path, action="append", help="a checkout to time (repeatable; default: this)"
    )
    parser.add_argument(
        "--only", default=",".join(COMMANDS), help=f"comma-separated rows ({', '.join(COMMANDS)})"
    )
    options = parser.parse_args(argv)
    names = [n.strip() for n in options.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(COMMANDS)}")
    repos = [r.resolve() for r in options.repo or [ROOT]]
    print(machine())
    print(f"{options.rounds} rounds, interleaved; checkouts: {', '.join(map(str, repos))}\n")
    rows = [(repo, name) for name in names for repo in repos]
    times: dict[tuple[Path, str], list[float]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory() as scratch:
        warm = Path(scratch) / "warm"  # "fit cached": its first call (untimed) fills it
        for repo in repos:
            if "fit cached" in names:
                time_once(COMMANDS["fit cached"], repo, warm / repo.name)
        for round_ in range(options.rounds):
            shift = round_ % len(rows)
            for repo, name in rows[shift:] + rows[:shift]:  # the order rotated each round
                cache = warm / repo.name if name == "fit cached" else Path(scratch) / str(round_)
                times[repo, name].append(time_once(COMMANDS[name], repo, cache / name))
    print(f"{'command':<38}{'median s':>10}{'min s':>8}" + ("  checkout" if len(repos) > 1 else ""))
    for repo, name in rows:
        label = name if name.startswith("import") else f"lightning-sparse {_label(name)}"
        where = f"  {repo}" if len(repos) > 1 else ""
        row = times[repo, name]
        print(f"{label:<38}{statistics.median(row):>10.2f}{min(row):>8.2f}{where}")
    for repo in repos:
        if (repo, "help") in times:
            median = statistics.median(times[repo, "help"])
            verdict = "PASS" if median <= GOAL_S else "FAIL"
            print(
                f"goal: lightning-sparse --help <= {GOAL_S:.0f} s: {median:.2f} s median, "
                f"{verdict} ({repo})"
            )


def _label(name: str) -> str:
    if name == "fit cached":
        return "fit --help (cached)"
    return "--help" if name == "help" else f"{name} --help"


if __name__ == "__main__":
    main()
