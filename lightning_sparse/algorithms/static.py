"""`Static`: a fixed mask chosen once at ``apply`` time and never changed.

The baseline of every sparse-training paper; with ``init_method="random"`` it is the "static
sparsity" row of Cerebras' Llama experiments (seed 000, Table 3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_sparse.algorithms.base import SparsityAlgorithm, validate_sparsity
from lightning_sparse.filters import ParamFilter

__all__ = ["Static"]


class Static(SparsityAlgorithm):
    """Prune each selected weight to ``sparsity`` once; the mask never changes.

    Args:
        sparsity: fraction of zeros in [0, 1), the same for every selected parameter.
        init_method: ``random`` (exact count, uniform), ``topk`` (largest magnitudes kept),
            ``from_zeros`` (keep the nonzeros of the weights as they are), ``checkerboard`` or a
            callable ``(p, sparsity, *, generator, shaper) -> mask``.
        param_filter: see ``SparsityAlgorithm``.
        seed: seeds the random mask through ``(seed, 0, parameter name)``.

    Raises:
        TypeError / ValueError: for a sparsity that is not a float in [0, 1).
    """

    def __init__(
        self,
        sparsity: float,
        init_method: str | Callable[..., torch.Tensor] = "random",
        param_filter: str | list[str] | ParamFilter | None = None,
        seed: int = 0,
    ) -> None:
        self.sparsity = validate_sparsity(sparsity)
        super().__init__(init_method=init_method, param_filter=param_filter, seed=seed)

    def target_sparsity(self, name: str, step: int) -> float:
        """The constant ``sparsity``."""
        return self.sparsity

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Nothing to do: a static mask never changes."""

    def state_dict(self) -> dict[str, Any]:
        """``{"step": ...}``; the masks themselves are ``<param>_mask`` buffers of the model."""
        return super().state_dict()
