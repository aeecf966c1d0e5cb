"""Sparsity algorithms: the base class, Static, the dynamic family and Group."""

from lightning_sparse.algorithms.base import SparsityAlgorithm
from lightning_sparse.algorithms.dynamic import DynamicSparsityAlgorithm
from lightning_sparse.algorithms.gmp import GMP
from lightning_sparse.algorithms.granet import GraNet
from lightning_sparse.algorithms.group import Group
from lightning_sparse.algorithms.rigl import RigL
from lightning_sparse.algorithms.set import SET
from lightning_sparse.algorithms.static import Static

__all__ = [
    "GMP",
    "SET",
    "DynamicSparsityAlgorithm",
    "GraNet",
    "Group",
    "RigL",
    "SparsityAlgorithm",
    "Static",
]
