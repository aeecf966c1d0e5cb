"""lightning_sparse: training-time weight sparsity for PyTorch Lightning, Cerebras-compatible.

Public API; everything not re-exported here is internal.
"""

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
from lightning_sparse.configure import configure
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
    "configure",
]
