"""The results of `lightning-sparse compare` per method, over its seeds: the table, the figures
W&B gets, and the mean validation curve with its band.

Per method: the mean final validation loss over seeds, its sample standard deviation and a 95%
Student t interval (N - 1 degrees of freedom), and the difference to the baseline (static
sparsity) paired by seed with its 95% t interval (`lightning_sparse.app.stats`: seed ``s`` of
every method shares the initial weights and the data order, so the pairing removes what the
seed adds to both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_sparse.app.compare_runs import Run
from lightning_sparse.app.stats import Difference, Interval, mean_interval, paired_difference

__all__ = [
    "MethodResult",
    "aggregate",
    "band_curves",
    "difference_curves",
    "figures",
    "format_seed_table",
    "format_table",
]


@dataclass
class MethodResult:
    """One method over its seeds (the means of every seed's summary)."""

    method: str
    algorithms: str
    sparsity: float
    losses: dict[int, float]  # seed -> final validation loss
    loss: Interval | None  # None: no run validated
    ppl: float | None
    vs_baseline: Difference | None
    train_flops: float
    train_vs_dense: float
    inference_per_token: float
    inference_vs_dense: float
    wall_time_s: float


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def aggregate(runs: list[Run], baseline: str | None = "static") -> list[MethodResult]:
    """One `MethodResult` per method, in the order of ``runs``; the paired difference to
    ``baseline`` where it is one of the methods (``None`` for the baseline itself)."""
    by_method: dict[str, list[Run]] = {}
    for run in runs:
        by_method.setdefault(run.method, []).append(run)
    losses = {
        method: {
            r.seed: r.summary["val"]["loss"]
            for r in group
            if r.summary and r.summary["val"]["loss"] is not None
        }
        for method, group in by_method.items()
    }
    results = []
    for method, group in by_method.items():
        summaries = [r.summary for r in group if r.summary]
        fl = [s["flops"] for s in summaries]
        ppls = [s["val"]["ppl"] for s in summaries if s["val"]["ppl"] is not None]
        own = losses[method]
        base = losses.get(baseline) if baseline is not None and method != baseline else None
        shared = base is not None and set(own) & set(base)
        results.append(
            MethodResult(
                method=method,
                algorithms=", ".join(summaries[0]["algorithms"]),
                sparsity=_mean([s["sparsity"]["sparse_layers"] for s in summaries]),
                losses=own,
                loss=mean_interval(list(own.values())) if own else None,
                ppl=_mean(ppls) if ppls else None,
                vs_baseline=paired_difference(own, base) if base and shared else None,
                train_flops=_mean([f["train"] for f in fl]),
                train_vs_dense=_mean([f["train"] / f["train_dense"] for f in fl]),
                inference_per_token=_mean([f["inference_per_token"] for f in fl]),
                inference_vs_dense=_mean(
                    [f["inference_per_token"] / f["inference_per_token_dense"] for f in fl]
                ),
                wall_time_s=_mean([s["wall_time_s"] for s in summaries]),
            )
        )
    return results


def figures(result: MethodResult, baseline: str | None = "static") -> dict[str, Any]:
    """The method's figures with flat names (``val_loss``, ``val_loss_sd``,
    ``val_loss_ci95_low``, ``val_loss_vs_static``, ...); values that do not exist (the spread
    of one seed) are left out."""
    out: dict[str, Any] = {
        "algorithm": result.algorithms,
        "sparsity": result.sparsity,
        "seeds": len(result.losses),
        "val_ppl": result.ppl,
        "train_flops": result.train_flops,
        "train_flops_vs_dense": result.train_vs_dense,
        "inference_flops_per_token": result.inference_per_token,
        "inference_vs_dense": result.inference_vs_dense,
    }
    if result.loss is not None:
        i = result.loss
        out |= {
            "val_loss": i.mean,
            "val_loss_sd": i.sd,
            "val_loss_ci95_low": i.low,
            "val_loss_ci95_high": i.high,
        }
    if result.vs_baseline is not None:
        d, key = result.vs_baseline.interval, f"val_loss_vs_{baseline}"
        out |= {key: d.mean, f"{key}_ci95_low": d.low, f"{key}_ci95_high": d.high}
    return {k: v for k, v in out.items() if v is not None}


def _num(value: float | None, digits: int = 4, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def format_table(results: list[MethodResult], baseline: str | None = "static") -> str:
    """A Markdown table, one row per method: validation loss mean ± sd over the seeds, its 95%
    interval, the paired difference to ``baseline`` with its 95% interval, perplexity (mean),
    FLOPs (absolute and relative to the dense model) and the mean wall time of ``fit``."""
    vs = f"vs {baseline} (paired, 95% CI)" if baseline else "vs baseline"
    header = (
        f"| method | algorithm | sparsity | seeds | val loss (mean ± sd) | 95% CI | {vs} "
        "| val ppl | training FLOPs | vs dense | inference FLOPs/token | vs dense | wall time |"
    )
    lines = [header, "|" + "---|" * (header.count(" | ") + 1)]
    for r in results:
        i = r.loss
        loss = "n/a" if i is None else _num(i.mean) + (f" ± {i.sd:.4f}" if i.sd is not None else "")
        ci = "n/a" if i is None or i.low is None else f"[{i.low:.4f}, {i.high:.4f}]"
        if r.vs_baseline is None:
            diff = "-"
        else:
            d = r.vs_baseline.interval
            diff = _num(d.mean, sign=True)
            if d.low is not None and d.high is not None:
                diff += f" [{d.low:+.4f}, {d.high:+.4f}]"
        lines.append(
            f"| {r.method} | {r.algorithms} | {r.sparsity:.1%} | {len(r.losses)} | {loss} "
            f"| {ci} | {diff} | {_num(r.ppl, 3)} | {r.train_flops:.3e} | {r.train_vs_dense:.2f}x "
            f"| {r.inference_per_token:.3e} | {r.inference_vs_dense:.2f}x "
            f"| {r.wall_time_s:.0f} s |"
        )
    return "\n".join(lines)


def format_seed_table(results: list[MethodResult]) -> str:
    """A Markdown table of every run's final validation loss: one row per method, one column
    per seed."""
    seeds = sorted({s for r in results for s in r.losses})
    lines = ["| method | " + " | ".join(f"seed {s}" for s in seeds) + " |"]
    lines.append("|---|" + "---|" * len(seeds))
    for r in results:
        cells = [_num(r.losses.get(s)) for s in seeds]
        lines.append(f"| {r.method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def band_curves(
    runs: list[Run],
) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[tuple[float, float, float]]]]:
    """Per method, the mean validation curve over its seeds and the 95% interval at each step.

    Returns:
        ``(means, bands)``: ``{method: [(step, mean), ...]}`` over the steps every seed of the
        method validated at, and ``{method: [(step, low, high), ...]}`` for methods with two or
        more seeds (one seed has no interval).
    """
    curves: dict[str, list[dict[float, float]]] = {}
    for run in runs:
        curve = (run.summary or {}).get("val_curve") or []
        curves.setdefault(run.method, []).append({float(x): float(y) for x, y in curve})
    means: dict[str, list[tuple[float, float]]] = {}
    bands: dict[str, list[tuple[float, float, float]]] = {}
    for method, per_seed in curves.items():
        steps = sorted(set.intersection(*(set(c) for c in per_seed))) if per_seed else []
        intervals = [(x, mean_interval([c[x] for c in per_seed])) for x in steps]
        means[method] = [(x, i.mean) for x, i in intervals]
        if len(per_seed) > 1 and intervals:
            # Two or more seeds: every interval has its bounds.
            bands[method] = [
                (x, i.low, i.high) for x, i in intervals if i.low is not None and i.high is not None
            ]
    return means, bands


def difference_curves(
    runs: list[Run], baseline: str | None = "static"
) -> dict[str, list[tuple[float, float, float | None, float | None]]]:
    """Per method, the validation-loss difference to ``baseline`` at every step both validated
    at, paired by seed: ``{method: [(step, mean, ci95_low, ci95_high), ...]}`` (the interval is
    ``None`` with one seed). Shows whether a gap opens or closes as training goes on."""
    curves: dict[str, dict[int, dict[float, float]]] = {}
    for run in runs:
        curve = (run.summary or {}).get("val_curve") or []
        curves.setdefault(run.method, {})[run.seed] = {float(x): float(y) for x, y in curve}
    base = curves.get(baseline) if baseline is not None else None
    if not base:
        return {}
    out = {}
    for method, per_seed in curves.items():
        if method == baseline:
            continue
        seeds = sorted(set(per_seed) & set(base))
        if not seeds:
            continue
        steps = sorted(set.intersection(*(set(per_seed[s]) & set(base[s]) for s in seeds)))
        rows = []
        for x in steps:
            own, other = {s: per_seed[s][x] for s in seeds}, {s: base[s][x] for s in seeds}
            d = paired_difference(own, other).interval
            rows.append((x, d.mean, d.low, d.high))
        out[method] = rows
    return out
