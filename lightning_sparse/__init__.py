"""lightning_sparse: training-time weight sparsity for PyTorch Lightning, Cerebras-compatible.

Public API; everything not re-exported here is internal.
"""

import lightning_sparse.wse  # noqa: F401  (registers accelerator="wse", strategies "wse", "wse_ddp")
from lightning_sparse.algorithms import (
    GMP,
    SET,
    DynamicSparsityAlgorithm,
    GraNet,
    Group,
    RigL,
    SparsityAlgorithm,
    Static,
)
from lightning_sparse.algorithms.base import algorithms_of
from lightning_sparse.configure import configure
from lightning_sparse.conversion import convert_nan_checkpoint, densify
from lightning_sparse.filters import default_sparse_param_filter
from lightning_sparse.legacy import SparsityWrapperOptimizer, configure_sparsity_wrapper
from lightning_sparse.report import SparsityReport, sparsity_report
from lightning_sparse.sparse_parameter import SparseParameter

__version__ = "0.1.0"

__all__ = [
    "GMP",
    "SET",
    "DynamicSparsityAlgorithm",
    "GraNet",
    "Group",
    "RigL",
    "SparseParameter",
    "SparsityAlgorithm",
    "Static",
    "SparsityReport",
    "SparsityWrapperOptimizer",
    "algorithms_of",
    "configure",
    "configure_sparsity_wrapper",
    "convert_nan_checkpoint",
    "default_sparse_param_filter",
    "densify",
    "sparsity_report",
]
