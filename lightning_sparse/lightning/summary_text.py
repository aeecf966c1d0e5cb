"""The run summary as text: the printed report, flat W&B keys and the final logged metrics.

Pure functions of a `SparseRunSummary.build` result (a dict of plain values, what
``summary.json`` holds); ``lightning-sparse compare`` reads the same dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["final_metrics", "flat_summary", "format_summary"]


def format_summary(summary: dict[str, Any], layers: bool = True) -> str:
    """The human-readable form of a `SparseRunSummary.build` result."""
    val, sp, fl = summary["val"], summary["sparsity"], summary["flops"]
    lines = [
        "",
        "=" * 30 + " lightning-sparse run summary " + "=" * 30,
        f"steps {summary['steps']}  tokens {summary['tokens']:,}  wall time "
        f"{summary['wall_time_s']:.0f} s  algorithms {', '.join(summary['algorithms'])}",
    ]
    run = summary.get("run")
    if run and run.get("seconds_per_step") is not None:
        lines.append(
            f"speed {run['seconds_per_step']:.3g} s/step (median), "
            f"{run['tokens_per_s']:,.0f} tokens/s; peak memory (RSS) {run['peak_rss_gb']:.2f} GB"
        )
    if val["loss"] is None:
        looked = " or ".join(repr(k) for k in val.get("looked_for", ["val/loss"]))
        lines.append(f"validation: no {looked} logged ({val.get('note')})")
    else:
        baseline = val["unigram_loss"]
        extra = f"   (unigram baseline {baseline:.4f})" if baseline is not None else ""
        lines.append(
            f"validation at step {val['step']} ({val.get('key')!r}): loss {val['loss']:.4f} "
            f"nats/token, perplexity {val['ppl']:.3f}{extra}"
        )
    if summary.get("stages"):
        lines.append("stages: " + ", then ".join(_stage_text(st) for st in summary["stages"]))
    if sp["layers"]:
        lines.append(
            f"sparsity at the end: {sp['sparse_layers']:.2%} of the sparse layers "
            f"({len(sp['layers'])} tensors), {sp['model']:.2%} of all {sp['params']:,} "
            f"parameters ({sp['nonzeros']:,} nonzero, kept)"
        )
    else:
        lines.append(
            f"sparsity at the end: no masked layers; {sp['model']:.2%} of all {sp['params']:,} "
            f"parameters are zero ({sp['nonzeros']:,} nonzero)"
        )
    if layers and sp["layers"]:
        width = max(len(n) for n in sp["layers"])
        lines += [f"  {name:<{width}}  {s:7.2%}" for name, s in sp["layers"].items()]
    train, dense_train = fl["train"], fl["train_dense"]
    inf, inf_dense = fl["inference_per_token"], fl["inference_per_token_dense"]
    lines.append(f"{'FLOPs':<22}{'sparse':>12}{'dense':>12}{'dense/sparse':>14}")
    for what, sparse, dense in (
        ("training (total)", train, dense_train),
        ("inference (per token)", inf, inf_dense),
    ):
        lines.append(f"{what:<22}{sparse:>12.3e}{dense:>12.3e}{_ratio(dense, sparse):>13.2f}x")
    if fl["dense_grad_steps"]:
        lines.append(
            f"  training includes {fl['dense_grad_extra']:.3e} FLOPs of dense weight gradients "
            f"on {fl['dense_grad_steps']} mask-update steps"
        )
    device = summary.get("device")
    if device:
        lines += [
            f"WSE device ({device['steps']} steps; Linear-layer matmuls, training and validation):",
            f"  FLOPs executed {device['flops_executed']:.3e} vs {device['flops_dense']:.3e} "
            f"dense ({_ratio(device['flops_dense'], device['flops_executed']):.2f}x fewer), "
            f"{device['dense_grad_steps']} steps with dense weight gradients",
            f"  weights in CSR {device['weight_bytes_csr']:,} bytes (training and inference) "
            f"vs {device['weight_bytes_dense']:,} dense",
            f"  CSR rebuilds {device['rebuilds']} ({device['rebuild_seconds']:.2f} s)",
        ]
    return "\n".join(lines)


def flat_summary(summary: dict[str, Any], prefix: str = "summary") -> dict[str, Any]:
    """A `SparseRunSummary.build` result as flat ``<prefix>/<key>/<key>`` -> scalar (for a W&B
    run summary): nested dicts are followed, ``algorithms`` joined with ``+``, ``stages`` as
    text (``sparse 80.0% for steps 0-40``); the curves are left out (they are logged metrics)."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}/{key}"
        if key in ("val_curve", "train_curve", "looked_for"):
            continue
        if key == "stages":
            out[name] = ", then ".join(_stage_text(st) for st in value)
        elif key == "algorithms":
            out[name] = "+".join(value)
        elif isinstance(value, Mapping):
            out.update(flat_summary(dict(value), name))
        elif value is None or isinstance(value, str | int | float | bool):
            out[name] = value
    return out


def _stage_text(stage: dict[str, Any]) -> str:
    """``sparse 90.0% for steps 0-300`` / ``sparse 50.0% -> 80.0% ...`` / ``dense for ...``."""
    first, end = stage["steps"]
    if stage["kind"] == "dense":
        return f"dense for steps {first}-{end}"
    start, last = stage["sparsity"]
    ramp = f" -> {last:.1%}" if f"{start:.1%}" != f"{last:.1%}" else ""
    return f"sparse {start:.1%}{ramp} for steps {first}-{end}"


def final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    values = {
        "summary/val_loss": summary["val"]["loss"],
        "summary/val_ppl": summary["val"]["ppl"],
        "summary/train_flops": summary["flops"]["train"],
        "summary/train_flops_dense": summary["flops"]["train_dense"],
        "summary/inference_flops_per_token": summary["flops"]["inference_per_token"],
        "summary/sparsity": summary["sparsity"]["sparse_layers"],
        "summary/wall_time_s": summary["wall_time_s"],
        **{f"summary/{k}": v for k, v in (summary.get("run") or {}).items()},
    }
    return {k: float(v) for k, v in values.items() if v is not None}


def _ratio(dense: float, sparse: float) -> float:
    return dense / sparse if sparse else float("nan")
