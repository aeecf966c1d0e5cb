"""The framework-free sparsity core: masks, schedules, structure, algorithms, configs.

Plain PyTorch only; it never imports Lightning, the device or the app, so
``from lightning_sparse.core import RigL`` costs no Lightning import. The classes here work in
any training loop (``model.apply(sparsity)``, ``sparsity.apply(optimizer)``); the same names at
the package top level (``lightning_sparse.RigL``) are these classes made Lightning callbacks too.
"""

from .algorithms import (
    GMP,
    SET,
    DropAndGrow,
    DynamicSparsityAlgorithm,
    GraNet,
    Group,
    RigL,
    SparsityAlgorithm,
    Static,
    algorithm_class,
    algorithms_of,
    available_algorithms,
    register_algorithm,
)
from .configure import configure, load_sparsity_block
from .conversion import convert_nan_checkpoint, densify
from .filters import default_sparse_param_filter
from .report import SparsityReport, sparsity_report
from .sparse_parameter import SparseParameter
from .sparsity_wrapper import SparsityWrapperOptimizer, configure_sparsity_wrapper
from .state_dict import checkpoint_masks, restore_masks, strip_masks

__all__ = [
    "GMP",
    "SET",
    "DropAndGrow",
    "DynamicSparsityAlgorithm",
    "GraNet",
    "Group",
    "RigL",
    "SparseParameter",
    "SparsityAlgorithm",
    "SparsityReport",
    "SparsityWrapperOptimizer",
    "Static",
    "algorithm_class",
    "algorithms_of",
    "available_algorithms",
    "checkpoint_masks",
    "configure",
    "configure_sparsity_wrapper",
    "convert_nan_checkpoint",
    "default_sparse_param_filter",
    "densify",
    "load_sparsity_block",
    "register_algorithm",
    "restore_masks",
    "sparsity_report",
    "strip_masks",
]
