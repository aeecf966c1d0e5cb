"""Run a Weights & Biases sweep config locally and offline: ``lightning-sparse sweep CONFIG``.

The same YAML works under ``wandb sweep CONFIG`` + ``wandb agent ID`` and here. Locally, the
``grid`` method expands the product of every parameter's ``values`` and ``random`` draws ``count``
points from a seeded generator (``bayes`` needs the W&B server). Each point's command is built as
the W&B agent builds it (``${env}`` dropped, ``${interpreter}``, ``${program}``, ``${args}`` =
``--name=value`` per parameter, ...), so a parameter named ``trainer.callbacks.init_args.sparsity``
becomes the LightningCLI override ``--trainer.callbacks.init_args.sparsity=0.8`` and one named
``config`` selects the recipe. A ``lightning-sparse`` command runs in this process (LightningCLI);
anything else runs as a subprocess. Every point logs with a ``CSVLogger`` to ``OUT/<i>/`` (the
command's own loggers, e.g. a ``WandbLogger`` for the agent, are replaced), the sweep metric's
last logged value is read back from its ``metrics.csv``, and a results table is printed and
written to ``OUT/results.csv``; a sweep over ``seed_everything`` also gets the table over seeds
(mean, sd, 95% t interval per setting; `lightning_sparse.app.sweep_seeds`).

Usage::

    lightning-sparse sweep recipes/sweeps/algorithm_x_sparsity.yaml
    lightning-sparse sweep recipes/sweeps/imp_prune_fraction.yaml --count 4 --seed 1
    lightning-sparse sweep CONFIG --dry-run -- --trainer.max_steps=20   # overrides for every point
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_sparse.app.common import RUN_ENV
from lightning_sparse.app.sweep_seeds import SEED_KEY, seed_table, write_seed_table

__all__ = [
    "PointResult",
    "command_line",
    "expand",
    "load_sweep",
    "main",
    "run_sweep",
    "validate_sweep",
]

SWEEP_KEYS = frozenset(
    {
        "program",
        "method",
        "metric",
        "parameters",
        "command",
        "name",
        "description",
        "project",
        "entity",
        "early_terminate",
        "run_cap",
    }
)
PARAMETER_KEYS = frozenset(
    {"value", "values", "probabilities", "distribution", "min", "max", "mu", "sigma", "q"}
)
RANDOM_DISTRIBUTIONS = (
    "constant",
    "categorical",
    "int_uniform",
    "uniform",
    "log_uniform_values",
    "normal",
)
DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]
CLI_NAME = "lightning-sparse"


# ---------------------------------------------------------------------------------- config
def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read and validate a W&B sweep YAML."""
    with open(path) as f:
        config = yaml.safe_load(f)
    validate_sweep(config, str(path))
    return config


def validate_sweep(config: Any, where: str = "sweep config") -> None:
    """Check the fields W&B's sweep schema defines (method, metric, parameters, command, ...).

    Raises:
        ValueError: naming the field, the rule and the fix.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{where}: a sweep config is a mapping, got {type(config).__name__}")
    unknown = set(config) - SWEEP_KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {sorted(unknown)}; W&B accepts {sorted(SWEEP_KEYS)}"
        )
    if config.get("method") not in ("grid", "random", "bayes"):
        raise ValueError(
            f"{where}: method={config.get('method')!r} must be 'grid', 'random' or 'bayes'"
        )
    metric = config.get("metric")
    if metric is not None:
        if not isinstance(metric, dict) or not isinstance(metric.get("name"), str):
            raise ValueError(f"{where}: metric must be {{name: <logged key>, goal: ...}}")
        if metric.get("goal", "minimize") not in ("minimize", "maximize"):
            raise ValueError(f"{where}: metric goal {metric['goal']!r} must be minimize/maximize")
    elif config["method"] == "bayes":
        raise ValueError(f"{where}: method 'bayes' needs a metric to optimise")
    parameters = config.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise ValueError(f"{where}: parameters must be a non-empty mapping name -> spec")
    for name, spec in parameters.items():
        if not isinstance(spec, dict):
            raise ValueError(
                f"{where}: parameter {name!r} must be a mapping such as {{values: [...]}}"
            )
        if "parameters" in spec:
            raise ValueError(
                f"{where}: parameter {name!r} is nested; use flat dotted names (they are the "
                "LightningCLI keys, e.g. model.lr)"
            )
        bad = set(spec) - PARAMETER_KEYS
        if bad:
            raise ValueError(f"{where}: parameter {name!r} has unknown keys {sorted(bad)}")
        if "values" in spec and (not isinstance(spec["values"], list) or not spec["values"]):
            raise ValueError(f"{where}: parameter {name!r}: values must be a non-empty list")
        if not ({"value", "values", "distribution"} & set(spec) or {"min", "max"} <= set(spec)):
            raise ValueError(
                f"{where}: parameter {name!r} needs value, values, min/max or a distribution"
            )
    command = config.get("command", DEFAULT_COMMAND)
    if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        raise ValueError(f"{where}: command must be a list of strings")
    if "${program}" in command and "program" not in config:
        raise ValueError(f"{where}: the command uses ${{program}} but program is not set")
    if "run_cap" in config and (not isinstance(config["run_cap"], int) or config["run_cap"] < 1):
        raise ValueError(f"{where}: run_cap must be a positive int")


# ---------------------------------------------------------------------------------- points
def _distribution(spec: dict[str, Any]) -> str:
    """W&B's inference: values -> categorical, value -> constant, int min/max -> int_uniform."""
    if "distribution" in spec:
        return spec["distribution"]
    if "values" in spec:
        return "categorical"
    if "value" in spec:
        return "constant"
    if "mu" in spec:
        return "normal"
    ints = all(isinstance(spec.get(k), int) for k in ("min", "max"))
    return "int_uniform" if ints else "uniform"


def _sample(name: str, spec: dict[str, Any], rng: random.Random) -> Any:
    kind = _distribution(spec)
    if kind == "constant":
        return spec["value"]
    if kind == "categorical":
        weights = spec.get("probabilities")
        return rng.choices(spec["values"], weights=weights)[0]
    if kind == "int_uniform":
        return rng.randint(spec["min"], spec["max"])
    if kind == "uniform":
        return rng.uniform(spec["min"], spec["max"])
    if kind == "log_uniform_values":
        return math.exp(rng.uniform(math.log(spec["min"]), math.log(spec["max"])))
    if kind == "normal":
        return rng.gauss(spec.get("mu", 0.0), spec.get("sigma", 1.0))
    raise ValueError(
        f"parameter {name!r}: distribution {kind!r} is not supported locally; use one of "
        f"{list(RANDOM_DISTRIBUTIONS)}, or run the sweep with wandb agent"
    )


def expand(config: dict[str, Any], count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The sweep's points, each ``{parameter name: value}`` in the config's parameter order.

    Args:
        config: a validated sweep config.
        count: the number of points: required for ``random`` (default: ``run_cap``); for
            ``grid`` the first ``count`` points.
        seed: seeds ``random``; the same seed gives the same points.

    Raises:
        ValueError: ``bayes``; a grid parameter without values; random without a count.
    """
    method, parameters = config["method"], config["parameters"]
    count = config.get("run_cap") if count is None else count
    if method == "grid":
        axes = []
        for name, spec in parameters.items():
            if "values" not in spec and "value" not in spec:
                raise ValueError(
                    f"grid parameter {name!r} needs values (or value); distributions need "
                    "method: random"
                )
            axes.append(spec["values"] if "values" in spec else [spec["value"]])
        points = [dict(zip(parameters, combo, strict=True)) for combo in itertools.product(*axes)]
        return points if count is None else points[:count]
    if method == "random":
        if count is None:
            raise ValueError("method random needs a count: pass --count N or set run_cap")
        rng = random.Random(seed)
        return [{n: _sample(n, s, rng) for n, s in parameters.items()} for _ in range(count)]
    raise ValueError(
        "method bayes needs the W&B sweep server; run it with wandb agent, or use grid/random here"
    )


def command_line(config: dict[str, Any], point: dict[str, Any]) -> list[str]:
    """The command the W&B agent would run for ``point``, without ``${env}``.

    Raises:
        ValueError: for a macro this runner does not know.
    """
    flags = [f"{name}={value}" for name, value in point.items()]
    macros = {
        "${env}": [],
        "${interpreter}": [sys.executable],
        "${program}": [str(config.get("program", ""))],
        "${args}": [f"--{f}" for f in flags],
        "${args_no_hyphens}": flags,
        "${args_json}": [json.dumps(point)],
        "${args_no_boolean_flags}": [
            f"--{n}" if v is True else f"--{n}={v}" for n, v in point.items() if v is not False
        ],
    }
    argv: list[str] = []
    for word in config.get("command", DEFAULT_COMMAND):
        if word.startswith("${") and word.endswith("}"):
            if word not in macros:
                raise ValueError(
                    f"sweep command macro {word} is not supported locally; use {list(macros)}"
                )
            argv += macros[word]
        else:
            argv.append(word)
    return argv


# ---------------------------------------------------------------------------------- running
@dataclass
class PointResult:
    """One finished point: its parameters, the metric's last logged value, time and status."""

    index: int
    params: dict[str, Any]
    metric: float | None
    seconds: float
    status: str = "ok"
    log_dir: str = ""


def final_metric(out_dir: Path, name: str) -> float | None:
    """Last non-empty value of column ``name`` in the newest ``metrics.csv`` under ``out_dir``."""
    files = sorted(out_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    value = None
    with open(files[-1], newline="") as f:
        for row in csv.DictReader(f):
            if row.get(name):
                value = float(row[name])
    return value


def _launch(argv: list[str]) -> str:
    """Run one point; returns ``"ok"`` or ``"failed: ..."``."""
    if Path(argv[0]).name == CLI_NAME:
        from lightning_sparse.app.command import run_command

        saved = sys.argv
        # LightningCLI warns when sys.argv holds other arguments (the sweep's) next to args=.
        sys.argv = [argv[0]]
        try:
            run_command(argv[1:])  # as `lightning-sparse` itself runs it
        except SystemExit as exit_:  # argument errors exit from jsonargparse
            return f"failed: exit {exit_.code}"
        except Exception as error:  # one failed point must not end the sweep
            return f"failed: {type(error).__name__}: {error}"
        finally:
            sys.argv = saved
        return "ok"
    # A point is a run of its own: not the run directory a fit in this process decided for its
    # DDP workers (`RUN_ENV`).
    env = {k: v for k, v in os.environ.items() if k != RUN_ENV}
    code = subprocess.run(argv, check=False, env=env).returncode
    return "ok" if code == 0 else f"failed: exit {code}"


def run_sweep(
    config: dict[str, Any],
    out: Path,
    count: int | None = None,
    seed: int = 0,
    overrides: list[str] | None = None,
    dry_run: bool = False,
) -> list[PointResult]:
    """Run every point of ``config`` one after the other; see the module docstring."""
    metric = config.get("metric", {}).get("name", "val/loss")
    results = []
    for index, point in enumerate(expand(config, count, seed)):
        log_dir = out / str(index)
        argv = command_line(config, point) + list(overrides or [])
        argv += [
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.init_args.save_dir={log_dir}",
        ]
        print(f"[sweep {index}] {' '.join(argv)}", flush=True)
        if dry_run:
            results.append(PointResult(index, point, None, 0.0, "dry run", str(log_dir)))
            continue
        start = time.perf_counter()
        status = _launch(argv)
        seconds = time.perf_counter() - start
        value = final_metric(log_dir, metric) if log_dir.is_dir() else None
        results.append(PointResult(index, point, value, seconds, status, str(log_dir)))
    return results


def _short_names(names: list[str]) -> list[str]:
    """Last dotted component of each name where that is unambiguous."""
    short = [n.rsplit(".", 1)[-1] for n in names]
    return [s if short.count(s) == 1 else n for s, n in zip(short, names, strict=True)]


def results_table(results: list[PointResult], metric: str, goal: str = "minimize") -> str:
    """The results as a text table; ``*`` marks the best point."""
    names = list(results[0].params) if results else []
    headers = ["#", *_short_names(names), metric, "seconds", "status"]
    values = [r.metric for r in results if r.metric is not None]
    best = (min if goal == "minimize" else max)(values) if values else None
    rows = []
    for r in results:
        mark = "*" if best is not None and r.metric == best else ""
        shown = "-" if r.metric is None else f"{r.metric:.4f}{mark}"
        params = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.params.values()]
        rows.append([str(r.index), *params, shown, f"{r.seconds:.1f}", r.status])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def write_results(results: list[PointResult], metric: str, path: Path) -> None:
    """``results.csv``: index, parameters, metric, seconds, status, log_dir."""
    names = list(results[0].params) if results else []
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["index", *names, metric, "seconds", "status", "log_dir"])
        for r in results:
            row = [r.index, *r.params.values(), r.metric, f"{r.seconds:.2f}", r.status, r.log_dir]
            writer.writerow(row)


def main(args: list[str] | None = None) -> None:
    """``lightning-sparse sweep CONFIG [--count N] [--seed S] [--out DIR] [--dry-run] [-- ...]``."""
    args = list(sys.argv[1:] if args is None else args)
    overrides: list[str] = []
    if "--" in args:
        split = args.index("--")
        args, overrides = args[:split], args[split + 1 :]
    parser = argparse.ArgumentParser(
        prog=f"{CLI_NAME} sweep",
        allow_abbrev=False,
        description="Run a W&B sweep config locally and offline (grid, or seeded random).",
        epilog="Arguments after -- are appended to every point's command (LightningCLI overrides).",
    )
    parser.add_argument(
        "config", help="W&B sweep YAML, e.g. recipes/sweeps/algorithm_x_sparsity.yaml"
    )
    parser.add_argument(
        "--count", type=int, default=None, help="points (random: required unless run_cap)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random method")
    parser.add_argument("--out", default=None, help="output folder (default outputs/sweeps/<name>)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    ns = parser.parse_args(args)
    config = load_sweep(ns.config)
    name = config.get("name") or Path(ns.config).stem
    out = Path(ns.out) if ns.out else Path("outputs") / "sweeps" / name
    metric = config.get("metric", {}).get("name", "val/loss")
    goal = config.get("metric", {}).get("goal", "minimize")
    results = run_sweep(config, out, ns.count, ns.seed, overrides, ns.dry_run)
    if not ns.dry_run:
        write_results(results, metric, out / "results.csv")
    print(f"\nSweep {name} ({config['method']}, {len(results)} points, {metric}: {goal})")
    print(results_table(results, metric, goal), flush=True)
    if SEED_KEY in config["parameters"] and not ns.dry_run:  # the same settings over seeds
        write_seed_table(results, metric, out / "results_by_seed.csv")
        print(f"\nOver the seeds ({SEED_KEY}):\n{seed_table(results, metric)}", flush=True)
    failed = [r for r in results if r.status.startswith("failed")]
    if failed:  # the table and results.csv are written; the exit status says it did not all run
        print(
            f"{CLI_NAME} sweep: {len(failed)} of {len(results)} point(s) failed (first: point "
            f"{failed[0].index}, {failed[0].status}; its log: {failed[0].log_dir})",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
