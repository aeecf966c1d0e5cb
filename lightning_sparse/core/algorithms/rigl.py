"""`RigL`: drop by magnitude, regrow by the magnitude of the dense gradient.

Evci et al., "Rigging the Lottery: Making All Tickets Winners", ICML 2020, arXiv:1911.11134.
SET's rule with another grow score. The dense gradient is the full accumulated (and, under DDP,
all-reduced) gradient: on update steps the gradient hooks leave it dense through backward, so
nothing extra is held in memory and nothing goes into checkpoints.
"""

from __future__ import annotations

import torch

from .drop_grow import DropAndGrow, dense_grad_score

__all__ = ["RigL"]


class RigL(DropAndGrow):
    """Drop the smallest-|w| ``drop_fraction`` of active weights; regrow the largest-|grad|.

    Args: as ``DropAndGrow``. (Cerebras' ``balance_in_groups`` / ``balance_out_groups`` are
    accepted by ``configure`` and become ``shaper``.)
    """

    needs_dense_grad = True
    grows_by_grad_magnitude = True

    def grow_score(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """``|dense gradient|``."""
        return dense_grad_score(p, name)
