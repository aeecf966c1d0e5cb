"""The Lightning layer: algorithms as callbacks, checkpoint I/O, run summary and workflows.

Imports the core and Lightning only (never the device or the app).
"""

from lightning_sparse.lightning.algorithms import (
    GMP,
    SET,
    DropAndGrow,
    GraNet,
    Group,
    ModelZooSparsity,
    RigL,
    SparsityAlgorithm,
    Static,
    configure,
)
from lightning_sparse.lightning.callback import SparsityCallback
from lightning_sparse.lightning.checkpointing import AtomicCheckpointIO
from lightning_sparse.lightning.clipping import clip_gradients
from lightning_sparse.lightning.flop_counter import FlopCounter, FlopSegment
from lightning_sparse.lightning.imp import IterativePruning, imp_sparsity, rewind_lr_scheduler
from lightning_sparse.lightning.load_weights import LoadWeights, drop_mask_entries
from lightning_sparse.lightning.loading import SparseLoadingMixin, restore_checkpoint_masks
from lightning_sparse.lightning.spdf import VariableSPDF
from lightning_sparse.lightning.summary import SparseRunSummary

DynamicSparsityAlgorithm = SparsityAlgorithm  # an earlier name (core.legacy: removed in 0.3.0)

__all__ = [
    "GMP",
    "SET",
    "AtomicCheckpointIO",
    "DropAndGrow",
    "DynamicSparsityAlgorithm",
    "FlopCounter",
    "FlopSegment",
    "GraNet",
    "Group",
    "IterativePruning",
    "LoadWeights",
    "ModelZooSparsity",
    "RigL",
    "SparseRunSummary",
    "SparsityAlgorithm",
    "SparsityCallback",
    "Static",
    "VariableSPDF",
    "clip_gradients",
    "configure",
    "drop_mask_entries",
    "imp_sparsity",
    "rewind_lr_scheduler",
    "SparseLoadingMixin",
    "restore_checkpoint_masks",
]
