"""One directory per `lightning-sparse` run: ``<logger save_dir>/version_N`` (`plan_run_dir`).

The run's logger files, ``summary.json``, ``config.yaml`` and checkpoints go there;
``--ckpt_path last`` continues the newest run that has a ``last*.ckpt``. A new run reserves its
directory by creating it (``os.mkdir`` is atomic: of two runs started together in one directory,
one gets ``version_N`` and the other moves on to ``version_N+1``). DDP workers Lightning starts
parse the same command line; they take the launching process's decision from `RUN_ENV`.

- Without a logger (``--trainer.logger false``) the root is the directory above the first
  `ModelCheckpoint`'s ``dirpath`` (the recipes': ``outputs/<recipe>``), and the run directory
  becomes the trainer's ``default_root_dir`` (where ``summary.json`` goes).
- ``validate`` / ``test`` / ``predict`` write into an evaluation folder inside the run they
  evaluate: ``<run>/<subcommand>_K`` for a checkpoint in ``<run>/checkpoints/`` (or any
  ``version_N`` above it), ``<root>/<subcommand>_K`` otherwise.
- ``fast_dev_run`` gets no directory (it writes no files).
- A run that fails leaves no directory that holds only what the command wrote at its start
  (`RunDir.release`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from lightning_sparse.app.common import RUN_ENV, as_list, class_of
from lightning_sparse.app.errors import EXIT_FAILED, CLIError, describe_os_error
from lightning_sparse.lightning.checkpointing import remove_stale_temporaries

__all__ = ["RUN_ENV", "RunDir", "plan_run_dir", "reserve"]


# What the command writes into a run directory before the run's first step.
_START_FILES = frozenset({"config.yaml", "hparams.yaml"})


@dataclass(frozen=True)
class RunDir:
    """Where one run writes: ``root/<prefix>_N`` (``version_N``; ``validate_N`` ... for an
    evaluation); ``resume`` is the checkpoint it continues or evaluates."""

    root: Path
    version: int
    resume: Path | None = None
    asked_to_resume: bool = False
    continues: bool = True  # fit continues in the resumed run's directory
    reserved: bool = False  # this process created ``path`` (`reserve`)
    prefix: str = "version"
    origin: Path | None = None  # the root it was planned from (DDP workers match it); default root

    @property
    def path(self) -> Path:
        return self.root / f"{self.prefix}_{self.version}"

    def release(self) -> None:
        """Remove the directory `reserve` created if it holds nothing but what the command
        writes at a run's start (``config.yaml``, ``hparams.yaml``, empty folders): a run that
        failed before it produced anything leaves no ``version_N`` behind."""
        if not self.reserved or not self.path.is_dir():
            return
        files = [p for p in self.path.rglob("*") if not p.is_dir()]
        if all(p.name in _START_FILES for p in files):
            shutil.rmtree(self.path, ignore_errors=True)

    def remove_stale_temporaries(self) -> list[Path]:
        """Delete the partial checkpoint files that writers killed mid-write left in any run
        under ``root`` (`lightning_sparse.lightning.checkpointing.remove_stale_temporaries`:
        only its own, unheld temporaries); return their paths."""
        versions = sorted(p for p in self.root.glob("version_*") if p.is_dir())
        return [path for d in versions for path in remove_stale_temporaries(d, recursive=True)]

    def to_env(self) -> str:
        resume = str(self.resume) if self.resume else None
        return json.dumps(
            {
                "origin": str(self.origin or self.root),
                "root": str(self.root),
                "version": self.version,
                "resume": resume,
                "prefix": self.prefix,
            }
        )

    def describe(self) -> str:
        if self.prefix != "version":
            what = f"the checkpoint {self.resume}" if self.resume else "the model as configured"
            return f"lightning-sparse: {self.prefix} of {what}; writing to {self.path}"
        if self.resume is not None and self.continues:
            return f"lightning-sparse: resuming the latest run, {self.path}, from {self.resume}"
        if self.resume is not None:
            return (
                f"lightning-sparse: loading the latest run's {self.resume}; writing to {self.path}"
            )
        if self.asked_to_resume:
            return (
                f"lightning-sparse: --ckpt_path last: no run under {self.root} has a last*.ckpt; "
                f"starting a new run in {self.path}"
            )
        return f"lightning-sparse: this run writes to {self.path}"


def plan_run_dir(
    config: Namespace, subcommand: str | None = "fit", worker: str | None = None
) -> RunDir | None:
    """Give the run its own directory and point the loggers and checkpoints there (``config``
    is edited); resolve ``ckpt_path: last``.

    The root is ``save_dir/name`` of a `CSVLogger` / `TensorBoardLogger` (which then get
    ``version=N``; a ``name`` equal to the last part of ``save_dir``, as a recipe's W&B run name
    becomes when only the logger class is switched, is dropped rather than repeated), or
    ``save_dir`` of a `WandbLogger` (whose ``save_dir`` becomes the run directory), or without a
    logger the directory above the first `ModelCheckpoint`'s ``dirpath``. `ModelCheckpoint`
    dirpaths under that directory (the recipes' ``outputs/<recipe>/checkpoints``), or unset, move
    into the run directory, and so do other relative ones (as ``<run>/<their last folder>``:
    a sweep point that moves the logger takes the recipe's checkpoints along); an absolute
    dirpath elsewhere stays. ``fit`` gets ``root/version_N``, ``N`` one more than the highest
    existing, reserved by creating the directory (`reserve`); with ``--ckpt_path last`` it
    continues the highest version that has a ``last*.ckpt``. ``validate`` / ``test`` /
    ``predict`` get an evaluation folder (`evaluation_dir`). ``None`` (nothing changed) under
    ``fast_dev_run``, without a logger or checkpoint directory, or when the logger's ``version``
    is set (the run directory is then the user's choice). ``worker``: a DDP worker's `RUN_ENV`
    value, the launching process's decision.

    Raises:
        CLIError: the run directory cannot be created (no permission, a file in the way, ...).
    """
    if config.get("trainer.fast_dev_run"):
        return None  # Lightning logs and checkpoints nothing then; the command writes nothing
    found = _root(config)
    if found is None:
        return None
    root, base, loggers = found
    asked = config.get("ckpt_path") == "last"
    decided = json.loads(worker) if worker else None
    if decided and decided.get("origin") == str(root):
        resume = Path(decided["resume"]) if decided["resume"] else None
        run = RunDir(Path(decided["root"]), decided["version"], resume, asked)
        run = dataclasses.replace(run, prefix=decided["prefix"])
    elif subcommand in (None, "fit"):
        run = _new_or_latest(root, asked)
        if run.resume is None:
            run = reserve(run)
    else:
        run = evaluation_dir(root, subcommand, config.get("ckpt_path"))
    run = dataclasses.replace(run, origin=root)
    if asked and run.resume is not None:
        config.ckpt_path = str(run.resume)
    _point_loggers(loggers, run)
    _point_checkpoints(config, run, base)
    if not loggers:  # Lightning's default_root_dir holds what a logger's directory would
        config.trainer.default_root_dir = str(run.path)
    return run


def _root(config: Namespace) -> tuple[Path, Path, list[tuple[Namespace, type]]] | None:
    """(root of the run directories, the directory the recipe's checkpoints are under, the
    loggers that get the run directory), or None when the command chooses no directory."""
    loggers = [
        (entry, cls)
        for entry in as_list(config.get("trainer.logger"))
        if (cls := class_of(entry)) is not None
        and issubclass(cls, CSVLogger | TensorBoardLogger | WandbLogger)
    ]
    if not loggers:
        if as_list(config.get("trainer.logger")):  # another logger class: its own directory
            return None
        dirpath = next((c.init_args.get("dirpath") for c in _checkpoints(config)), None)
        return (Path(dirpath).parent, Path(dirpath).parent, []) if dirpath else None
    entry, cls = loggers[0]
    args = entry.get("init_args") or Namespace()
    save_dir = args.get("save_dir")
    if save_dir is None or (not issubclass(cls, WandbLogger) and args.get("version") is not None):
        return None
    root = Path(save_dir)
    if not issubclass(cls, WandbLogger):
        if args.get("name") == root.name:  # outputs/rigl_llama/rigl_llama: the name twice
            args.name = ""
        root = root / (args.get("name") or "")
    return root, Path(save_dir), loggers


def evaluation_dir(root: Path, subcommand: str, ckpt_path: str | None) -> RunDir:
    """The folder ``validate`` / ``test`` / ``predict`` write to, reserved: ``<run>/<subcommand>_K``
    inside the run whose checkpoint it evaluates (``ckpt_path: last``: the newest run with a
    ``last*.ckpt`` under ``root``), or ``<root>/<subcommand>_K`` for a checkpoint outside a run
    directory and for no checkpoint."""
    if ckpt_path == "last":
        resume = _new_or_latest(root, True).resume
        if resume is None:
            raise CLIError(
                f"--ckpt_path last: no run under {root} has a last*.ckpt, so there is nothing to "
                f"{subcommand}; train one first (lightning-sparse fit with the same --config), "
                "or pass --ckpt_path path/to/file.ckpt"
            )
    else:
        resume = Path(ckpt_path) if ckpt_path and Path(ckpt_path).is_file() else None
    home = (_run_of(resume) if resume is not None else None) or root
    run = RunDir(home, _next_version(home, subcommand), resume, ckpt_path == "last", False)
    return reserve(dataclasses.replace(run, prefix=subcommand))


def run_config_of(ckpt_path: str | None) -> Path | None:
    """The ``config.yaml`` the run that wrote checkpoint ``ckpt_path`` saved at its start (the
    whole configuration it trained with), or None: no such file, or a checkpoint outside a run
    directory (``last`` is resolved later, under the configuration's own directory)."""
    if not ckpt_path or ckpt_path == "last" or not Path(ckpt_path).is_file():
        return None
    run = _run_of(Path(ckpt_path))
    saved = run / "config.yaml" if run is not None else None
    return saved if saved is not None and saved.is_file() else None


def _run_of(ckpt: Path) -> Path | None:
    """The run directory holding checkpoint ``ckpt``: the nearest ``version_N`` above it, or the
    folder above its ``checkpoints/``."""
    found = next((p for p in ckpt.parents if re.fullmatch(r"version_\d+", p.name)), None)
    if found is None and ckpt.parent.name == "checkpoints":
        found = ckpt.parent.parent
    return found


def _point_loggers(loggers: list[tuple[Namespace, type]], run: RunDir) -> None:
    for entry, cls in loggers:
        args = entry.get("init_args")
        if args is None:
            entry.init_args = args = Namespace()
        if issubclass(cls, WandbLogger):
            if args.get("save_dir") is not None:  # absolute: W&B prints `wandb sync <it>`
                args.save_dir = str(run.path.resolve())
        elif run.prefix != "version":  # an evaluation folder: <run>/<subcommand>_K itself
            args.save_dir, args.name, args.version = str(run.root), "", run.path.name
        elif args.get("version") is None:
            args.version = run.version


def _checkpoints(config: Namespace) -> list[Namespace]:
    """The `ModelCheckpoint` entries of ``trainer.callbacks``, each with ``init_args``."""
    found = []
    for callback in as_list(config.get("trainer.callbacks")):
        cls = class_of(callback)
        if cls is not None and issubclass(cls, ModelCheckpoint):
            if callback.get("init_args") is None:
                callback.init_args = Namespace()
            found.append(callback)
    return found


def _point_checkpoints(config: Namespace, run: RunDir, base: Path) -> None:
    """`ModelCheckpoint` dirpaths unset or under ``base`` (but not in a run of it) move into
    the run directory; an evaluation's point at the directory of the checkpoint it loads (they
    save nothing outside fit, and Lightning warns when a loaded checkpoint's dirpath differs)."""
    for callback in _checkpoints(config):
        if run.prefix != "version":
            where = run.resume.parent if run.resume is not None else run.path / "checkpoints"
            callback.init_args.dirpath = str(where)
            continue
        dirpath = callback.init_args.get("dirpath")
        if dirpath is None:
            callback.init_args.dirpath = str(run.path / "checkpoints")
            continue
        try:
            inside = Path(dirpath).resolve().relative_to(base.resolve())
        except ValueError:
            if Path(dirpath).is_absolute():
                continue  # elsewhere, named in full: the user's choice
            # Relative and elsewhere: a recipe's outputs/<recipe>/checkpoints with the logger
            # moved (a sweep point's, a compare run's): its folder in this run, not one shared.
            inside = Path(Path(dirpath).name)
        if not inside.parts or not inside.parts[0].startswith("version_"):
            callback.init_args.dirpath = str(run.path / inside)


def _next_version(root: Path, prefix: str = "version") -> int:
    """One more than the highest ``<prefix>_N`` under ``root`` (0 when there is none)."""
    names = (re.fullmatch(rf"{prefix}_(\d+)", p.name) for p in root.glob(f"{prefix}_*"))
    return max((int(m[1]) + 1 for m in names if m), default=0)


def _new_or_latest(root: Path, resume_last: bool) -> RunDir:
    """The next ``version_N`` under ``root``, or (``resume_last``) the highest with a checkpoint."""
    names = (re.fullmatch(r"version_(\d+)", p.name) for p in root.glob("version_*"))
    versions = sorted((int(m[1]) for m in names if m), reverse=True)
    if resume_last:
        for version in versions:
            found = sorted(
                (root / f"version_{version}").rglob("last*.ckpt"), key=lambda p: p.stat().st_mtime
            )
            if found:
                return RunDir(root, version, found[-1], True)
    return RunDir(root, _next_version(root), None, resume_last)


def reserve(run: RunDir) -> RunDir:
    """Create ``run.path``, or the first free ``<prefix>_M`` above it, and return that run.

    ``os.mkdir`` either creates the directory or fails because it exists, atomically, so runs
    started together in one directory each get their own version.

    Raises:
        CLIError: the directory cannot be created, naming it, the cause and the fix.
    """
    version = run.version
    while True:
        path = run.root / f"{run.prefix}_{version}"
        try:
            run.root.mkdir(parents=True, exist_ok=True)
            os.mkdir(path)
        except FileExistsError as err:
            if not run.root.is_dir():
                raise _cannot_create(err, path) from err
            version += 1  # taken (by a run started at the same moment): the next one
            continue
        except OSError as err:
            raise _cannot_create(err, path) from err
        return dataclasses.replace(run, version=version, reserved=True)


def _cannot_create(err: OSError, path: Path) -> CLIError:
    return CLIError(describe_os_error(err, "cannot create the run directory", path), EXIT_FAILED)
