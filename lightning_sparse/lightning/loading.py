"""Loading a sparse checkpoint into a LightningModule that has no sparsity algorithm applied.

A sparse checkpoint's ``state_dict`` holds ``<param>_mask`` entries (`SparseParameter`). Lightning
loads it with ``load_state_dict(strict=True)``, which refuses them ("Unexpected key(s)") unless
the module carries the mask buffers. Both loading paths, ``LightningModule.load_from_checkpoint``
and ``trainer.validate/test/predict/fit(ckpt_path=...)``, call the module's
``on_load_checkpoint(checkpoint)`` *before* that ``load_state_dict``, so that hook registers the
missing buffers (`restore_checkpoint_masks`) and the checkpoint loads as it is, masks included.

A sparsity callback in the Trainer applies its algorithm at ``setup``, before the checkpoint is
restored: the algorithm then owns the masks and checks the incoming ones itself, and this hook
leaves them alone. The callback cannot help a module loaded without it (it is not there), and
writing masks elsewhere in the checkpoint would break resuming and the Cerebras layout (masks in
the model state dict); a module that neither uses `SparseLoadingMixin` nor overrides the hook can
load with ``strict_loading = False`` (weights load, pruned ones zero; the masks are dropped) or
from ``strip_masks(checkpoint["state_dict"])``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_sparse.core.algorithms import algorithms_of
from lightning_sparse.core.masking import zero_pruned_
from lightning_sparse.core.state_dict import mask_keys, restore_masks

__all__ = ["SparseLoadingMixin", "restore_checkpoint_masks"]


def restore_checkpoint_masks(module: nn.Module, checkpoint: dict[str, Any]) -> list[str]:
    """Ready ``module`` for ``module.load_state_dict(checkpoint["state_dict"])`` of a sparse
    checkpoint: register the mask buffers it lacks (`restore_masks`), and replace each of their
    weights in ``checkpoint["state_dict"]`` by a copy that is zero at pruned positions (it already
    is in any checkpoint this package wrote; the tensors the caller holds are not modified).

    Does nothing when a sparsity algorithm is applied to ``module`` or a submodule: the algorithm
    owns the masks, and its load pre-hook checks the incoming ones and prunes after loading.

    Args:
        module: the LightningModule (the state dict's keys start at it).
        checkpoint: a Lightning checkpoint dict; one without ``"state_dict"`` is left alone.

    Returns:
        The mask keys registered.

    Raises:
        ValueError: a mask's shape differs from its parameter's, or a mask is not 0/1 (see
            `restore_masks`); nothing was registered and the checkpoint is unchanged.
    """
    state = checkpoint.get("state_dict")
    if state is None or any(algorithms_of(m) for m in module.modules()):
        return []
    registered = restore_masks(module, state)  # checks every mask before it registers any
    weights = mask_keys(state)
    for key in registered:
        weight = state[weights[key]]
        mask = state[key].to(weight.device, torch.bool)
        state[weights[key]] = zero_pruned_(weight.detach().clone(), mask)
    return registered


class SparseLoadingMixin:
    """Mix into a LightningModule (before ``LightningModule``) so its sparse checkpoints load with
    ``load_from_checkpoint`` and ``trainer.validate/test/predict(ckpt_path=...)``, with or
    without the sparsity callback, the masks restored bit-exactly::

        class MyModule(SparseLoadingMixin, L.LightningModule): ...

        model = MyModule.load_from_checkpoint("last.ckpt")  # carries the checkpoint's masks

    A module that defines its own ``on_load_checkpoint`` must call
    ``super().on_load_checkpoint(checkpoint)`` in it, or the masks are not restored.
    """

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Register the checkpoint's masks (`restore_checkpoint_masks`), then the next hook."""
        restore_checkpoint_masks(self, checkpoint)  # type: ignore[arg-type]
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
