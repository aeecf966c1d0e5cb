"""Training workflows built from library pieces: Variable SPDF (sparse, then dense), iterative
magnitude pruning with LR rewinding, chained runs and FLOP accounting. See docs/workflows.md."""

from lightning_sparse.workflows.flop_counter import FlopCounter, FlopSegment
from lightning_sparse.workflows.imp import IterativePruning, imp_sparsity, rewind_lr_scheduler
from lightning_sparse.workflows.load_weights import LoadWeights, drop_mask_entries
from lightning_sparse.workflows.spdf import VariableSPDF

__all__ = [
    "FlopCounter",
    "FlopSegment",
    "IterativePruning",
    "LoadWeights",
    "VariableSPDF",
    "drop_mask_entries",
    "imp_sparsity",
    "rewind_lr_scheduler",
]
