"""`RigL`: drop by magnitude, regrow by the magnitude of the dense gradient.

Evci et al., "Rigging the Lottery: Making All Tickets Winners", ICML 2020, arXiv:1911.11134.
The dense gradient is the full accumulated gradient (all micro-batches of gradient accumulation)
and, under DDP, the all-reduced one: on update steps the gradient hooks leave gradients dense
through backward, so nothing extra is held in memory and nothing goes into checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_sparse.algorithms.dynamic import ScheduleSpec
from lightning_sparse.algorithms.set import SET
from lightning_sparse.shapers import InputGroups, OutputGroups

__all__ = ["RigL"]


class RigL(SET):
    """SET with gradient-based growth (the grow score is ``|dense gradient|``).

    Args:
        drop_fraction: as ``SET``.
        balance_in_groups / balance_out_groups: balance the mask over blocks of input columns /
            output rows (mutually exclusive); shorthand for ``shaper=InputGroups(n)`` /
            ``OutputGroups(n)``.
        **kwargs: see ``DynamicSparsityAlgorithm``.
    """

    needs_dense_grad = True

    def __init__(
        self,
        sparsity: ScheduleSpec,
        drop_fraction: ScheduleSpec = 0.3,
        balance_in_groups: int | None = None,
        balance_out_groups: int | None = None,
        **kwargs: Any,
    ) -> None:
        if balance_in_groups is not None and balance_out_groups is not None:
            raise ValueError(
                f"balance_in_groups={balance_in_groups} and balance_out_groups="
                f"{balance_out_groups} are mutually exclusive; set one of them"
            )
        if balance_in_groups is not None:
            kwargs["shaper"] = InputGroups(balance_in_groups)
        elif balance_out_groups is not None:
            kwargs["shaper"] = OutputGroups(balance_out_groups)
        super().__init__(sparsity, drop_fraction=drop_fraction, **kwargs)

    def grow_score(self, p: torch.Tensor) -> torch.Tensor:
        """``|grad|`` of the dense (unmasked) accumulated gradient."""
        if p.grad is None:
            raise RuntimeError(
                f"RigL needs the dense gradient of {self.name_of(p)!r} at an update step, but it "
                "is None; run backward before the optimizer step (and don't zero_grad in between)"
            )
        return p.grad.abs()
