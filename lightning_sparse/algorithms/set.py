"""`SET`: sparse evolutionary training, drop by magnitude and regrow at random.

Mocanu et al., "Scalable training of artificial neural networks with adaptive sparse connectivity
inspired by network science", Nature Communications 2018, arXiv:1707.04780.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_sparse.algorithms._drop_grow import shaped_drop_and_grow
from lightning_sparse.algorithms.dynamic import DynamicSparsityAlgorithm, ScheduleSpec
from lightning_sparse.schedules import make_hyperparam_schedule

__all__ = ["SET"]


class SET(DynamicSparsityAlgorithm):
    """Drop the smallest-|w| ``drop_fraction`` of active weights; regrow as many at random.

    Args:
        drop_fraction: share of active weights replaced per update; a float or a schedule
            (e.g. ``{"type": "cosine", "init": 0.3, "half_period": 3584}``).
        **kwargs: see ``DynamicSparsityAlgorithm`` (``sparsity``, ``update``, ...).
    """

    def __init__(
        self, sparsity: ScheduleSpec, drop_fraction: ScheduleSpec = 0.3, **kwargs: Any
    ) -> None:
        if isinstance(drop_fraction, int | float) and not 0.0 <= drop_fraction <= 1.0:
            raise ValueError(
                f"drop_fraction={drop_fraction!r} must be in [0, 1]: it is the share of active "
                "weights replaced per update (the RigL paper uses 0.3)"
            )
        super().__init__(sparsity, **kwargs)
        self.drop_fraction = make_hyperparam_schedule(drop_fraction)

    def grow_score(self, p: torch.Tensor) -> torch.Tensor | torch.Generator:
        """What ranks the candidates for growth: for SET, the ``(seed, step, name)`` stream.

        A generator means uniformly random growth: the same on every rank and after a resume.
        One long CPU row (``Unstructured``) draws only random positions; other layouts score
        every weight with ``torch.rand(p.shape)`` (``mask_ops.drop_and_grow_random``).
        Subclasses return a score tensor of ``p``'s shape instead (RigL: ``|grad|``).
        """
        return self.generator(p)

    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Drop by ``|p|``, regrow as many by ``grow_score``, keeping the target count."""
        drop = float(self.drop_fraction(self.step))
        return shaped_drop_and_grow(self.shaper, p, self.grow_score(p), mask, sparsity, drop)

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Update masks, then advance the drop-fraction schedule on update steps."""
        was = self._last_update_step
        super().update(optimizer)
        if self._last_update_step != was:
            self.drop_fraction.update(True)

    def state_dict(self) -> dict[str, Any]:
        """Adds the drop-fraction schedule's state."""
        return {**super().state_dict(), "drop_fraction": self.drop_fraction.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the drop-fraction schedule's state too."""
        super().load_state_dict(state_dict)
        self.drop_fraction.load_state_dict(state_dict.get("drop_fraction", {}))
