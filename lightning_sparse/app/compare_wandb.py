"""`lightning-sparse compare` and Weights & Biases: the comparison as a W&B run of its own, the
method's figures in every training run's summary, and the ``wandb sync`` commands.

Every training run is in W&B group ``<method>`` (`lightning_sparse.app.compare_runs`), so a W&B
report groups the seeds of a method (its line plots then show the mean and a band). When all
runs are done, each one is resumed (same run id, ``resume="allow"``) to add its method's figures
to its summary under ``compare/`` (``compare/val_loss`` = the method's mean over seeds,
``compare/val_loss_ci95_low``, ``compare/val_loss_vs_static``, ...), so a report's run table can
show them. An offline run resumed this way gets a second ``offline-run-*-<id>`` directory;
``wandb sync`` both, in order (the listed commands do).

The comparison run (``job_type="compare"``, under ``<out>/wandb``) holds the plot as
``wandb.Html`` with the SVG inline (``wandb.Image`` needs Pillow and a raster format, and Pillow
cannot read SVG), the mean curves as W&B's own line chart, the table as a ``wandb.Table`` and
every method's figures in its summary (``rigl/val_loss``, ``rigl/val_loss_ci95_low``, ...).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from lightning_sparse.app.compare_runs import Run
from lightning_sparse.app.compare_table import MethodResult, figures

__all__ = [
    "annotate_runs",
    "log_comparison_to_wandb",
    "wandb_project",
    "wandb_run_dirs",
    "wandb_sync_commands",
]

_PATTERNS = ("wandb/offline-run-*", "wandb/run-*")


def wandb_run_dirs(run_dir: Path, only_offline: bool = False) -> list[Path]:
    """The W&B run directories under ``run_dir`` (sorted: a resumed run after its first part)."""
    patterns = _PATTERNS[:1] if only_offline else _PATTERNS
    found = {f for pattern in patterns for f in run_dir.resolve().rglob(pattern) if f.is_dir()}
    return sorted(found, key=lambda f: (_stamp(f), str(f)))


def _stamp(directory: Path) -> str:
    """The start time in a W&B run directory's name (``20261123_101010``), or ``""``."""
    found = re.search(r"\d{8}_\d{6}", directory.name)
    return found.group() if found else ""


def wandb_sync_commands(
    run_dirs: list[Path], cwd: Path | None = None, only_offline: bool = True
) -> list[str]:
    """``wandb sync <dir>`` for every offline W&B run under ``run_dirs`` (every run, online ones
    too, with ``only_offline=False``), the paths relative to ``cwd`` (default: the current
    directory; absolute where no relative path exists), each listed once."""
    here = (cwd or Path.cwd()).resolve()
    commands, seen = [], set()
    for run_dir in run_dirs:
        for found in wandb_run_dirs(run_dir, only_offline):
            if found in seen:  # under two of run_dirs
                continue
            seen.add(found)
            try:
                path = os.path.relpath(found, here)
            except ValueError:  # another drive (Windows)
                path = str(found)
            commands.append(f"wandb sync {path}")
    return commands


def wandb_project(recipes: list[Path]) -> str:
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


def _run_id(directory: Path) -> str:
    """``offline-run-20261123_101010-abcd1234`` -> ``abcd1234``."""
    return directory.name.rsplit("-", 1)[-1]


def annotate_runs(
    runs: list[Run], results: list[MethodResult], baseline: str | None, project: str
) -> int:
    """Add each run's method figures to its W&B run summary (under ``compare/``) by resuming
    the run; returns how many runs were annotated. A run whose summary already holds the same
    figures (``wandb_figures.json`` beside it) is left alone, so re-running ``compare`` adds no
    W&B data."""
    import wandb

    from lightning_sparse.app.wandb_mode import wandb_mode

    by_method = {r.method: r for r in results}
    count = 0
    for run in runs:
        found = wandb_run_dirs(run.run_dir)
        if not found or run.method not in by_method:
            continue
        values = {f"compare/{k}": v for k, v in figures(by_method[run.method], baseline).items()}
        values["compare/method"] = run.method
        values["compare/seed"] = run.seed
        marker = run.run_dir / "wandb_figures.json"
        if marker.is_file() and json.loads(marker.read_text()) == values:
            continue
        latest = found[-1]  # the run trained last (a re-trained run's old files may remain)
        if _stamp(latest) == time.strftime("%Y%m%d_%H%M%S"):
            time.sleep(1.0)  # W&B names the new directory by the second: keep it apart
        resumed = wandb.init(
            project=project,
            dir=str(latest.parent.parent),
            id=_run_id(latest),
            resume="allow",
            group=run.method,
            job_type="fit",
            # WANDB_MODE's value, any string (W&B checks it); wandb.init declares a Literal.
            mode=wandb_mode(),  # type: ignore[arg-type]
        )
        try:
            resumed.summary.update(values)
        finally:
            resumed.finish()
        marker.write_text(json.dumps(values, indent=1) + "\n")
        count += 1
    return count


def log_comparison_to_wandb(
    out: Path,
    results: list[MethodResult],
    baseline: str | None,
    means: dict[str, list[tuple[float, float]]],
    svg: str | None,
    project: str,
    seeds: list[int],
) -> Path:
    """Log the comparison as a W&B run in ``out/wandb`` (module docstring). Mode:
    ``WANDB_MODE``, else online with a W&B account, else offline. Returns the run's local
    directory."""
    import wandb

    from lightning_sparse.app.wandb_mode import wandb_mode

    rows = [{"method": r.method, **figures(r, baseline)} for r in results]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    out.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        dir=str(out),
        name=out.name,
        job_type="compare",
        # WANDB_MODE's value, any string (W&B checks it); wandb.init declares a Literal.
        mode=wandb_mode(),  # type: ignore[arg-type]
        config={"recipes": [r.method for r in results], "seeds": seeds, "baseline": baseline},
    )
    try:
        data = [[row.get(c) for c in columns] for row in rows]
        headers: list[str | int] = [*columns]  # wandb.Table's type (a list is invariant)
        media: dict[str, Any] = {"comparison": wandb.Table(columns=headers, data=data)}
        curves = [(name, curve) for name, curve in means.items() if curve]
        if curves:  # W&B's own line chart of the mean validation curves (interactive)
            media["val_loss_chart"] = wandb.plot.line_series(
                xs=[[step for step, _ in curve] for _, curve in curves],
                ys=[[loss for _, loss in curve] for _, curve in curves],
                keys=[name for name, _ in curves],
                title="validation loss (mean over seeds)",
                xname="step",
            )
        if svg is not None:
            media["val_loss"] = wandb.Html(f"<html><body>{svg}</body></html>", inject=False)
        run.log(media)
        run.summary.update(
            {f"{row['method']}/{k}": v for row in rows for k, v in row.items() if k != "method"}
        )
        return Path(run.dir).parent
    finally:
        run.finish()
