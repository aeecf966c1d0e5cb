"""`SET`: sparse evolutionary training, drop by magnitude and regrow at random.

Mocanu et al., "Scalable training of artificial neural networks with adaptive sparse connectivity
inspired by network science", Nature Communications 2018, arXiv:1707.04780.
"""

from __future__ import annotations

import torch

from .drop_grow import DropAndGrow

__all__ = ["SET"]


class SET(DropAndGrow):
    """Drop the smallest-|w| ``drop_fraction`` of active weights; regrow as many at random.

    Args: as ``DropAndGrow`` (``sparsity``, ``drop_fraction``, ``update``, ...).
    """

    def grow_score(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """Uniform random scores from the ``(seed, step, name)`` stream (`generator`)."""
        return torch.rand(p.shape, generator=self.generator(name, p.device), device=p.device)
