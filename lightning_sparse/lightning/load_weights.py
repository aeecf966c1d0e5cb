"""`LoadWeights`: start a run from another run's weights (the next stage of a chained run).

Unlike ``fit(ckpt_path=...)``, which resumes a run (optimizer, LR schedule, step counter and
callback states included), this only initialises the LightningModule's weights, so the new run
starts its own optimizer and schedule: Variable SPDF's dense stage as a separate run after a
sparse one, or dense fine-tuning after sparse pre-training (SPDF). A sparse checkpoint's weights
are already 0 where pruned (its masks are in the sparsity callback's state, not loaded here);
``drop_masks`` removes the ``<param>_mask`` entries that checkpoints of earlier versions hold, so
those load into a dense model too.

The file is read weights-only (`load_torch_file`): a file holding other Python objects is refused
unless ``trust_file=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_sparse.core.legacy import mask_keys
from lightning_sparse.core.safe_load import load_torch_file
from lightning_sparse.lightning.callback import check_accelerator

__all__ = ["LoadWeights", "drop_mask_entries"]


def drop_mask_entries(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` without the ``<param>_mask`` entries of its parameters."""
    masks = mask_keys(state_dict)
    return {key: value for key, value in state_dict.items() if key not in masks}


class LoadWeights(pl.Callback):
    """Load a checkpoint's weights into the LightningModule at setup.

    List it before any sparsity callback of the new run: the algorithm is then applied to the
    loaded weights (``init_method="topk"`` or ``"from_zeros"`` choose masks from them). Listed
    after one, the loaded weights are pruned with that algorithm's masks.

    Args:
        path: a Lightning checkpoint (its ``state_dict``) or a file holding a plain state dict.
        drop_masks: leave out the ``<param>_mask`` entries of an earlier version's checkpoint
            (sparse weights into a dense model).
        strict: as ``nn.Module.load_state_dict``.
        trust_file: also unpickle objects other than tensors and plain values; a crafted file
            runs code when read, so only for a file from a source you trust.

    Raises:
        FileNotFoundError: (at setup) ``path`` does not exist.
        UntrustedFileError: (at setup) the file holds other objects and ``trust_file`` is off.
        ValueError: (at setup) the file is not a checkpoint ``torch.load`` reads.
    """

    def __init__(
        self, path: str, drop_masks: bool = True, strict: bool = True, trust_file: bool = False
    ) -> None:
        self.path = path
        self.drop_masks = drop_masks
        self.strict = strict
        self.trust_file = trust_file
        self.loaded = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Load once, before optimizers exist (a later ``ckpt_path`` restore still wins)."""
        if self.loaded:
            return
        check_accelerator(trainer)  # a run the accelerator refuses must not change the weights
        if not Path(self.path).is_file():
            raise FileNotFoundError(
                f"LoadWeights: checkpoint {self.path!r} does not exist; run the previous stage "
                "first, or fix the path"
            )
        checkpoint = load_torch_file(
            self.path,
            trust_file=self.trust_file,
            what="LoadWeights: checkpoint",
            opt_in="LoadWeights(trust_file=True) (in a recipe: init_args: {trust_file: true})",
        )
        state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
        if not isinstance(state, dict):
            raise ValueError(
                f"LoadWeights: checkpoint {self.path!r} holds a {type(checkpoint).__name__}, not "
                "a state dict; pass a Lightning checkpoint or a torch.save'd state_dict()"
            )
        if self.drop_masks:
            state = drop_mask_entries(state)
        pl_module.load_state_dict(state, strict=self.strict)
        self.loaded = True
        if trainer.is_global_zero:
            print(f"LoadWeights: loaded {len(state)} tensors from {self.path}", flush=True)
