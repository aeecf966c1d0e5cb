"""`lightning-sparse compare`: train recipes with several seeds, then tabulate and plot them.

The table follows seed 000's Table 3 (dense versus static, SET and RigL at 80% on a Llama
decoder) with GraNet added, per method over its seeds::

    lightning-sparse compare --seeds 3                        # the five recipes, 3 seeds each
    lightning-sparse compare --recipes dense rigl --steps 100 --out outputs/quick
    lightning-sparse compare --recipes static rigl -- --model.dim 64   # overrides for every run

Every ``(recipe, seed)`` is one ``lightning-sparse fit`` process in ``<out>/<name>/seed_<s>/``
with ``--seed_everything <s>`` (seeds 0..N-1), several at once where cores allow (``--jobs``;
`lightning_sparse.app.compare_runs`). A run whose summary exists from the same command is not
run again (``--force`` re-runs it), so an interrupted comparison continues where it stopped.
Results (`lightning_sparse.app.compare_table`): ``<out>/comparison.md`` (the table: validation
loss mean ± sd, 95% Student t interval, the difference to static paired by seed with its 95%
interval, FLOPs; the per-seed losses; the commands), ``<out>/comparison.json`` and
``<out>/val_loss.svg`` (mean validation curve per method with its 95% band). W&B
(`lightning_sparse.app.compare_wandb`): runs grouped by method, the figures in every run's
summary, and the comparison as a run of its own; offline runs are listed as ``wandb sync``
commands whose paths work from the directory ``compare`` was started in.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lightning_sparse.app.compare_runs import plan_runs, run_all
from lightning_sparse.app.compare_table import (
    aggregate,
    band_curves,
    difference_curves,
    figures,
    format_seed_table,
    format_table,
)
from lightning_sparse.app.compare_wandb import (
    annotate_runs,
    log_comparison_to_wandb,
    wandb_project,
    wandb_sync_commands,
)
from lightning_sparse.app.svg_plot import line_plot_svg
from lightning_sparse.recipes import RECIPES_DIR

__all__ = [
    "DEFAULT_RECIPES",
    "format_table",
    "log_comparison_to_wandb",
    "main",
    "recipe_name",
    "resolve_recipe",
    "wandb_sync_commands",
]

DEFAULT_RECIPES = ("dense", "static", "set", "rigl", "granet")


def recipe_name(recipe: str) -> str:
    """The method's name in the table: ``rigl`` for ``rigl`` and for ``.../rigl_llama.yaml``."""
    return Path(recipe).stem.removesuffix("_llama")


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
        description="Train several recipes with N seeds each; print a table with 95% "
        "intervals and plot the validation loss with bands.",
        epilog="Arguments after `--` are passed to every run (e.g. -- --model.dim 64).",
    )
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=list(DEFAULT_RECIPES),
        help="recipe names (recipes/<name>_llama.yaml) or YAML paths; default: %(default)s",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="seeds per recipe: 0..N-1, each run with --seed_everything <seed> (model init, "
        "data order and masks); default: %(default)s",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs trained at once, each with cores/jobs torch threads; default: one per idle core",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="the method the others are compared with, paired by seed; one of the recipes "
        "(default: static, when it is among them)",
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


def _check(options: argparse.Namespace) -> None:
    for name, value in (("--seeds", options.seeds), ("--jobs", options.jobs)):
        if value is not None and value < 1:
            sys.exit(f"lightning-sparse compare: {name} must be >= 1, got {value}")
    if options.steps is not None and options.steps < 1:
        sys.exit(f"lightning-sparse compare: --steps must be >= 1, got {options.steps}")


def main(args: list[str]) -> None:
    """Run the comparison; ``args`` as on the command line after ``compare``."""
    args = list(args)
    extra: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, extra = args[:cut], args[cut + 1 :]
    options = _parser().parse_args(args)
    _check(options)
    try:
        recipes = {recipe_name(r): resolve_recipe(r) for r in options.recipes}
    except FileNotFoundError as err:
        sys.exit(f"lightning-sparse compare: {err}")
    if options.baseline is not None and options.baseline not in recipes:
        sys.exit(
            f"lightning-sparse compare: --baseline {options.baseline!r} is not one of the "
            f"recipes compared ({', '.join(recipes)}); name one of them or add it to --recipes"
        )
    baseline = options.baseline or ("static" if "static" in recipes else None)
    out = Path(options.out).resolve()
    seeds = list(range(options.seeds))
    runs = plan_runs(recipes, seeds, out, options.steps, extra)
    start = time.perf_counter()
    failures = run_all(runs, options.jobs, options.force)
    if failures:
        sys.exit(
            f"lightning-sparse compare: {len(failures)} of {len(runs)} run(s) failed; the "
            "finished ones are kept (run the same command again to retry the others):\n"
            + "\n".join(failures)
        )
    results = aggregate(runs, baseline)
    table = format_table(results, baseline)
    commands = "\n".join(f"    {' '.join(r.command)}" for r in runs)
    note = (
        f"{len(seeds)} seed(s) per method ({', '.join(map(str, seeds))}). 95% CI: Student t "
        "with N - 1 degrees of freedom over the seeds"
    )
    if baseline:
        note += f"; vs {baseline}: the same over the per-seed differences (paired by seed)"
    (out / "comparison.md").write_text(
        f"{table}\n\n{note}\n\nValidation loss per seed:\n\n{format_seed_table(results)}\n\n"
        f"Commands (each run in <out>/<name>/seed_<seed>):\n\n{commands}\n"
    )
    record = {
        "seeds": seeds,
        "baseline": baseline,
        "methods": [{"method": r.method, **figures(r, baseline)} for r in results],
        "vs_baseline_curves": difference_curves(runs, baseline),
        "runs": [r.record() for r in runs],
    }
    (out / "comparison.json").write_text(json.dumps(record, indent=1) + "\n")
    means, bands = band_curves(runs)
    svg = None
    if any(means.values()):
        title = "Validation loss" + (
            f" (mean of {len(seeds)} seeds, 95% band)" if len(seeds) > 1 else ""
        )
        svg = line_plot_svg(means, title, "optimizer step", "loss (nats/token)", bands=bands)
        (out / "val_loss.svg").write_text(svg)
    trained = sum(not r.reused for r in runs)
    print(
        f"\n{table}\n\n{note}\n\n{format_seed_table(results)}\n\nsaved {out / 'comparison.md'}, "
        f"{out / 'val_loss.svg'} ({trained} run(s) trained in {time.perf_counter() - start:.0f} s)"
    )
    run_dirs = [out / name for name in recipes]
    if wandb_sync_commands(run_dirs, only_offline=False):
        project = wandb_project(list(recipes.values()))
        annotated = annotate_runs(runs, results, baseline, project)
        wandb_dir = log_comparison_to_wandb(out, results, baseline, means, svg, project, seeds)
        print(
            f"W&B: the comparison is logged to project {project!r} ({wandb_dir}); runs grouped "
            f"by method, {annotated} run summaries given their method's figures (compare/...)"
        )
        run_dirs.append(out)  # the comparison run (the others are listed already)
    sync = wandb_sync_commands(run_dirs)
    if sync:
        print("W&B runs logged offline; upload them from this directory with:")
        print("\n".join(f"    {command}" for command in sync))
