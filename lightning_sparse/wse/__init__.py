"""Emulated wafer-scale device: masked layers executed in CSR so skipped FLOPs become speed."""

from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.kernels import (
    PATHS,
    autotune_choices,
    clear_autotune_cache,
    compiled_available,
    resolve_path,
    sparse_linear,
)

__all__ = [
    "PATHS",
    "CSRWeight",
    "autotune_choices",
    "clear_autotune_cache",
    "compiled_available",
    "resolve_path",
    "sparse_linear",
]
