"""A sweep with a ``seed_everything`` parameter, summarized over its seeds.

`lightning-sparse sweep` prints one row per point; when the sweep varies ``seed_everything``
(e.g. ``recipes/sweeps/seeds.yaml``: every twin recipe x seeds 0, 1, 2), this table has one row
per setting of the other parameters: the number of seeds with a result, the metric's mean, its
sample standard deviation and the 95% Student t interval (N - 1 degrees of freedom;
`lightning_sparse.app.stats`). `lightning-sparse compare --seeds N` gives the same with the
difference to static paired by seed.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from lightning_sparse.app.stats import mean_interval

__all__ = ["SEED_KEY", "by_setting", "seed_table", "write_seed_table"]

SEED_KEY = "seed_everything"


def by_setting(results: list[Any], seed_key: str = SEED_KEY) -> dict[tuple, list[float]]:
    """``{(other parameter values...): [metric per seed]}``, in the sweep's order (points with
    no metric left out)."""
    groups: dict[tuple, list[float]] = {}
    for r in results:
        key = tuple((n, v) for n, v in r.params.items() if n != seed_key)
        values = groups.setdefault(key, [])
        if r.metric is not None:
            values.append(r.metric)
    return groups


def _rows(results: list[Any], seed_key: str) -> list[list[str]]:
    rows = []
    for key, values in by_setting(results, seed_key).items():
        params = [f"{v:.4g}" if isinstance(v, float) else str(v) for _, v in key]
        if not values:
            rows.append([*params, "0", "-", "-", "-"])
            continue
        i = mean_interval(values)
        sd = "n/a" if i.sd is None else f"{i.sd:.4f}"
        ci = "n/a" if i.low is None else f"[{i.low:.4f}, {i.high:.4f}]"
        rows.append([*params, str(i.n), f"{i.mean:.4f}", sd, ci])
    return rows


def seed_table(results: list[Any], metric: str, seed_key: str = SEED_KEY) -> str:
    """The text table (module docstring); ``results`` are `sweep.PointResult`s."""
    names = [n for n in (results[0].params if results else {}) if n != seed_key]
    headers = [*names, "seeds", f"mean {metric}", "sd", "95% CI (t, N-1 dof)"]
    rows = _rows(results, seed_key)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def write_seed_table(results: list[Any], metric: str, path: Path, seed_key: str = SEED_KEY) -> None:
    """``results_by_seed.csv``: the other parameters, seeds, mean, sd, CI low and high."""
    names = [n for n in (results[0].params if results else {}) if n != seed_key]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*names, "seeds", "mean", "sd", "ci95_low", "ci95_high"])
        for key, values in by_setting(results, seed_key).items():
            params = [v for _, v in key]
            if not values:
                writer.writerow([*params, 0, "", "", "", ""])
                continue
            i = mean_interval(values)
            writer.writerow([*params, i.n, i.mean, i.sd, i.low, i.high])
