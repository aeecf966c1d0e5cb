"""`sparsity_report`: per-parameter shape / sparsity / nonzeros of a model, and totals."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import nn

from .sharding import full
from .sparse_parameter import mask_buffer_name

__all__ = ["SparsityReport", "host_counts", "itop_rate", "overall_sparsity", "sparsity_report"]


class ReportRow(TypedDict):
    """One parameter's row of a `SparsityReport`."""

    shape: tuple[int, ...]
    numel: int
    nonzeros: int
    sparsity: float
    masked: bool


@dataclass(frozen=True)
class SparsityReport:
    """Rows per parameter (``name -> {"shape", "numel", "nonzeros", "sparsity", "masked"}``)."""

    rows: dict[str, ReportRow] = field(default_factory=dict)

    @property
    def totals(self) -> dict[str, float]:
        """Totals over all parameters and over masked (sparse) parameters only."""
        numel = sum(int(r["numel"]) for r in self.rows.values())
        nnz = sum(int(r["nonzeros"]) for r in self.rows.values())
        masked = [r for r in self.rows.values() if r["masked"]]
        m_numel = sum(int(r["numel"]) for r in masked)
        m_nnz = sum(int(r["nonzeros"]) for r in masked)
        return {
            "params": numel,
            "nonzeros": nnz,
            "sparsity": 1.0 - nnz / numel if numel else 0.0,
            "sparse_params": m_numel,
            "sparse_nonzeros": m_nnz,
            "sparse_sparsity": 1.0 - m_nnz / m_numel if m_numel else 0.0,
        }

    def as_dict(self) -> dict[str, object]:
        """``{"params": rows, "totals": totals}`` (plain Python values)."""
        return {"params": dict(self.rows), "totals": self.totals}

    def __str__(self) -> str:
        width = max([len(n) for n in self.rows] + [9])
        lines = [f"{'parameter':<{width}}  {'shape':>16}  {'nonzeros':>10}  {'sparsity':>8}"]
        for name, r in self.rows.items():
            mark = "" if r["masked"] else " (dense)"
            shape = "x".join(str(s) for s in r["shape"])
            lines.append(
                f"{name:<{width}}  {shape:>16}  {r['nonzeros']:>10}  {r['sparsity']:>8.2%}{mark}"
            )
        t = self.totals
        lines.append(
            f"{'total':<{width}}  {t['params']:>16}  {t['nonzeros']:>10}  {t['sparsity']:>8.2%}"
        )
        lines.append(
            f"{'total (sparse layers)':<{width}}  {t['sparse_params']:>16}  "
            f"{t['sparse_nonzeros']:>10}  {t['sparse_sparsity']:>8.2%}"
        )
        return "\n".join(lines)


@torch.no_grad()
def host_counts(tensors: list[torch.Tensor]) -> list[int]:
    """The nonzeros of each tensor, read to the host in one transfer per device (not one
    ``int(count_nonzero)`` each: a host sync per tensor on a GPU)."""
    counts: list[int] = [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        stacked = torch.stack([full(tensors[i].count_nonzero()) for i in indices])
        for i, value in zip(indices, stacked.tolist(), strict=True):
            counts[i] = int(value)
    return counts


@torch.no_grad()
def sparsity_report(model: nn.Module, masked_only: bool = False) -> SparsityReport:
    """Shape, nonzeros and sparsity of every parameter (one host transfer per device).

    Nonzeros are the mask's kept count where a ``<param>_mask`` exists, otherwise the count of
    nonzero values.

    Args:
        model: any module, sparsified or not.
        masked_only: list only parameters that have a mask.
    """
    rows: dict[str, ReportRow] = {}
    modules = dict(model.named_modules())
    found = []
    for name, param in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        mask = modules[module_name]._buffers.get(mask_buffer_name(attr))
        if not (masked_only and mask is None):
            found.append((name, param, mask))
    nonzeros = host_counts([m if m is not None else p.detach() for _, p, m in found])
    for (name, param, mask), nnz in zip(found, nonzeros, strict=True):
        numel = param.numel()
        rows[name] = {
            "shape": tuple(param.shape),
            "numel": numel,
            "nonzeros": nnz,
            "sparsity": 1.0 - nnz / numel if numel else 0.0,
            "masked": mask is not None,
        }
    return SparsityReport(rows)


def overall_sparsity(
    params: Mapping[str, Any], mask_target: Callable[[str], float]
) -> tuple[float, torch.Tensor]:
    """(target, actual) over sparse parameters, weighted by size.

    Args:
        params: ``{name: SparseParameter}`` (an algorithm's or a Group's).
        mask_target: the sparsity each one's current mask was built for.

    Returns:
        The target as a float and the actual sparsity as a 0-d tensor (no host sync).
    """
    if not params:
        return 0.0, torch.zeros(())
    sizes = {n: sp.mask.numel() for n, sp in params.items()}
    total = sum(sizes.values())
    target = sum(mask_target(n) * s for n, s in sizes.items()) / total
    kept = torch.stack([sp.nnz for sp in params.values()]).sum()
    return target, 1.0 - kept / total


def itop_rate(ever_active: dict[str, torch.Tensor]) -> torch.Tensor:
    """Share of the weights that were ever active (Liu et al. 2021, arXiv:2102.02887), 0-d."""
    if not ever_active:
        return torch.zeros(())
    ever = torch.stack([full(m.count_nonzero()) for m in ever_active.values()]).sum()
    return ever / sum(m.numel() for m in ever_active.values())
