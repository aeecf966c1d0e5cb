"""Installing new masks: copy in place, prune, record the update's statistics.

Shared by every algorithm's ``update``. Statistics stay 0-d tensors (no host sync); the
observers and the Lightning logger read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..sharding import full

if TYPE_CHECKING:
    from .base import SparsityAlgorithm


def install_masks_(
    algorithm: SparsityAlgorithm, masks: dict[str, torch.Tensor], targets: dict[str, float]
) -> None:
    """Copy ``masks`` (name -> bool mask) into the mask buffers, prune the weights, record
    ``dropped`` / ``grown`` / ``sparsity`` / ``itop`` per parameter and tell the observers."""
    stats: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, mask in masks.items():
            sp = algorithm.sparse_params[name]
            old = sp.mask
            stats[name] = {
                "dropped": full((old & ~mask).count_nonzero()),
                "grown": full((mask & ~old).count_nonzero()),
            }
            old.copy_(mask)
            sp.prune_()
            ever = algorithm.ever_active.get(name)
            if ever is not None:
                ever |= mask
                stats[name]["itop"] = full(ever.count_nonzero()) / mask.numel()
            stats[name]["sparsity"] = 1.0 - sp.nnz / mask.numel()
    algorithm.last_update, algorithm.unlogged_update = stats, True
    algorithm.mask_targets.update({n: targets[n] for n in masks})
    algorithm.hooks.changed()  # gradients, weights and state are pruned again before the step
    algorithm.observers.emit_sparsity(algorithm)
    algorithm.observers.emit_update(algorithm, algorithm.step, stats)


def grads_finite(sparse_params: dict[str, Any]) -> bool:
    """Whether every sparse gradient is finite (one host sync; update steps under AMP only)."""
    grads = [sp.param.grad for sp in sparse_params.values() if sp.param.grad is not None]
    return not grads or bool(torch.stack([full(g.isfinite().all()) for g in grads]).all())
