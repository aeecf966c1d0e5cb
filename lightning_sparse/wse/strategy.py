"""Strategies of the emulated wafer-scale device: one system (``"wse"``) or a cluster
(``"wse_ddp"``).

Both are ordinary Lightning strategies whose accelerator is always a `WSEAccelerator` (which does
the device's work, see `accelerator.py`); they add what a user of the device should not have to
remember:

- ``strategy="wse"`` / ``"wse_ddp"`` alone select the device (``accelerator="auto"`` or
  ``"cpu"`` is upgraded to ``"wse"``; a GPU accelerator is an error);
- an unsupported precision fails at ``Trainer(...)`` construction, not at fit time;
- ``"wse_ddp"`` emulates a cluster of ``devices`` systems: data parallel over
  ``torch.distributed`` with the gloo backend, one process per system, each holding the same
  masks (identical by construction, see docs/design.md), so DDP's per-forward buffer broadcast is
  off by default (``broadcast_buffers=False``).

``Trainer(accelerator="wse", devices=N)`` with the default strategy works too (Lightning picks
``SingleDeviceStrategy`` or ``"ddp"``, gloo on the CPU); the named strategies are the explicit form.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_sparse.wse.accelerator import WSEAccelerator, check_precision

__all__ = ["WSEDDPStrategy", "WSEStrategy"]


def _as_wse(accelerator: pl.accelerators.Accelerator | None, kernel_path: str | None) -> Any:
    if accelerator is None or isinstance(accelerator, WSEAccelerator):
        return accelerator
    if type(accelerator) is CPUAccelerator:
        return WSEAccelerator(kernel_path=kernel_path)
    raise ValueError(
        f"the wse strategies run on accelerator='wse' (the CPU underneath), got "
        f"{type(accelerator).__name__}; pass accelerator='wse' (or 'auto' or 'cpu')"
    )


class _WSEPlugins:
    """The two plugin slots both WSE strategies guard: the accelerator is always the WSE one,
    and only precisions the device supports are accepted."""

    _kernel_path: str | None
    _precision_plugin: Precision | None

    @property
    def accelerator(self) -> pl.accelerators.Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: pl.accelerators.Accelerator | None) -> None:
        self._accelerator = _as_wse(accelerator, self._kernel_path)

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        if precision_plugin is not None:
            check_precision(precision_plugin)
        self._precision_plugin = precision_plugin


class WSEStrategy(_WSEPlugins, SingleDeviceStrategy):
    """One emulated wafer-scale system (``Trainer(strategy="wse")``).

    Args:
        device: the CPU device the system runs on.
        accelerator, checkpoint_io, precision_plugin: as `SingleDeviceStrategy`.
        kernel_path: `sparse_linear` path of the `WSEAccelerator` this strategy creates when the
            Trainer hands it a plain CPU accelerator (see `WSEAccelerator`).
    """

    strategy_name = "wse"

    def __init__(
        self,
        device: str = "cpu",
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        kernel_path: str | None = None,
    ) -> None:
        self._kernel_path = kernel_path
        super().__init__(device=device, checkpoint_io=checkpoint_io)
        self.accelerator = accelerator
        self.precision_plugin = precision_plugin

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="one emulated wafer-scale system"
        )


class WSEDDPStrategy(_WSEPlugins, DDPStrategy):
    """A cluster of emulated wafer-scale systems (``Trainer(strategy="wse_ddp", devices=N)``).

    Args:
        kernel_path: as `WSEStrategy`.
        broadcast_buffers: DDP's per-forward broadcast of buffers (the masks) from rank 0; off by
            default because the masks are identical on every system by construction.
        process_group_backend: must be "gloo" (or None, meaning gloo).
        **kwargs: as `DDPStrategy` (``accelerator``, ``parallel_devices``, ``start_method``,
            ``find_unused_parameters``, ...).

    Raises:
        ValueError: on a process group backend other than gloo.
    """

    strategy_name = "wse_ddp"

    def __init__(
        self,
        kernel_path: str | None = None,
        broadcast_buffers: bool = False,
        process_group_backend: str | None = "gloo",
        **kwargs: Any,
    ) -> None:
        if process_group_backend not in (None, "gloo"):
            raise ValueError(
                f"strategy='wse_ddp' communicates over gloo (the systems are CPU processes), got "
                f"process_group_backend={process_group_backend!r}; leave it unset"
            )
        self._kernel_path = kernel_path
        accelerator = kwargs.pop("accelerator", None)
        precision_plugin = kwargs.pop("precision_plugin", None)
        super().__init__(
            process_group_backend="gloo", broadcast_buffers=broadcast_buffers, **kwargs
        )
        self.accelerator = accelerator
        self.precision_plugin = precision_plugin

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="a cluster of emulated wafer-scale systems, data parallel over gloo",
        )
