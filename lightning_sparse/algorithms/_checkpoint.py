"""Loading a state dict into a sparse model: masks must fit, dense checkpoints get our masks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_sparse.algorithms.base import SparsityAlgorithm


def check_incoming_masks(
    algorithm: SparsityAlgorithm, root: nn.Module, state_dict: dict[str, Any], prefix: str
) -> None:
    """Check (and complete) the ``*_mask`` entries of ``state_dict`` before ``root`` loads it.

    A checkpoint without a mask for one of ``algorithm``'s parameters (a dense checkpoint) gets
    the current mask, so strict loading succeeds and the post-load hook prunes the loaded
    weights. Raises ``ValueError``, before anything is loaded, for a mask of the wrong shape, a
    non-0/1 mask, or a mask for a parameter that no algorithm on ``root`` sparsifies.

    Args:
        algorithm: the algorithm whose masks are checked.
        root: the module the algorithm was applied to (``state_dict`` keys start at it).
        state_dict: the dict being loaded (torch passes a copy; it is completed in place).
        prefix: key prefix of ``root`` inside ``state_dict``.
    """
    for name, sp in algorithm.sparse_params.items():
        key = f"{prefix}{name}_mask"
        if key not in state_dict:
            state_dict[key] = sp.mask.clone()
            continue
        incoming = state_dict[key]
        if tuple(incoming.shape) != tuple(sp.mask.shape):
            raise ValueError(
                f"checkpoint mask {key!r} has shape {tuple(incoming.shape)} but parameter "
                f"{name!r} has shape {tuple(sp.mask.shape)}; the checkpoint was saved from a "
                "different model configuration"
            )
        if incoming.dtype != torch.bool:
            if not bool(((incoming == 0) | (incoming == 1)).all()):
                raise ValueError(f"checkpoint mask {key!r} must hold only 0/1 or bool values")
            state_dict[key] = incoming.to(torch.bool)
    claimed = {
        f"{prefix}{name}_mask"
        for other in root.__dict__.get("_lightning_sparse_algorithms", [algorithm])
        for name in other.sparse_params
    }
    params = {f"{prefix}{n}" for n, _ in root.named_parameters()}
    foreign = [
        k
        for k in state_dict
        if k.startswith(prefix)
        and k.endswith("_mask")
        and k[: -len("_mask")] in params
        and k not in claimed
    ]
    if foreign:
        raise ValueError(
            f"checkpoint has masks for {foreign[:3]} which this sparsity configuration leaves "
            "dense; include those parameters in param_filter, or drop the keys to load them dense"
        )
