"""What the command changes in a parsed configuration before it builds a run (`edit_for_run`),
so that every Lightning flag a user passes works; each change is said in one line.

- No logger (``--trainer.logger false``): the callbacks that refuse to run without one
  (`DeviceStatsMonitor`, `LearningRateMonitor`, which the recipes use) are left out.
- ``fast_dev_run``: Lightning turns logging and checkpointing off; the recipes'
  `ModelCheckpoint` is left out too, since Lightning 2.6 still writes its ``last.ckpt`` at the
  end of such a run. (No run directory either: `lightning_sparse.app.run_dirs`.)
- ``validate`` / ``test`` / ``predict``: a W&B logger becomes a CSV logger in the evaluation
  folder, so an evaluation starts no W&B run unless ``--trainer.logger`` on the command line
  asks for one.

The configuration saved with the run (``config.yaml``) is the one given, before these edits.
"""

from __future__ import annotations

from jsonargparse import Namespace
from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_sparse.app.common import PROG, as_list, class_of

__all__ = ["NEED_A_LOGGER", "edit_for_run", "logger_off"]

# Callbacks whose setup raises under ``Trainer(logger=False)``.
NEED_A_LOGGER: tuple[type, ...] = (DeviceStatsMonitor, LearningRateMonitor)


def logger_off(config: Namespace) -> bool:
    """Whether the run has no logger (``trainer.logger`` false or an empty list; ``None`` is
    Lightning's default logger)."""
    value = config.get("trainer.logger")
    return value is False or value == []


def edit_for_run(config: Namespace, subcommand: str | None, logger_asked: bool) -> list[str]:
    """Edit ``config`` (one subcommand's) as the module docstring lists; return the lines that
    say what changed. ``logger_asked``: ``--trainer.logger`` was on the command line."""
    said = []
    if logger_off(config):
        dropped = _drop_callbacks(config, NEED_A_LOGGER)
        if dropped:
            they = "it needs" if len(dropped) == 1 else "they need"
            said.append(
                f"{PROG}: no logger (--trainer.logger false): left out {', '.join(dropped)} "
                f"({they} a logger)"
            )
    if config.get("trainer.fast_dev_run"):
        _drop_callbacks(config, (ModelCheckpoint,))
        summary = " (the summary is printed, not saved)" if subcommand in (None, "fit") else ""
        said.append(
            f"{PROG}: fast_dev_run: a few batches to check the run, with no checkpoint, no logs "
            f"and no files written{summary}"
        )
    elif subcommand not in (None, "fit"):
        if not logger_asked and _wandb_to_csv(config):
            said.append(
                f"{PROG}: {subcommand} logs to CSV in its folder and starts no W&B run "
                "(--trainer.logger WandbLogger for one)"
            )
    return said


def _drop_callbacks(config: Namespace, classes: tuple[type, ...]) -> list[str]:
    """Remove the ``trainer.callbacks`` entries of ``classes``; their class names."""
    kept, dropped = [], []
    for entry in as_list(config.get("trainer.callbacks")):
        cls = class_of(entry)
        if cls is not None and issubclass(cls, classes):
            dropped.append(cls.__name__)
        else:
            kept.append(entry)
    if dropped:
        config.trainer.callbacks = kept
    return dropped


def _wandb_to_csv(config: Namespace) -> bool:
    """Replace every `WandbLogger` entry by a `CSVLogger` in the same ``save_dir``."""
    loggers = as_list(config.get("trainer.logger"))
    swapped = False
    for i, entry in enumerate(loggers):
        cls = class_of(entry)
        if cls is not None and issubclass(cls, WandbLogger):
            save_dir = (entry.get("init_args") or Namespace()).get("save_dir") or "."
            loggers[i] = Namespace(
                class_path=f"{CSVLogger.__module__}.{CSVLogger.__name__}",
                init_args=Namespace(save_dir=save_dir, name=""),
            )
            swapped = True
    if swapped:
        config.trainer.logger = loggers if isinstance(config.trainer.logger, list) else loggers[0]
    return swapped
