"""Optimizer state under sparsity: which tensors to prune, and which optimizers keep zeros.

Pure functions over ``torch.optim.Optimizer`` objects; the per-step path (`per_step`) calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["same_shape_state", "sqrt_state", "state_keeps_zero"]

# Optimizers whose same-shape state stays exactly 0 where gradient and state are 0 (every term
# is a multiple of the gradient or of the state), and whose update is then 0 there too. Exact
# types only: a subclass may change the update.
_STATE_KEEPS_ZERO = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "NAdam", "RAdam", "Adagrad", "Adadelta", "ASGD", "RMSprop")
    if hasattr(torch.optim, name)
)


def state_keeps_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` keeps same-shape state, and a zero weight, at 0 where the
    gradient and the state are 0: a type of the table, with ``eps > 0`` (``eps == 0`` makes 0 / 0
    = NaN at pruned positions; a tensor ``eps`` is not inspected, to avoid a host sync)."""
    if type(optimizer) not in _STATE_KEEPS_ZERO:
        return False
    for group in optimizer.param_groups:
        eps = group.get("eps", 1.0)
        if not isinstance(eps, int | float) or eps <= 0:
            return False
    return True


# The state whose square root the update divides by, per optimizer type (exact types, their
# for-loop and foreach implementations): at a pruned position the numerator (``exp_avg``) is 0,
# so any positive value there leaves the update at 0.
_SQRT_STATE = {
    torch.optim.Adam: ("exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg_sq", "max_exp_avg_sq"),
}


def sqrt_state(
    optimizer: torch.optim.Optimizer, sparse_params: Sequence[Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The CPU state tensors ``optimizer.step()`` takes the square root of, with their masks
    (plain tensors: a sharded ``DTensor`` is left alone):
    Adam's and AdamW's ``exp_avg_sq`` (and ``max_exp_avg_sq``), unless ``fused``. Empty for any
    other optimizer. ``torch.sqrt`` on the CPU is several times slower on exact zeros than on
    other values (the fused kernel is not; benchmarks/README.md, "Figures behind the code"), and
    sparsity makes most entries exact zeros."""
    keys = _SQRT_STATE.get(type(optimizer))
    if keys is None or any(group.get("fused") for group in optimizer.param_groups):
        return [], []
    tensors, masks = [], []
    for sp in sparse_params:
        state = optimizer.state.get(sp.param, {})
        for key in keys:
            value = state.get(key)
            if (
                type(value) is torch.Tensor
                and value.device.type == "cpu"
                and not getattr(value, "requires_dense", False)
            ):
                tensors.append(value)
                masks.append(sp.mask)
    return tensors, masks


def same_shape_state(
    optimizer: torch.optim.Optimizer, sparse_params: Sequence[Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """The state tensors of ``optimizer`` shaped like their sparse parameter, with its mask.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        sparse_params: `SparseParameter` objects (``param``, ``mask``).

    Returns:
        ``(tensors, masks, opted_out)``: every state tensor of a parameter's shape (momentum,
        Adam's ``exp_avg`` / ``exp_avg_sq``, ...) and that parameter's bool mask, in pairs; and
        whether a same-shape tensor was left out because it has ``requires_dense = True``
        (Cerebras' per-state opt-out).
    """
    tensors, masks, opted_out = [], [], False
    for sp in sparse_params:
        param = sp.param
        for value in optimizer.state.get(param, {}).values():
            if torch.is_tensor(value) and value.shape == param.shape:
                if getattr(value, "requires_dense", False):
                    opted_out = True
                else:
                    tensors.append(value)
                    masks.append(sp.mask)
    return tensors, masks, opted_out
