"""`Static`: a fixed mask chosen once at ``apply`` time and never changed.

The baseline of every sparse-training paper; with ``init_method="random"`` it is the "static
sparsity" row of Cerebras' Llama experiments (seed 000, Table 3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import report, validate
from ..distributions import global_magnitude
from ..filters import ParamFilter
from ..schedules import NeverSchedule
from ..selection import Candidate
from ..shapers import Shaper
from ..sharding import full, shard_like
from .base import SparsityAlgorithm

__all__ = ["Static"]


class Static(SparsityAlgorithm):
    """Prune each selected weight to ``sparsity`` once; the mask never changes.

    Args:
        sparsity: fraction of zeros in [0, 1), the same for every selected parameter.
        init_method: ``random`` (exact count, uniform), ``topk`` (largest magnitudes kept),
            ``from_zeros`` (keep the nonzeros as they are), ``checkerboard`` or a callable.
        distribution: ``uniform``, ``er``, ``erk`` or ``global``: one magnitude ranking over all
            selected parameters (``init_method`` is then unused).
        param_filter, seed, erk_power_scale, shaper: see ``SparsityAlgorithm``.
    """

    def __init__(
        self,
        sparsity: float,
        init_method: str | Callable[..., torch.Tensor] = "random",
        param_filter: str | list[str] | ParamFilter | None = None,
        seed: int | None = None,
        distribution: str = "uniform",
        erk_power_scale: float = 1.0,
        shaper: Shaper | None = None,
    ) -> None:
        self.global_ranking = distribution == "global"
        super().__init__(
            validate.sparsity(sparsity),
            update=NeverSchedule(),
            init_method=init_method,
            param_filter=param_filter,
            seed=seed,
            shaper=shaper,
            distribution="uniform" if self.global_ranking else distribution,
            erk_power_scale=erk_power_scale,
            track_itop=False,
        )

    @property
    def starts_sparse(self) -> bool:
        """Always: the mask is built at ``apply``."""
        return True

    def initial_masks(self, chosen: list[Candidate]) -> list[torch.Tensor]:
        """``distribution="global"``: one magnitude ranking over all selected parameters."""
        if not self.global_ranking:
            return super().initial_masks(chosen)
        weights = {name: full(p.detach()) for name, _, _, p in chosen}
        masks = global_magnitude(weights, float(self.sparsity(0)))
        return [shard_like(masks[name], p) for name, _, _, p in chosen]

    def update_mask(
        self, name: str, p: torch.Tensor, mask: torch.Tensor, sparsity: float
    ) -> torch.Tensor:
        """Never called: a static mask never changes."""
        return mask

    def itop_rate(self) -> torch.Tensor:
        """The weights ever active are the kept ones: the density (0-d tensor)."""
        return report.itop_rate({n: sp.mask for n, sp in self.sparse_params.items()})
