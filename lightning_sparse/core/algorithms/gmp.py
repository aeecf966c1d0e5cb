"""`GMP`: gradual magnitude pruning to a scheduled sparsity.

Zhu & Gupta, "To prune, or not to prune: exploring the efficacy of pruning for model
compression", arXiv:1710.01878. Each update keeps the largest-|w| weights at the scheduled
sparsity (typically ``{"type": "cubic", ...}``, the paper's schedule); an update also happens at
the ramp's end whatever the cadence, so the final sparsity is always reached.
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributions import global_magnitude
from ..install import NewMask
from ..mask_ops import topk_mask
from ..schedules import Constant
from ..sharding import full, shard_like
from .base import SparsityAlgorithm

__all__ = ["GMP"]


class GMP(SparsityAlgorithm):
    """Gradual magnitude pruning. Arguments as ``SparsityAlgorithm``, plus
    ``distribution="global"``: one magnitude ranking over all parameters at each update.

    Raises:
        ValueError: for a constant sparsity (nothing gradual: use ``Static``).
    """

    def __init__(self, *args: Any, distribution: str = "uniform", **kwargs: Any) -> None:
        self.global_ranking = distribution == "global"
        kwargs["distribution"] = "uniform" if self.global_ranking else distribution
        super().__init__(*args, **kwargs)
        if isinstance(self.sparsity, Constant):
            raise ValueError(
                f"GMP got the constant sparsity {self.sparsity(0)}; GMP prunes gradually, so give "
                "a schedule such as {'type': 'cubic', 'init': 0.0, 'final': 0.8, 'begin': 0, "
                "'end': 1000}, or use Static for a fixed sparsity"
            )

    def milestones(self) -> tuple[int, ...]:
        """The ramp's end, so the final sparsity is reached whatever the cadence."""
        return self.sparsity.milestones()

    def compute_masks(self, targets: dict[str, float]) -> dict[str, NewMask]:
        """Per parameter, or one global ranking with ``distribution="global"``."""
        if not self.global_ranking:
            return super().compute_masks(targets)
        target = float(self.sparsity(self.step))
        weights = {name: full(sp.param.detach()) for name, sp in self.sparse_params.items()}
        masks = global_magnitude(weights, target)
        return {name: shard_like(masks[name], sp.param) for name, sp in self.sparse_params.items()}

    def update_mask(
        self, name: str, p: torch.Tensor, mask: torch.Tensor, sparsity: float
    ) -> torch.Tensor:
        """Top-``int((1 - s) n)`` of ``|p|`` per shaper row."""
        score = self.shaper.shape(p.abs())
        keep = self.shaper.keep_per_row(sparsity, score.shape[-1])
        return self.shaper.unshape(topk_mask(score, keep), p.shape)
