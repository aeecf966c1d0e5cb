"""Gradient clipping that works under mixed precision with a fused optimizer.

Lightning's `MixedPrecision` plugin (``precision="16-mixed"`` or ``"bf16-mixed"``) refuses
gradient clipping with an optimizer that unscales gradients inside its own step
(``_step_supports_amp_scaling``: the fused AdamW, Adam, SGD and Adagrad), even under
``bf16-mixed``, which has no GradScaler and so nothing to unscale. A LightningModule that calls
`clip_gradients` from its ``configure_gradient_clipping`` hook clips there too:

1. No GradScaler (``bf16-mixed``): the gradients are the true ones; they are clipped directly
   (``torch.nn.utils.clip_grad_norm_`` or ``clip_grad_value_``, as the Trainer's
   ``gradient_clip_algorithm`` says).
2. A GradScaler (``16-mixed``): ``scaler.unscale_(optimizer)`` first, then the clip. The scaler
   records the optimizer as unscaled, so its ``step`` hands the fused step ``grad_scale=None``
   with the ``found_inf`` of that unscale: the gradients are not divided twice, and a step whose
   gradients overflowed is still skipped.

Every other case (an optimizer that does not unscale itself, 32-bit, ``bf16-true``, FSDP or
DeepSpeed precision) is Lightning's own clipping, unchanged.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

__all__ = ["clip_gradients", "unscales_in_step"]


def unscales_in_step(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` unscales the gradients itself when a GradScaler steps it
    (torch's fused optimizers), the optimizers Lightning's `MixedPrecision` will not clip for."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def clip_gradients(
    module: pl.LightningModule,
    optimizer: Optimizer,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str | None = None,
) -> None:
    """Clip the gradients of ``optimizer``'s parameters for ``module``'s Trainer, where
    Lightning's `MixedPrecision` refuses to (see the module docstring), else as Lightning does.

    Call it from ``LightningModule.configure_gradient_clipping`` with the hook's arguments.

    Args:
        module: The LightningModule being trained (attached to a Trainer).
        optimizer: The optimizer about to step.
        gradient_clip_val: Clip threshold (the norm for ``"norm"``, the absolute value for
            ``"value"``); ``None`` takes the Trainer's ``gradient_clip_val``; 0 clips nothing.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``; ``None`` takes the Trainer's
            (default ``"norm"``).

    Raises:
        ValueError: ``gradient_clip_algorithm`` is neither ``"norm"`` nor ``"value"``.
    """
    plugin = module.trainer.precision_plugin
    if not (isinstance(plugin, MixedPrecision) and unscales_in_step(optimizer)):
        module.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        return
    clip_val = module.trainer.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
    if not clip_val or clip_val <= 0:
        return
    algorithm = (
        gradient_clip_algorithm or module.trainer.gradient_clip_algorithm or "norm"
    ).lower()
    if not GradClipAlgorithmType.supported_type(algorithm):
        raise ValueError(
            f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not a clipping algorithm: "
            f"it must be one of {GradClipAlgorithmType.supported_types()}; pass one of them "
            "(or None for the Trainer's, by default 'norm')"
        )
    if plugin.scaler is not None:
        # Once per step (a second call raises): the fused step then takes these gradients as
        # unscaled, and found_inf from here.
        plugin.scaler.unscale_(optimizer)
    params = list(plugin.main_params(optimizer))
    if algorithm == GradClipAlgorithmType.VALUE:
        torch.nn.utils.clip_grad_value_(params, clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip_val)
