"""Emulated wafer-scale device: masked layers executed in CSR so skipped FLOPs become speed.

Importing this package (``import lightning_sparse`` does) registers ``accelerator="wse"`` and the
strategies ``"wse"`` and ``"wse_ddp"`` with Lightning, so they work in Python and in LightningCLI
YAML (``trainer.accelerator: wse``). See docs/wse.md.
"""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_sparse.wse.autotune import autotune_choices, clear_autotune_cache, resolve_path
from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.csr_linear import CSRLinear
from lightning_sparse.wse.executor import (
    WSEExecutor,
    WSELinear,
    install_executor,
    on_wse,
    register_masks,
)
from lightning_sparse.wse.kernels import sparse_linear
from lightning_sparse.wse.lightning import (
    WSEAccelerator,
    WSEDDPStrategy,
    WSEStatsMonitor,
    WSEStrategy,
    check_precision,
)
from lightning_sparse.wse.materialize import materialize
from lightning_sparse.wse.native import compiled_available
from lightning_sparse.wse.policy import PATHS
from lightning_sparse.wse.stats import LayerMemory, WSEStats

if WSEAccelerator.name() not in AcceleratorRegistry:
    WSEAccelerator.register_accelerators(AcceleratorRegistry)
for _strategy in (WSEStrategy, WSEDDPStrategy):
    if _strategy.strategy_name not in StrategyRegistry:
        _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "PATHS",
    "CSRWeight",
    "CSRLinear",
    "LayerMemory",
    "WSEAccelerator",
    "WSEDDPStrategy",
    "WSEExecutor",
    "WSELinear",
    "WSEStats",
    "WSEStatsMonitor",
    "WSEStrategy",
    "autotune_choices",
    "check_precision",
    "clear_autotune_cache",
    "compiled_available",
    "install_executor",
    "materialize",
    "on_wse",
    "register_masks",
    "resolve_path",
    "sparse_linear",
]
