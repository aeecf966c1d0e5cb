"""`GraNet`: gradual magnitude pruning with RigL-style prune-and-regrow.

Liu et al., "Sparse Training via Boosting Pruning Plasticity with Neuroregeneration", NeurIPS
2021, arXiv:2106.10404. At each update the sparsity follows a cubic schedule from an initial to a
final level (dense-to-sparse when ``init=0``, sparse-to-sparse otherwise): the surplus above the
new target is pruned by magnitude, then ``drop_fraction`` of the remaining connections are
dropped by magnitude and as many regrown by dense-gradient magnitude.
"""

from __future__ import annotations

import torch

from lightning_sparse.algorithms._drop_grow import shaped_drop_and_grow
from lightning_sparse.algorithms.rigl import RigL

__all__ = ["GraNet"]


class GraNet(RigL):
    """RigL whose target grows on a schedule, pruning the surplus by magnitude each update.

    Arguments as ``RigL``; ``sparsity`` is normally ``{"type": "cubic", "init": s_i,
    "final": s_f, "begin": t0, "end": t1}``.
    """

    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Prune the surplus to ``sparsity`` by ``|p|``, then drop and regrow by ``|grad|``."""
        drop = float(self.drop_fraction(self.step))
        return shaped_drop_and_grow(
            self.shaper, p, self.grow_score(p), mask, sparsity, drop, prune_to_target=True
        )
