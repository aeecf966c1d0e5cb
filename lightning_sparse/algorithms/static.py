"""`Static`: a fixed mask chosen once at ``apply`` time and never changed.

The baseline of every sparse-training paper; with ``init_method="random"`` it is the "static
sparsity" row of Cerebras' Llama experiments (seed 000, Table 3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_sparse.algorithms.base import SparsityAlgorithm, validate_sparsity
from lightning_sparse.distributions import global_magnitude
from lightning_sparse.filters import ParamFilter
from lightning_sparse.selection import Candidate
from lightning_sparse.shapers import Shaper
from lightning_sparse.sharding import full, shard_like

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
        distribution: ``uniform``, ``er``, ``erk`` (see ``SparsityAlgorithm``) or ``global``:
            one magnitude ranking over all selected parameters (init_method is then unused).
        erk_power_scale, shaper: see ``SparsityAlgorithm``.

    Raises:
        TypeError / ValueError: for a sparsity that is not a float in [0, 1).
    """

    def __init__(
        self,
        sparsity: float,
        init_method: str | Callable[..., torch.Tensor] = "random",
        param_filter: str | list[str] | ParamFilter | None = None,
        seed: int = 0,
        distribution: str = "uniform",
        erk_power_scale: float = 1.0,
        shaper: Shaper | None = None,
    ) -> None:
        self.sparsity = validate_sparsity(sparsity)
        self.global_ranking = distribution == "global"
        super().__init__(
            init_method=init_method,
            param_filter=param_filter,
            seed=seed,
            distribution="uniform" if self.global_ranking else distribution,
            erk_power_scale=erk_power_scale,
            track_itop=False,
            shaper=shaper,
        )

    def target_sparsity(self, name: str, step: int) -> float:
        """The constant ``sparsity``, spread over layers by ``distribution``."""
        return self.layer_sparsity(name, self.sparsity)

    def initial_masks(self, chosen: list[Candidate]) -> list[torch.Tensor]:
        """``distribution="global"``: one magnitude ranking over all chosen parameters."""
        if not self.global_ranking:
            return super().initial_masks(chosen)
        masks = global_magnitude(
            {name: full(p.detach()) for name, _, _, p in chosen}, self.sparsity
        )
        return [shard_like(masks[name], p) for name, _, _, p in chosen]

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Nothing to do: a static mask never changes."""

    def state_dict(self) -> dict[str, Any]:
        """``{"step": ...}``; the masks themselves are ``<param>_mask`` buffers of the model."""
        return super().state_dict()
