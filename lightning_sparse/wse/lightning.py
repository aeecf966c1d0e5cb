"""The device's Lightning glue: `WSEAccelerator` and the strategies ``"wse"`` / ``"wse_ddp"``.

`WSEAccelerator`: ``Trainer(accelerator="wse")``, the emulated wafer-scale device.

The device is the CPU underneath (a `CPUAccelerator` subclass: same devices, same data parallel
backend, gloo). What it adds happens in ``setup(trainer)``, which Lightning calls from
``strategy.setup`` after every callback's ``setup`` hook, so a sparsity callback has created its
masks by then (``Trainer._run``: ``call._call_setup_hook`` precedes ``strategy.setup``). It

1. checks the precision (the CSR kernels run float32/float64, so "32-true" and "64-true" only;
   sparsity callbacks ask `check_trainer` before they prune, so a refused run modifies nothing);
2. installs the executor on the LightningModule (`install_executor`: every `nn.Linear` becomes a
   `WSELinear`, every HF ``Conv1D`` its device subclass; masked ones run in CSR, see
   `executor.py`);
3. adds a `WSEStatsMonitor` callback that closes each optimizer step's statistics and logs them.

``teardown`` (end of fit/validate/predict) undoes 2 and 3. Without a sparsity callback no layer
has a mask and training is bit-identical to ``accelerator="cpu"``. Each figure is logged once:
`WSEStatsMonitor` logs ``wse/<key>``, so `get_device_stats` (what Lightning's
``DeviceStatsMonitor`` logs, under a prefix per hook) returns the CPU's figures only, and the
`WSEStats` figures too only with ``log_stats=False``. ``setup`` prints one line saying what runs
on the device.

Strategies. Strategies of the emulated wafer-scale device: one system (``"wse"``) or a cluster
(``"wse_ddp"``).

Both are ordinary Lightning strategies whose accelerator is always a `WSEAccelerator` (which does
the device's work, see `accelerator.py`); they add what a user of the device should not have to
remember:

- ``strategy="wse"`` / ``"wse_ddp"`` alone select the device (``accelerator="cpu"`` is upgraded
  to ``"wse"``, and so is ``"auto"`` on a machine without a GPU; a GPU accelerator is an error,
  ``"auto"`` on a GPU machine included, since Lightning resolves it to CUDA before the strategy
  sees it);
- an unsupported precision fails at ``Trainer(...)`` construction, not at fit time;
- ``"wse_ddp"`` emulates a cluster of ``devices`` systems: data parallel over
  ``torch.distributed`` with the gloo backend, one process per system, each holding the same
  masks (identical by construction, see docs/design.md; DDP leaves them out of its broadcast,
  `core.ddp_ignore`); DDP's per-forward broadcast of other buffers is off by default
  (``broadcast_buffers=False``).

``Trainer(accelerator="wse", devices=N)`` with the default strategy works too (Lightning picks
``SingleDeviceStrategy`` or ``"ddp"``, gloo on the CPU); the named strategies are the explicit form.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_sparse.wse.autotune import PATH_ENV
from lightning_sparse.wse.executor import WSEExecutor, install_executor
from lightning_sparse.wse.materialize import Init, materialize
from lightning_sparse.wse.policy import PATHS
from lightning_sparse.wse.stats import WSEStats

__all__ = [
    "SUPPORTED_PRECISIONS",
    "UnsupportedConfiguration",
    "WSEAccelerator",
    "WSEDDPStrategy",
    "WSEStatsMonitor",
    "WSEStrategy",
    "check_precision",
]

SUPPORTED_PRECISIONS = ("32-true", "64-true")


class UnsupportedConfiguration(ValueError):
    """The device refuses the trainer's configuration (its precision or strategy), before
    anything is modified; the message names the value, the rule and the fix."""


def check_precision(plugin: Precision) -> None:
    """Raise unless ``plugin`` runs float32 or float64 weights without autocast.

    Raises:
        UnsupportedConfiguration: naming the precision, the rule and the fix.
    """
    precision = getattr(plugin, "precision", None)
    if precision not in SUPPORTED_PRECISIONS:
        raise UnsupportedConfiguration(
            f"accelerator='wse' does not support precision={precision!r}: its CSR kernels run "
            f"float32/float64 weights without autocast, so use precision in "
            f"{SUPPORTED_PRECISIONS}, or accelerator='cpu' for mixed or half precision"
        )


class WSEAccelerator(CPUAccelerator):
    """The emulated wafer-scale device: masked `nn.Linear` (and HF ``Conv1D``) layers execute in
    CSR.

    Args:
        kernel_path: `sparse_linear` path for every layer: "auto" (time the paths once per shape
            and keep the fastest), "compiled", "torch" or "dense"; None follows the
            ``LIGHTNING_SPARSE_WSE_PATH`` environment variable (default "auto").
        log_stats: log `WSEStats` figures (``wse/...``) through the trainer's loggers; when
            False, `get_device_stats` returns them instead (for ``DeviceStatsMonitor``).
        compact: in ``fit``, masked layers train their kept values only (`compact.py`: the
            optimizer steps the values, no dense weight, gradient or moments are held between
            steps; mask updates rebuild the values). False keeps the dense training state.
    """

    def __init__(
        self, kernel_path: str | None = None, log_stats: bool = True, compact: bool = True
    ) -> None:
        super().__init__()
        if kernel_path is not None and kernel_path != "auto" and kernel_path not in PATHS:
            raise ValueError(
                f"kernel_path must be None, 'auto' or one of {PATHS}, got {kernel_path!r}"
            )
        self.kernel_path = kernel_path
        self.log_stats = log_stats
        self.compact = compact
        self.stats = WSEStats()
        self.executor: WSEExecutor | None = None
        self._monitor: WSEStatsMonitor | None = None
        self._trainer: weakref.ref[pl.Trainer] | None = None

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """Raise unless ``trainer``'s precision and strategy run on the device.

        Lightning calls `setup` only after every callback's ``setup``, when a sparsity callback
        has already pruned the weights; so sparsity callbacks call this first, in their own
        ``setup`` (`lightning_sparse.lightning.callback.check_accelerator`), and a refused run
        leaves the model and the algorithm exactly as they were.

        Raises:
            UnsupportedConfiguration: naming the precision or strategy, the rule and the fix.
        """
        check_precision(trainer.precision_plugin)
        if not isinstance(trainer.strategy, SingleDeviceStrategy | DDPStrategy):
            raise UnsupportedConfiguration(
                f"accelerator='wse' runs on one system or data parallel over several, not with "
                f"{type(trainer.strategy).__name__}; use strategy='wse', 'wse_ddp', 'ddp' or auto"
            )

    def materialize(self, trainer: pl.Trainer, init: Init) -> None:
        """Make the trainer's module, built on the meta device (``LitCausalLM(build_sparse=
        True)``, which calls this from ``configure_model``, before Lightning loads a checkpoint
        into it), with ``init``: the executor is installed now and each masked layer goes
        compact as it is made, parked until the optimizers exist (`materialize`)."""
        self._install(trainer)
        materialize(trainer.lightning_module, init, list(trainer.optimizers))

    def setup(self, trainer: pl.Trainer) -> None:
        """Check the configuration, install the executor (unless `materialize` did) and the
        statistics callback.

        Raises:
            ValueError: the module still has tensors on the meta device (built sparse without
                a ``configure_model`` that calls `materialize`).
        """
        module = trainer.lightning_module
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            raise ValueError(
                f"{type(module).__name__} still has tensors on the meta device when the device "
                "is set up; make them in its configure_model() with "
                "trainer.accelerator.materialize(trainer, init) (LitCausalLM(build_sparse=True) "
                "does)"
            )
        if self.executor is None or self._installed_on() is not module:
            self._install(trainer)

    def _install(self, trainer: pl.Trainer) -> None:
        self.check_trainer(trainer)
        self._trainer = weakref.ref(trainer)
        self.executor = install_executor(
            trainer.lightning_module,
            stats=self.stats,
            path=self.kernel_path,
            optimizers=self._optimizers if self._compacts(trainer) else None,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
        )
        # Trainer.callbacks is set by Lightning's callback connector, undeclared on the class.
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, WSEStatsMonitor) for c in callbacks):
            self._monitor = WSEStatsMonitor(self.stats, log=self.log_stats)
            # First, so DeviceStatsMonitor's on_train_batch_end already sees the closed step.
            callbacks.insert(0, self._monitor)
        rank_zero_info(self.describe())

    def _installed_on(self) -> Any:
        trainer = self._trainer() if self._trainer is not None else None
        return None if trainer is None else trainer.lightning_module

    def _compacts(self, trainer: pl.Trainer) -> bool:
        """Compact training applies to a fit on one system (a cluster keeps dense state: DDP
        reduces the weights' gradients)."""
        return self.compact and trainer.state.fn == TrainerFn.FITTING and trainer.world_size == 1

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        trainer = self._trainer() if self._trainer is not None else None
        return list(trainer.optimizers) if trainer is not None else []

    def describe(self) -> str:
        """One line: how many layers run masked in CSR, and with which kernels."""
        layers = self.executor.layers if self.executor is not None else []
        masked = sum(1 for m in layers if getattr(m, "weight_mask", None) is not None)
        kernels = self.kernel_path or os.environ.get(PATH_ENV) or "auto"
        how = " (timed per shape, fastest kept)" if kernels == "auto" else ""
        return (
            f"lightning-sparse: WSE device: {masked} masked layers in CSR, "
            f"{len(layers) - masked} unmasked layers dense, kernels {kernels}{how}"
        )

    def teardown(self) -> None:
        """Give the model back its `nn.Linear` layers and remove the statistics callback."""
        if self.executor is not None:
            self.executor.remove()
            self.executor = None
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None and self._monitor is not None:
            # Trainer.callbacks: undeclared on the class (see setup).
            kept = [c for c in trainer.callbacks if c is not self._monitor]  # type: ignore[attr-defined]
            trainer.callbacks = kept  # type: ignore[attr-defined]
        self._monitor, self._trainer = None, None

    def summary_figures(self) -> dict[str, Any]:
        """Run totals for `SparseRunSummary`'s device block (it reads them duck-typed)."""
        stats, figures = self.stats, self.stats.as_dict()
        return {
            "steps": stats.steps,
            "flops_executed": figures["total_flops_executed"],
            "flops_dense": figures["total_flops_dense"],
            "dense_grad_steps": stats.dense_grad_steps,
            "weight_bytes_csr": int(figures["weight_bytes_csr"]),
            "weight_bytes_dense": int(figures["weight_bytes_dense"]),
            "rebuilds": stats.total_rebuilds,
            "rebuild_seconds": stats.total_rebuild_seconds,
        }

    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        """The CPU's figures (`CPUAccelerator`), plus `WSEStats.as_dict` (the last optimizer
        step's FLOPs and rebuilds, weight memory now, running totals) only when the
        `WSEStatsMonitor` does not log them already (``log_stats=False``)."""
        stats = super().get_device_stats(device)
        if not self.log_stats:
            stats.update(self.stats.as_dict())
        return stats

    @staticmethod
    def name() -> str:
        return "wse"

    @classmethod
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(
            cls.name(), cls, description="emulated wafer-scale device (CSR kernels on the CPU)"
        )


class WSEStatsMonitor(pl.Callback):
    """Closes each optimizer step's `WSEStats` window and logs it (added by `WSEAccelerator`).

    Logged at Lightning's logging cadence (``log_every_n_steps``) as ``wse/<key>``: the mean per
    step over the steps since the last log of every ``flops_*``, ``rebuilds`` and
    ``rebuild_seconds`` figure (so a dense-gradient step is never skipped, only averaged in),
    ``wse/dense_grad_steps`` (how many of those steps computed dense weight gradients), and the
    weight memory now. Validation FLOPs are logged separately as ``wse/val/flops_*`` per run.

    Args:
        stats: the accelerator's statistics.
        log: send figures to the loggers (steps are closed either way).
    """

    def __init__(self, stats: WSEStats, log: bool = True) -> None:
        self.stats = stats
        self.log_to_loggers = log
        self._step = -1
        self._window: list[dict[str, float]] = []
        self._dense_grad_steps = 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if trainer.global_step == self._step:
            return  # mid gradient accumulation: the step goes on
        self._step = trainer.global_step
        figures = self.stats.end_step()
        self._window.append(figures)
        self._dense_grad_steps += figures["flops_dense_weight_grad"] > 0
        if not trainer._logger_connector.should_update_logs:
            return
        count = len(self._window)
        metrics = {f"wse/{k}": sum(f[k] for f in self._window) / count for k in figures}
        metrics["wse/flops_ratio"] = (
            metrics["wse/flops_executed"] / metrics["wse/flops_dense"]
            if metrics["wse/flops_dense"]
            else 1.0
        )
        metrics["wse/dense_grad_steps"] = float(self._dense_grad_steps)
        metrics.update({f"wse/{k}": v for k, v in self.stats.memory_dict().items()})
        self._window, self._dense_grad_steps = [], 0
        self._send(trainer, metrics)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stats.evaluating = True

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stats.evaluating = False
        figures = self.stats.end_eval()
        if not trainer.sanity_checking:
            self._send(trainer, {f"wse/val/{k}": v for k, v in figures.items()})

    def _send(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if not self.log_to_loggers:
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _as_wse(accelerator: pl.accelerators.Accelerator | None, kernel_path: str | None) -> Any:
    if accelerator is None or isinstance(accelerator, WSEAccelerator):
        return accelerator
    if type(accelerator) is CPUAccelerator:
        return WSEAccelerator(kernel_path=kernel_path)
    raise ValueError(
        f"the wse strategies run on accelerator='wse' (the CPU underneath), got "
        f"{type(accelerator).__name__}; pass accelerator='wse' or 'cpu' (accelerator='auto' "
        "picks the GPU on a machine that has one)"
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
        broadcast_buffers: DDP's per-forward broadcast of the model's buffers from rank 0 (the
            masks, identical on every system by construction, are left out, `core.ddp_ignore`);
            off by default.
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
