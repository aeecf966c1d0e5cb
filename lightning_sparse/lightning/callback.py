"""`SparsityCallback`: the Lightning side of an algorithm (or `Group`), and nothing else.

Each hook calls the method a plain PyTorch user calls: ``setup`` -> ``apply(model)``,
``on_fit_start`` -> ``apply(optimizer)``, ``on_before_optimizer_step`` -> ``before_step``
(Lightning runs the optimizer's step pre-hooks before its closure, i.e. before the last backward,
so the callback, not the pre-hook, does that work here), ``state_dict`` / ``load_state_dict`` ->
the algorithm's. Logging happens once per ``log_every_n_steps``; at fit start every logger gets
the settings as hyper-parameters (`sparsity_hparams`: the W&B run config, CSV ``hparams.yaml``,
TensorBoard hparams), so runs can be grouped and filtered by sparsity.

Checkpoints: the algorithm's state, masks included (packed bits), is saved under
``checkpoint["sparsity"][state_key]`` (`save_sparsity_state`), not ``checkpoint["callbacks"]``,
and ``checkpoint["state_dict"]`` holds only the weights (pruned ones 0). So the user's plain
LightningModule loads the checkpoint with ``load_from_checkpoint`` or
``trainer.validate/test/predict(ckpt_path=...)`` without the callback, and Lightning does not
warn about a missing callback. Lightning restores the model, then the callbacks (fit, validate,
test and predict alike): with the callback present its ``on_load_checkpoint`` restores the
masks bit-exactly. Checkpoints of earlier versions (state under ``checkpoint["callbacks"]``,
masks in the state dict) load as before.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load

from lightning_sparse.core import legacy
from lightning_sparse.core.algorithms import Group, SparsityAlgorithm
from lightning_sparse.core.init_methods import INIT_METHODS
from lightning_sparse.core.schedules import Constant

__all__ = [
    "SparsityCallback",
    "check_accelerator",
    "check_resumable",
    "SparsityStateCallback",
    "find_sparsity_state",
    "save_sparsity_state",
    "sparsity_hparams",
    "update_metrics",
]

HParam = str | int | float | bool | None
STATE_KEY = "sparsity"  # checkpoint["sparsity"][callback.state_key]: the sparsity states


class SparsityStateCallback(pl.Callback):
    """A callback whose state lives under ``checkpoint["sparsity"][state_key]`` (not
    ``checkpoint["callbacks"]``): every sparsity callback and the workflows built on them."""

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Keep the state Lightning took from ``state_dict()`` under ``checkpoint["sparsity"]``."""
        save_sparsity_state(checkpoint, self.state_key)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Restore this callback's state (after Lightning loaded the model's weights), or raise
        if the checkpoint holds another sparsity callback's state only (`find_sparsity_state`)."""
        state = find_sparsity_state(checkpoint, self.state_key, trainer.ckpt_path)
        if state is not None:
            self.load_state_dict(state)


class SparsityCallback(SparsityStateCallback):
    """Mixed into an algorithm or `Group` class (after it) to make it a Lightning callback."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__doc__ is None:  # a core class made a callback: its docstring, paper and arguments
            cls.__doc__ = next((base.__doc__ for base in cls.__mro__[1:] if base.__doc__), None)

    if TYPE_CHECKING:  # The algorithm's (or Group's) API that the hooks below call.
        name: str
        root: torch.nn.Module | None
        step_driver: str | None
        check_finite: bool
        unlogged_update: bool
        last_update: dict[str, dict[str, torch.Tensor]]
        state_key: str

        @property
        def optimizers(self) -> list[torch.optim.Optimizer]: ...
        @property
        def sparse_params(self) -> Mapping[str, Any]: ...
        def check_range(self, horizon: int) -> None: ...
        def apply(self, obj: torch.nn.Module | torch.optim.Optimizer) -> None: ...
        def detach_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...
        def before_step(self, optimizer: torch.optim.Optimizer) -> None: ...
        def overall_sparsity(self) -> tuple[float, torch.Tensor]: ...
        def itop_rate(self) -> torch.Tensor: ...

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Sparsify the LightningModule (once) and check the schedules up to ``max_steps``; first
        let the accelerator refuse the run (`check_accelerator`), so a refusal prunes nothing.

        Under ``ModelParallelStrategy`` (FSDP2) ``configure_model`` shards the parameters after
        this hook, so sparsity is applied at fit start instead, to the sharded parameters.
        """
        check_accelerator(trainer)
        if trainer.max_steps and trainer.max_steps > 0:
            self.check_range(trainer.max_steps)
        if trainer.ckpt_path and self.root is None:  # set before fit (trainer.ckpt_path = ...)
            check_resumable(trainer, trainer.ckpt_path)
        if not _shards_in_configure_model(trainer):
            self._apply_once(pl_module)

    def _apply_once(self, pl_module: pl.LightningModule) -> None:
        if self.root is None:
            self.apply(pl_module)
        elif self.root is not pl_module:
            raise RuntimeError(f"{self.name} was applied to another model; use one per Trainer")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Make the optimizers of ``configure_optimizers`` sparse; the callback drives updates."""
        self._apply_once(pl_module)
        self.step_driver = "lightning.Trainer"  # before_step from on_before_optimizer_step
        self.check_finite = getattr(trainer.precision_plugin, "scaler", None) is not None
        for stale in [o for o in self.optimizers if all(o is not t for t in trainer.optimizers)]:
            self.detach_optimizer(stale)  # a previous fit's optimizer
        for optimizer in trainer.optimizers:
            if all(o is not optimizer for o in self.optimizers):
                self.apply(optimizer)
        self._log_hparams(trainer)

    def _log_hparams(self, trainer: pl.Trainer) -> None:
        """`sparsity_hparams` to every logger (W&B run config, CSV/TensorBoard hparams), under
        ``sparsity/`` or, with several sparsity callbacks, ``sparsity/<position>/``: positions,
        not ``name`` (a process-wide counter), so a recipe gives the same keys in every run."""
        # A workflow (IterativePruning, VariableSPDF) drives its algorithm from its own hooks.
        # Trainer.callbacks and .log_every_n_steps are set by Lightning's connectors, undeclared
        # on the class: mypy finds no such attributes.
        drivers = [getattr(c, "algorithm", c) for c in trainer.callbacks]  # type: ignore[attr-defined]
        callbacks = [c for c in drivers if isinstance(c, SparsityCallback)]
        index = next((i for i, c in enumerate(callbacks) if c is self), None)
        several = len(callbacks) > 1 and index is not None
        prefix = f"sparsity/{index}" if several else "sparsity"
        # self is the algorithm (or Group) this class is mixed into.
        hparams = sparsity_hparams(self, prefix)  # type: ignore[arg-type]
        for logger in trainer.loggers:
            logger.log_hyperparams(hparams)  # loggers act on rank zero only

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Gradients are accumulated (and all-reduced) here: update masks, prune, then step."""
        self.before_step(optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Log target and actual sparsity, and each mask update's figures once, at the first
        logging step after it (keep ``log_every_n_steps`` <= the update interval).

        A value given to ``log_dict`` costs a host sync (Lightning's ``.item()``) and a float
        one a host-to-device copy, so the per-parameter figures are read to the host in one
        transfer and go to the loggers directly; ``log_dict`` gets a fixed handful."""
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # (see _log_hparams)
        if not self.sparse_params or trainer.global_step % max(every, 1):
            return
        target, actual = self.overall_sparsity()
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # (see _log_hparams)
        several = sum(isinstance(c, SparsityCallback) for c in callbacks) > 1
        prefix = f"sparsity/{self.name}" if several else "sparsity"
        metrics: dict[str, float | torch.Tensor] = {
            f"{prefix}/target": target,
            f"{prefix}/actual": actual.float(),
        }
        if self.unlogged_update:
            figures = update_metrics(self.last_update, self.itop_rate())
            layers = {k: v for k, v in figures.items() if k.startswith("layer/")}
            metrics.update({f"{prefix}/{k}": v for k, v in figures.items() if k not in layers})
            _log_to_loggers(trainer, layers, prefix)
            self.unlogged_update = False
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)


def save_sparsity_state(checkpoint: dict[str, Any], key: str) -> None:
    """Move ``checkpoint["callbacks"][key]`` to ``checkpoint["sparsity"][key]``: a Trainer
    without that callback then loads the checkpoint without Lightning's missing-callback
    warning, and `lightning_sparse.core.state_dict.checkpoint_masks` finds the masks there."""
    state = (checkpoint.get("callbacks") or {}).pop(key, None)
    if state is not None:
        checkpoint.setdefault(STATE_KEY, {})[key] = state


def check_resumable(trainer: pl.Trainer, path: str | os.PathLike[str]) -> None:
    """Raise unless every sparsity callback of ``trainer`` can resume checkpoint ``path``:
    another callback's state (a SET run resumed with RigL) or other settings are refused here,
    before anything changes.

    ``trainer.fit(model, ckpt_path=path)`` refuses the same checkpoints, but Lightning loads the
    weights into the model before any callback sees the checkpoint, so by then the model holds the
    checkpoint's weights; call this first to keep it as it was (``lightning-sparse fit`` does).
    The file is read with ``weights_only=True``; one that cannot be read so is left to
    Lightning's own loading, which reports it.
    """
    try:
        checkpoint = pl_load(os.fspath(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, OSError, RuntimeError, EOFError):
        return
    if not isinstance(checkpoint, Mapping):
        return
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # (see _log_hparams)
        if not isinstance(callback, SparsityCallback) or callback.root is not None:
            continue
        state = find_sparsity_state(checkpoint, callback.state_key, path)
        if state is None:  # an earlier version's layout: under checkpoint["callbacks"]
            state = legacy.callbacks_layout_state(checkpoint, callback.state_key)
        if state is not None:
            # The algorithm's or Group's (their signatures differ, so the mixin declares none).
            callback.check_state_dict(state)  # type: ignore[attr-defined]


def find_sparsity_state(
    checkpoint: Mapping[str, Any], key: str, path: object = None
) -> dict[str, Any] | None:
    """The state `save_sparsity_state` saved for callback ``key``; None when there is none, or
    when an earlier version saved it under ``checkpoint["callbacks"]`` (Lightning passes that
    one to ``load_state_dict`` itself).

    Raises:
        ValueError: the checkpoint (file ``path``) holds another sparsity callback's state and
            not this one's (resuming a SET run with RigL would start RigL from step 0 against
            the run's step): it names both and the fix; nothing was restored.
    """
    saved = checkpoint.get(STATE_KEY) or {}
    if key in saved:
        return saved[key]
    callbacks = legacy.earlier_callback_states(checkpoint)
    if key in callbacks:
        return None
    others = sorted({*saved, *(k for k, v in callbacks.items() if _is_sparsity_state(v))})
    if others:
        where = f"checkpoint {str(path)!r}" if path else "the checkpoint"
        raise ValueError(
            f"{where} holds the sparsity state of {', '.join(map(str, others))} but none of "
            f"{key}, the sparsity callback of this Trainer; resume with the callback that wrote "
            f"it ({others[0]}, with its settings), or start a new run from its weights with "
            "LoadWeights(path) instead of ckpt_path"
        )
    return None


def _is_sparsity_state(state: Any) -> bool:
    """Whether a callback state is an algorithm's, a `Group`'s or a workflow's holding one
    (every version of the layout)."""
    if not isinstance(state, Mapping):
        return False
    if isinstance(state.get("groups"), list):
        return True
    if "step" in state and any(k in state for k in ("algorithm", "params", "last_update_step")):
        return True
    return _is_sparsity_state(state.get("algorithm"))


def sparsity_hparams(
    sparsity: SparsityAlgorithm | Group, prefix: str = "sparsity"
) -> dict[str, HParam]:
    """The settings of an algorithm (or every member of a `Group`) as flat, JSON-able values.

    Keys are ``<prefix>/<setting>`` (``<prefix>/<member index>/<setting>`` in a Group):
    ``algorithm`` (registry name), ``sparsity`` (a float, or the schedule's repr), ``update``,
    ``drop_fraction`` (drop-and-grow only), ``init_method``, ``distribution``, ``shaper``,
    ``param_filter``, ``params`` (tensors sparsified; 0 before ``apply``) and ``seed``.
    """
    if isinstance(sparsity, Group):
        out: dict[str, HParam] = {
            f"{prefix}/algorithm": "group",
            f"{prefix}/members": len(sparsity),
        }
        for index, (param_filter, member) in enumerate(sparsity.members):
            out.update(sparsity_hparams(member, f"{prefix}/{index}"))
            out[f"{prefix}/{index}/param_filter"] = _callable_name(param_filter)
        return out
    settings: dict[str, HParam] = {
        "algorithm": type(sparsity).__name__.lower(),
        "sparsity": _schedule_value(sparsity.sparsity),
        "update": repr(sparsity.update_schedule),
        "init_method": _init_method_name(sparsity.init_method),
        "distribution": sparsity.layers.name,
        "shaper": repr(sparsity.shaper),
        "param_filter": _callable_name(sparsity.param_filter),
        "params": len(sparsity.sparse_params),
        "seed": sparsity.seed,
    }
    drop_fraction = getattr(sparsity, "drop_fraction", None)  # drop-and-grow algorithms
    if drop_fraction is not None:
        settings["drop_fraction"] = _schedule_value(drop_fraction)
    return {f"{prefix}/{key}": value for key, value in settings.items()}


def _schedule_value(schedule: Any) -> float | str:
    """A constant as its number (plots and filters can use it), any other schedule as its repr."""
    return float(schedule.value) if isinstance(schedule, Constant) else repr(schedule)


def _init_method_name(init_method: Any) -> str:
    for name, method in INIT_METHODS.items():
        if method is init_method:
            return name
    return _callable_name(init_method)


def _callable_name(fn: Any) -> str:
    """``"default"`` for ``None``; a glob filter's ``glob_filter([...])``; else the qualname."""
    if fn is None:
        return "default"
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def update_metrics(
    stats: dict[str, dict[str, torch.Tensor]], itop: torch.Tensor | None = None
) -> dict[str, float]:
    """Totals (``dropped``, ``grown``, ``itop`` if given) and per-parameter sparsity
    (``layer/<name>``) of one mask update, read to the host in one transfer (empty if none)."""
    if not stats:
        return {}
    values = [
        torch.stack([s["dropped"] for s in stats.values()]).sum(),
        torch.stack([s["grown"] for s in stats.values()]).sum(),
        *(s["sparsity"] for s in stats.values()),
    ]
    if itop is not None:
        values.append(itop)
    device = values[0].device
    host = torch.stack([v.float().to(device) for v in values]).tolist()
    out = {"dropped": host[0], "grown": host[1]}
    per_layer = host[2 : 2 + len(stats)]
    out.update({f"layer/{name}": v for name, v in zip(stats, per_layer, strict=True)})
    if itop is not None:
        out["itop"] = host[-1]
    return out


def _log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float], prefix: str) -> None:
    """``metrics`` (host floats) to every logger, under ``prefix``, at the step Lightning logs
    this batch's ``log_dict`` at (loggers act on rank zero only)."""
    if not metrics:
        return
    step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
    named = {f"{prefix}/{k}": v for k, v in metrics.items()}
    for logger in trainer.loggers:
        logger.log_metrics(named, step=step)


def check_accelerator(trainer: pl.Trainer) -> None:
    """Let the accelerator refuse the run before anything is modified: one that defines
    ``check_trainer(trainer)`` (the wafer-scale device: its precision and strategy) raises here,
    before a mask exists. Lightning calls ``Accelerator.setup`` only after every callback's
    ``setup``, too late for an all-or-nothing refusal. Duck-typed: the device is a layer above."""
    check = getattr(trainer.accelerator, "check_trainer", None)
    if callable(check):
        check(trainer)


def _shards_in_configure_model(trainer: pl.Trainer) -> bool:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(trainer.strategy, ModelParallelStrategy)
