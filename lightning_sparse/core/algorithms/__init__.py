"""Sparsity algorithms: one base, the algorithms over it (SET, RigL and GraNet through their shared
`DropAndGrow`), and the `Group` composite."""

from ..applied import algorithms_of
from ..validate import sparsity as validate_sparsity
from .base import DynamicSparsityAlgorithm, SparsityAlgorithm
from .drop_grow import DropAndGrow
from .gmp import GMP
from .granet import GraNet
from .group import Group
from .registry import ALGORITHMS, algorithm_class, available_algorithms, register_algorithm
from .rigl import RigL
from .set import SET
from .static import Static

__all__ = [
    "ALGORITHMS",
    "GMP",
    "SET",
    "DropAndGrow",
    "DynamicSparsityAlgorithm",
    "GraNet",
    "Group",
    "RigL",
    "SparsityAlgorithm",
    "Static",
    "algorithm_class",
    "algorithms_of",
    "available_algorithms",
    "register_algorithm",
    "validate_sparsity",
]
