"""lightning_sparse: training-time weight sparsity for PyTorch Lightning, Cerebras-compatible.

The public API. Names load on first use, so ``import lightning_sparse`` costs nothing:

- ``lightning_sparse.core`` is plain PyTorch (no Lightning import): ``from lightning_sparse.core
  import RigL`` for a hand-written training loop;
- the top-level algorithm names (``lightning_sparse.RigL``, ...) are the same classes made
  Lightning callbacks (they work in plain loops too); using any Lightning name also registers the
  emulated wafer-scale device (``accelerator="wse"``, strategies ``"wse"`` / ``"wse_ddp"``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_CORE = (
    "SparseParameter",
    "SparsityReport",
    "SparsityWrapperOptimizer",
    "algorithms_of",
    "checkpoint_masks",
    "configure_sparsity_wrapper",
    "convert_nan_checkpoint",
    "default_sparse_param_filter",
    "densify",
    "restore_masks",
    "sparsity_report",
    "strip_masks",
)
# The Lightning layer's names the top level lends (the layer exports more), by kind; their
# list is needed here without importing the layer, which would import Lightning.
_LIGHTNING = (
    # the algorithms as callbacks
    "SparsityAlgorithm",
    "DynamicSparsityAlgorithm",
    "SparsityCallback",
    "Static",
    "GMP",
    "DropAndGrow",
    "SET",
    "RigL",
    "GraNet",
    "Group",
    "ModelZooSparsity",
    "configure",
    # workflows and training helpers
    "IterativePruning",
    "VariableSPDF",
    "LoadWeights",
    "clip_gradients",
    # checkpoints, loading and the run's account
    "AtomicCheckpointIO",
    "SparseLoadingMixin",
    "restore_checkpoint_masks",
    "FlopCounter",
    "SparseRunSummary",
)
_INTEGRATIONS = {
    "export": "lightning_sparse.integrations.export",
    "load_compressed": "lightning_sparse.integrations.compressed",
    "load_on_wse": "lightning_sparse.integrations.serve",
}
"""Names whose module needs the optional ``[hf]`` extra; importing them without it says so."""
__all__ = sorted((*_CORE, *_LIGHTNING, *_INTEGRATIONS))


def __getattr__(name: str) -> Any:
    if name in _CORE:
        return getattr(importlib.import_module("lightning_sparse.core"), name)
    if name in _LIGHTNING:
        importlib.import_module("lightning_sparse.wse")  # registers the device with Lightning
        return getattr(importlib.import_module("lightning_sparse.lightning"), name)
    if name in _INTEGRATIONS:
        return getattr(importlib.import_module(_INTEGRATIONS[name]), name)
    raise AttributeError(f"module 'lightning_sparse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted((*globals(), *__all__))
