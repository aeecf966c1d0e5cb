"""Installing an update's new masks: copied in place, the update's figures recorded, weights pruned.

An update computes every new mask first (`SparsityAlgorithm.compute_masks`); `install` then writes
them. On a GPU each aten op is a kernel launch, and a model has many masked weights of few shapes
(a Llama block: q, k, v, o of one shape, the MLP's of two more), so the masks of one shape
(`stack_key`) are installed together: their figures (dropped, grown, kept, ever active) over the
stacked masks (`update_figures`, which works row by row, so each weight gets its own) and one
fused copy; a sharded mask alone (`install_one`). Then one pruning pass over the weights
(`StepHooks.prune`; a weight held elsewhere has its holder follow its mask, `held`). The figures
are 0-d tensors on the masks' device: no host sync.

Not pure: `install` writes the masks, the ever-active sets (ITOP) and the weights in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import held
from .bitpack import pack_bits, unpack_bits
from .mask_ops import row_counts
from .per_step import StepHooks
from .sharding import full, is_sharded
from .sparse_parameter import SparseParameter

__all__ = ["Packed", "UpdateFigures", "by_key", "install", "pending", "stack_key", "update_figures"]

Stats = dict[str, dict[str, torch.Tensor]]  # {param name: {figure: 0-d tensor}}


@dataclass(frozen=True)
class Packed:
    """A new mask kept as packed bits (`bitpack`) until `install`: what an update holds for a
    weight whose values are held elsewhere (`held`), so that a model built sparse never holds a
    second byte per masked weight between computing its masks and installing them."""

    bits: torch.Tensor  # uint8 [ceil(numel / 8)]
    shape: torch.Size

    def unpack(self) -> torch.Tensor:
        return unpack_bits(self.bits, self.shape)


NewMask = torch.Tensor | Packed


def pending(sp: SparseParameter, mask: torch.Tensor) -> NewMask:
    """``mask``, ``sp``'s new mask, as the update keeps it until `install`: packed for a weight
    held elsewhere (a device's compact layer: its masks are most of what the model holds),
    as it is otherwise."""
    if held.holder_of(sp.param) is None or is_sharded(mask):
        return mask
    return Packed(pack_bits(mask), mask.shape)


def install(
    sparse_params: Mapping[str, SparseParameter],
    masks: Mapping[str, NewMask],
    hooks: StepHooks,
) -> Stats:
    """Copy ``masks`` into the mask buffers of ``sparse_params`` and prune the weights (one
    pass); returns ``dropped`` / ``grown`` / ``sparsity`` (and ``itop``) per parameter."""
    stats: Stats = {}
    with torch.no_grad():
        keys = {n: stack_key(sparse_params[n], m) for n, m in masks.items()}
        for names in by_key(keys):
            first = masks[names[0]]
            if keys[names[0]] == (names[0],):
                mask = first.unpack() if isinstance(first, Packed) else first
                stats[names[0]] = install_one(sparse_params[names[0]], mask)
            else:
                sps = [sparse_params[n] for n in names]
                figures = install_stacked(sps, [_tensor(masks[n]) for n in names])
                stats.update(zip(names, figures, strict=True))
        hooks.prune([sparse_params[n] for n in masks])  # one pass
    return stats


def by_key(keys: Mapping[str, Hashable]) -> list[list[str]]:
    """Names grouped by equal keys, in first-seen order (each group keeps the names' order)."""
    groups: dict[Hashable, list[str]] = {}
    for name, key in keys.items():
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _tensor(mask: NewMask) -> torch.Tensor:
    assert not isinstance(mask, Packed)  # packed masks are installed alone (`stack_key`)
    return mask


def stack_key(sp: SparseParameter, mask: NewMask) -> tuple[Any, ...]:
    """Masks installed together share this key: shape, device, ITOP; a sharded one, and a
    packed one (`pending`: a stack would hold every weight's mask twice), alone."""
    if isinstance(mask, Packed) or is_sharded(sp.mask) or is_sharded(mask):
        return (sp.name,)
    return (tuple(mask.shape), mask.device, sp.ever_active is not None)


def install_one(sp: SparseParameter, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Install the new ``mask`` of ``sp`` alone (a sharded one); its figures."""
    old = sp.mask
    stats = {
        "dropped": full((old & ~mask).count_nonzero()),
        "grown": full((mask & ~old).count_nonzero()),
    }
    old.copy_(mask)
    ever = sp.ever_active
    if ever is not None:
        ever |= mask
        stats["itop"] = full(ever.count_nonzero()) / mask.numel()
    stats["sparsity"] = 1.0 - sp.nnz / mask.numel()
    return stats


def install_stacked(
    sps: Sequence[SparseParameter], new: Sequence[torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """Install the new masks ``new`` of ``sps`` (one `stack_key`): their figures over the
    stacked masks (`update_figures`) and one fused copy; the figures of each, in order."""
    evers = [sp.ever_active for sp in sps]
    tracked = [e for e in evers if e is not None]
    figures = update_figures(
        torch.stack([full(sp.mask) for sp in sps]),
        torch.stack([full(m) for m in new]),
        tracked if tracked else None,
    )
    torch._foreach_copy_([sp.mask for sp in sps], list(new))
    numel = new[0].numel()
    sparsity = 1.0 - figures.kept / numel
    itop = figures.ever / numel if figures.ever is not None else None
    out = []
    for i in range(len(sps)):
        stats = {"dropped": figures.dropped[i], "grown": figures.grown[i]}
        if itop is not None:
            stats["itop"] = itop[i]
        stats["sparsity"] = sparsity[i]
        out.append(stats)
    return out


@dataclass
class UpdateFigures:
    """One update of ``G`` same-shape masks, ``[G]`` tensors on their device (no host sync)."""

    dropped: torch.Tensor
    grown: torch.Tensor
    kept: torch.Tensor
    ever: torch.Tensor | None  # ever-active positions after the update, or None (no ITOP)


@torch.no_grad()
def update_figures(
    old: torch.Tensor, new: torch.Tensor, ever: Sequence[torch.Tensor] | None
) -> UpdateFigures:
    """Figures of replacing the stacked masks ``old`` by ``new`` (bool ``[G, *shape]``); the
    ever-active masks ``ever`` (``G`` bool tensors of ``shape``) are or-ed with ``new`` in
    place (one fused copy)."""
    flat_old, flat_new = old.flatten(1), new.flatten(1)
    dropped = row_counts(flat_old & ~flat_new)
    grown = row_counts(flat_new & ~flat_old)
    kept = row_counts(flat_new)
    ever_count = None
    if ever is not None:
        merged = torch.stack(list(ever)) | new
        torch._foreach_copy_(list(ever), list(merged.unbind(0)))
        ever_count = row_counts(merged.flatten(1))
    return UpdateFigures(dropped, grown, kept, ever_count)
