"""`lightning-sparse compare`: train recipes one after another, then tabulate and plot them.

The table follows seed 000's Table 3 (dense versus static, SET and RigL at 80% on a Llama
decoder) with GraNet added, and the FLOPs of each run::

    lightning-sparse compare                                  # the five recipes, as written
    lightning-sparse compare --recipes dense rigl --steps 100 --out outputs/quick
    lightning-sparse compare --recipes static rigl -- --model.dim 64   # overrides for every run

Each recipe runs as its own ``lightning-sparse fit`` process in ``<out>/<name>/`` (the recipe's
relative output paths land there), writing ``<out>/<name>/summary.json``. A recipe whose summary
exists from the same command is not run again (``--force`` re-runs it), so an interrupted
comparison continues where it stopped. Results: ``<out>/comparison.md`` (the table and the
commands), ``<out>/comparison.json`` and ``<out>/val_loss.svg`` (validation loss curves). Runs
logged offline to W&B are listed at the end as ``wandb sync`` commands whose paths work from the
directory ``compare`` was started in.

When the runs logged to W&B (their directories hold ``wandb/`` runs), the comparison is a W&B run
of its own (``job_type="compare"``, in the recipes' project, under ``<out>/wandb``): the
validation-loss plot as ``wandb.Html`` (the SVG inline: ``wandb.Image`` needs Pillow and a raster
format, and Pillow cannot read SVG, so the vector plot is shown as W&B renders HTML media), the
table as a ``wandb.Table``, and each run's loss and FLOPs ratios in the run summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_sparse.app.svg_plot import line_plot_svg
from lightning_sparse.recipes import RECIPES_DIR

__all__ = [
    "DEFAULT_RECIPES",
    "format_table",
    "log_comparison_to_wandb",
    "main",
    "resolve_recipe",
    "wandb_sync_commands",
]

DEFAULT_RECIPES = ("dense", "static", "set", "rigl", "granet")


def resolve_recipe(name: str) -> Path:
    """``rigl`` -> ``recipes/rigl_llama.yaml``; a path to a YAML file is taken as is.

    Raises:
        FileNotFoundError: neither exists.
    """
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {name!r} does not exist")
        return path.resolve()
    candidate = RECIPES_DIR / f"{name}_llama.yaml"
    if not candidate.is_file():
        known = sorted(p.stem.removesuffix("_llama") for p in RECIPES_DIR.glob("*_llama.yaml"))
        raise FileNotFoundError(
            f"no recipe named {name!r}; use one of {known} or the path of a recipe YAML file"
        )
    return candidate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-sparse compare",
        allow_abbrev=False,
        description="Train several recipes in turn; print a table and plot validation loss.",
        epilog="Arguments after `--` are passed to every run (e.g. -- --model.dim 64).",
    )
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=list(DEFAULT_RECIPES),
        help="recipe names (recipes/<name>_llama.yaml) or YAML paths; default: %(default)s",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="trainer.max_steps for every run (the recipes' sparsity schedules are not "
        "rescaled; validation runs 10 times); default: each recipe's own",
    )
    parser.add_argument("--out", default="outputs/compare", help="output directory (%(default)s)")
    parser.add_argument("--force", action="store_true", help="re-run recipes already finished")
    return parser


def main(args: list[str]) -> None:
    """Run the comparison; ``args`` as on the command line after ``compare``."""
    args = list(args)
    extra: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, extra = args[:cut], args[cut + 1 :]
    options = _parser().parse_args(args)
    if options.steps is not None and options.steps < 1:
        sys.exit(f"lightning-sparse compare: --steps must be >= 1, got {options.steps}")
    try:
        recipes = {Path(r).stem: resolve_recipe(r) for r in options.recipes}
    except FileNotFoundError as err:
        sys.exit(f"lightning-sparse compare: {err}")
    out = Path(options.out).resolve()
    runs = [
        _run(name, path, out / name, options.steps, extra, options.force)
        for name, path in recipes.items()
    ]
    table = format_table(runs)
    commands = "\n".join(f"    {' '.join(r['command'])}" for r in runs)
    (out / "comparison.md").write_text(
        f"{table}\n\nCommands (each run in <out>/<name>):\n\n{commands}\n"
    )
    (out / "comparison.json").write_text(json.dumps(runs, indent=1) + "\n")
    curves = {r["name"]: r["summary"]["val_curve"] for r in runs}
    svg = None
    if any(curves.values()):
        svg = line_plot_svg(curves, "Validation loss", "optimizer step", "loss (nats/token)")
        (out / "val_loss.svg").write_text(svg)
    print(f"\n{table}\n\nsaved {out / 'comparison.md'}, {out / 'val_loss.svg'}")
    run_dirs = [out / name for name in recipes]
    if wandb_sync_commands(run_dirs, only_offline=False):
        project = _wandb_project(list(recipes.values()))
        wandb_dir = log_comparison_to_wandb(out, runs, svg, project)
        print(f"W&B: the comparison is logged to project {project!r} ({wandb_dir})")
        run_dirs.append(out)
    sync = wandb_sync_commands(run_dirs)
    if sync:
        print("W&B runs logged offline; upload them from this directory with:")
        print("\n".join(f"    {command}" for command in sync))


def wandb_sync_commands(
    run_dirs: list[Path], cwd: Path | None = None, only_offline: bool = True
) -> list[str]:
    """``wandb sync <dir>`` for every offline W&B run under ``run_dirs`` (every run, online ones
    too, with ``only_offline=False``), the paths relative to ``cwd`` (default: the current
    directory; absolute where no relative path exists)."""
    here = (cwd or Path.cwd()).resolve()
    commands = []
    patterns = ["wandb/offline-run-*"] if only_offline else ["wandb/offline-run-*", "wandb/run-*"]
    for run_dir in run_dirs:
        found_runs = {f for pattern in patterns for f in run_dir.resolve().rglob(pattern)}
        for found in sorted(found_runs):
            try:
                path = os.path.relpath(found, here)
            except ValueError:  # another drive (Windows)
                path = str(found)
            commands.append(f"wandb sync {path}")
    return commands


def log_comparison_to_wandb(
    out: Path, runs: list[dict[str, Any]], svg: str | None, project: str
) -> Path:
    """Log the comparison as a W&B run in ``out/wandb``: the plot (``val_loss``, `wandb.Html`
    with the SVG inline; ``val_loss_chart``, W&B's line chart of the same curves), the table
    (``comparison``) and per-run figures in the summary (``<name>/val_loss``,
    ``<name>/train_flops_vs_dense``, ...). Mode: ``WANDB_MODE``, else online with a W&B
    account, else offline. Returns the run's local directory."""
    import wandb

    from lightning_sparse.app.wandb_mode import wandb_mode

    columns = [
        "method",
        "algorithm",
        "sparsity",
        "val_loss",
        "val_ppl",
        "train_flops",
        "train_flops_vs_dense",
        "inference_flops_per_token",
        "inference_vs_dense",
    ]
    rows, figures = [], {}
    for run in runs:
        s = run["summary"]
        fl = s["flops"]
        row = {
            "method": run["name"],
            "algorithm": "+".join(s["algorithms"]),
            "sparsity": s["sparsity"]["sparse_layers"],
            "val_loss": s["val"]["loss"],
            "val_ppl": s["val"]["ppl"],
            "train_flops": fl["train"],
            "train_flops_vs_dense": fl["train"] / fl["train_dense"],
            "inference_flops_per_token": fl["inference_per_token"],
            "inference_vs_dense": fl["inference_per_token"] / fl["inference_per_token_dense"],
        }
        rows.append([row[c] for c in columns])
        figures.update({f"{run['name']}/{k}": v for k, v in row.items() if k != "method"})
    out.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        dir=str(out),
        name=out.name,
        job_type="compare",
        mode=wandb_mode(),  # type: ignore[arg-type]
        config={"recipes": [r["name"] for r in runs]},
    )
    try:
        media: dict[str, Any] = {"comparison": wandb.Table(columns=columns, data=rows)}
        curves = [(r["name"], r["summary"].get("val_curve") or []) for r in runs]
        curves = [(name, curve) for name, curve in curves if curve]
        if curves:  # W&B's own line chart of the validation curves (interactive)
            media["val_loss_chart"] = wandb.plot.line_series(
                xs=[[step for step, _ in curve] for _, curve in curves],
                ys=[[loss for _, loss in curve] for _, curve in curves],
                keys=[name for name, _ in curves],
                title="validation loss",
                xname="step",
            )
        if svg is not None:
            media["val_loss"] = wandb.Html(f"<html><body>{svg}</body></html>", inject=False)
        run.log(media)
        run.summary.update(figures)
        return Path(run.dir).parent
    finally:
        run.finish()


def _wandb_project(recipes: list[Path]) -> str:
    """The ``project`` of the first recipe's `WandbLogger` (``lightning_sparse`` if none)."""
    import yaml

    for recipe in recipes:
        loggers = (yaml.safe_load(recipe.read_text()) or {}).get("trainer", {}).get("logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            if isinstance(logger, dict) and "WandbLogger" in str(logger.get("class_path")):
                project = (logger.get("init_args") or {}).get("project")
                if project:
                    return str(project)
    return "lightning_sparse"


def _run(
    name: str, recipe: Path, run_dir: Path, steps: int | None, extra: list[str], force: bool
) -> dict[str, Any]:
    """Train one recipe in ``run_dir`` (unless finished with the same command); its record."""
    summary_path = run_dir / "summary.json"
    command = ["lightning-sparse", "fit", "--config", str(recipe)]
    command += ["--summary.path", str(summary_path)]
    if steps is not None:
        command += ["--trainer.max_steps", str(steps)]
        command += ["--trainer.val_check_interval", str(max(1, steps // 10))]
    command += extra
    record_path = run_dir / "run.json"
    if not force and summary_path.is_file() and record_path.is_file():
        record = json.loads(record_path.read_text())
        if record["command"] == command:
            print(f"compare: {name}: reusing the finished run in {run_dir}")
            return {**record, "summary": json.loads(summary_path.read_text())}
    run_dir.mkdir(parents=True, exist_ok=True)
    summary_path.unlink(missing_ok=True)
    print(f"compare: {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    python = [sys.executable, "-m", "lightning_sparse.app.cli"]
    result = subprocess.run(python + command[1:], cwd=run_dir, check=False)
    if result.returncode != 0 or not summary_path.is_file():
        sys.exit(
            f"lightning-sparse compare: recipe {name!r} failed (exit code {result.returncode}); "
            f"its output is above, its files are in {run_dir}"
        )
    record = {"name": name, "command": command, "process_time_s": time.perf_counter() - start}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return {**record, "summary": json.loads(summary_path.read_text())}


def format_table(runs: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per run, FLOPs absolute and relative to the dense model."""
    header = (
        "| method | algorithm | sparsity | val loss | val ppl | training FLOPs | vs dense "
        "| inference FLOPs/token | vs dense | wall time |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for run in runs:
        s = run["summary"]
        val, fl = s["val"], s["flops"]
        loss = f"{val['loss']:.4f}" if val["loss"] is not None else "n/a"
        ppl = f"{val['ppl']:.3f}" if val["ppl"] is not None else "n/a"
        algorithms, sparsity = ", ".join(s["algorithms"]), s["sparsity"]["sparse_layers"]
        lines.append(
            f"| {run['name']} | {algorithms} | {sparsity:.1%} "
            f"| {loss} | {ppl} | {fl['train']:.3e} | {fl['train'] / fl['train_dense']:.2f}x "
            f"| {fl['inference_per_token']:.3e} "
            f"| {fl['inference_per_token'] / fl['inference_per_token_dense']:.2f}x "
            f"| {s['wall_time_s']:.0f} s |"
        )
    return "\n".join(lines)
