"""Masks back on a LightningModule that loads a sparse checkpoint without the sparsity callback.

A checkpoint written with a sparsity callback holds the weights in ``state_dict`` (pruned ones
exactly 0) and the masks in the callback's state (``checkpoint["sparsity"]``), so any
LightningModule of the same architecture loads it with ``load_from_checkpoint`` or
``trainer.validate/test/predict(ckpt_path=...)``, no mixin needed: its outputs are the trained
model's. The module then carries no masks, which matters only to what reads them (the device,
a sparsity report, an export); with the callback in the Trainer, Lightning restores the
callback's state after the weights, masks included.

`SparseLoadingMixin` registers the checkpoint's masks too, as non-persistent buffers
(`lightning_sparse.core.state_dict.restore_masks`), in ``on_load_checkpoint``, which both loading
paths call before the model's ``load_state_dict``. It is still needed to load a checkpoint
written by an earlier version (masks as ``<param>_mask`` entries of ``state_dict``) into a module
without the callback: without it strict loading refuses those entries ("Unexpected key(s)").

A sparsity callback in the Trainer applies its algorithm at ``setup``, before the checkpoint is
restored: the algorithm then owns the masks and restores them itself, and the mixin leaves them
alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_sparse.core.algorithms import algorithms_of
from lightning_sparse.core.masking import zero_pruned_
from lightning_sparse.core.state_dict import checkpoint_masks, restore_masks

__all__ = ["SparseLoadingMixin", "restore_checkpoint_masks"]


def restore_checkpoint_masks(module: nn.Module, checkpoint: dict[str, Any]) -> list[str]:
    """Ready ``module`` for ``module.load_state_dict(checkpoint["state_dict"])`` of a sparse
    checkpoint and give it the checkpoint's masks: register the mask buffers it lacks
    (`restore_masks`: from the sparsity callback's state, or an earlier version's ``*_mask``
    entries, which the load then takes as the masks), and replace each of their weights in
    ``checkpoint["state_dict"]`` by a copy that is zero at pruned positions (it already is in
    any checkpoint this package wrote; the tensors the caller holds are not modified).

    Does nothing when a sparsity algorithm is applied to ``module`` or a submodule: the algorithm
    owns the masks and restores them (its callback state, or its load pre-hook).

    Args:
        module: the LightningModule (the checkpoint's names start at it).
        checkpoint: a Lightning checkpoint dict; one without ``"state_dict"`` is left alone.

    Returns:
        The mask buffer names registered.

    Raises:
        ValueError: a mask's shape differs from its parameter's, a mask is not 0/1, or a packed
            mask is corrupt (see `restore_masks`); nothing was registered and the checkpoint is
            unchanged.
    """
    state = checkpoint.get("state_dict")
    if state is None or any(algorithms_of(m) for m in module.modules()):
        return []
    masks = checkpoint_masks(checkpoint)  # checks every mask before anything is registered
    registered = restore_masks(module, checkpoint)
    for key in registered:
        name = key.removesuffix("_mask")
        if name in state:
            weight = state[name]
            mask = masks[name].to(weight.device, torch.bool)
            state[name] = zero_pruned_(weight.detach().clone(), mask)
    return registered


class SparseLoadingMixin:
    """Mix into a LightningModule (before ``LightningModule``) so that loading a sparse
    checkpoint with ``load_from_checkpoint`` or ``trainer.validate/test/predict(ckpt_path=...)``
    without the sparsity callback also registers its masks, bit-exact (for the device, a
    report, an export), and so that checkpoints of earlier versions load at all::

        class MyModule(SparseLoadingMixin, L.LightningModule): ...

        model = MyModule.load_from_checkpoint("last.ckpt")  # carries the checkpoint's masks

    A module that defines its own ``on_load_checkpoint`` must call
    ``super().on_load_checkpoint(checkpoint)`` in it, or the masks are not restored.
    """

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Register the checkpoint's masks (`restore_checkpoint_masks`), then the next hook."""
        # self is the LightningModule this is mixed into, whose hook super() reaches next.
        restore_checkpoint_masks(self, checkpoint)  # type: ignore[arg-type]
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
