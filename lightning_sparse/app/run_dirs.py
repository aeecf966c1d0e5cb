"""One directory per `lightning-sparse` run: ``<logger save_dir>/version_N`` (`plan_run_dir`).

The run's logger files, ``summary.json``, ``config.yaml`` and checkpoints go there;
``--ckpt_path last`` continues the newest run that has a ``last*.ckpt``. A new run reserves its
directory by creating it (``os.mkdir`` is atomic: of two runs started together in one directory,
one gets ``version_N`` and the other moves on to ``version_N+1``). DDP workers Lightning starts
parse the same command line; they take the launching process's decision from `RUN_ENV`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from lightning_sparse.app.common import RUN_ENV, as_list, class_of
from lightning_sparse.app.errors import EXIT_FAILED, CLIError, describe_os_error
from lightning_sparse.lightning.checkpointing import remove_stale_temporaries

__all__ = ["RUN_ENV", "RunDir", "plan_run_dir", "reserve"]


@dataclass(frozen=True)
class RunDir:
    """Where one run writes: ``root/version_N``; ``resume`` is the checkpoint it continues."""

    root: Path
    version: int
    resume: Path | None = None
    asked_to_resume: bool = False
    continues: bool = True  # fit continues in the resumed run's directory
    reserved: bool = False  # this process created ``path`` (`reserve`)

    @property
    def path(self) -> Path:
        return self.root / f"version_{self.version}"

    def release(self) -> None:
        """Remove the directory `reserve` created, if nothing was written into it (a run that
        failed before it started leaves no empty ``version_N``)."""
        if self.reserved:
            try:
                self.path.rmdir()  # only an empty directory
            except OSError:
                pass

    def remove_stale_temporaries(self) -> list[Path]:
        """Delete the partial checkpoint files that writers killed mid-write left in any run
        under ``root`` (`lightning_sparse.lightning.checkpointing.remove_stale_temporaries`:
        only its own, unheld temporaries); return their paths."""
        versions = sorted(p for p in self.root.glob("version_*") if p.is_dir())
        return [path for d in versions for path in remove_stale_temporaries(d, recursive=True)]

    def to_env(self) -> str:
        resume = str(self.resume) if self.resume else None
        return json.dumps({"root": str(self.root), "version": self.version, "resume": resume})

    def describe(self) -> str:
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
    """Give the run its own ``version_N`` directory under the first logger's directory and point
    the loggers and checkpoints there (``config`` is edited); resolve ``ckpt_path: last``.

    The root is ``save_dir/name`` of a `CSVLogger` / `TensorBoardLogger` (which then get
    ``version=N``) or ``save_dir`` of a `WandbLogger` (whose ``save_dir`` becomes the run
    directory). `ModelCheckpoint` dirpaths under the logger's ``save_dir`` (the recipes'
    ``outputs/<recipe>/checkpoints``), or unset, move into the run directory. ``N`` is one more
    than the highest existing, reserved by creating the directory (`reserve`); with
    ``--ckpt_path last`` the newest ``last*.ckpt`` of the highest version that has one is loaded,
    and ``fit`` continues in that version's directory. ``None``
    (nothing changed) without such a logger or when the logger's ``version`` is set (the run
    directory is then the user's choice). ``worker``: a DDP worker's `RUN_ENV` value, the
    launching process's decision.

    Raises:
        CLIError: the run directory cannot be created (no permission, a file in the way, ...).
    """
    loggers = [
        (entry, cls)
        for entry in as_list(config.get("trainer.logger"))
        if (cls := class_of(entry)) is not None
        and issubclass(cls, CSVLogger | TensorBoardLogger | WandbLogger)
    ]
    if not loggers:
        return None
    entry, cls = loggers[0]
    args = entry.get("init_args") or Namespace()
    save_dir = args.get("save_dir")
    if save_dir is None or (not issubclass(cls, WandbLogger) and args.get("version") is not None):
        return None
    root = Path(save_dir)
    if not issubclass(cls, WandbLogger):
        root = root / (args.get("name") or "")
    ckpt_path = config.get("ckpt_path")
    asked = ckpt_path == "last"
    decided = json.loads(worker) if worker else None
    if decided and decided["root"] == str(root):
        resume = Path(decided["resume"]) if decided["resume"] else None
        run = RunDir(root, decided["version"], resume, asked)
    else:
        run = _new_or_latest(root, asked)
        if subcommand != "fit" and run.resume is not None:  # evaluated, not continued
            run = RunDir(root, _new_or_latest(root, False).version, run.resume, asked, False)
        if run.resume is None or not run.continues:
            run = reserve(run)
    if asked and run.resume is not None:
        config.ckpt_path = str(run.resume)
    for entry, cls in loggers:
        args = entry.get("init_args")
        if args is None:
            entry.init_args = args = Namespace()
        if issubclass(cls, WandbLogger):
            if args.get("save_dir") is not None:  # absolute: W&B prints `wandb sync <it>`
                args.save_dir = str((Path(args.save_dir) / run.path.name).resolve())
        elif args.get("version") is None:
            args.version = run.version
    for callback in as_list(config.get("trainer.callbacks")):
        cls = class_of(callback)
        if cls is None or not issubclass(cls, ModelCheckpoint):
            continue
        if callback.get("init_args") is None:
            callback.init_args = Namespace()
        dirpath = callback.init_args.get("dirpath")
        if dirpath is None:
            callback.init_args.dirpath = str(run.path / "checkpoints")
            continue
        try:
            inside = Path(dirpath).resolve().relative_to(Path(save_dir).resolve())
        except ValueError:
            continue  # elsewhere: the user's choice
        if not inside.parts or not inside.parts[0].startswith("version_"):
            callback.init_args.dirpath = str(run.path / inside)
    return run


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
    return RunDir(root, versions[0] + 1 if versions else 0, None, resume_last)


def reserve(run: RunDir) -> RunDir:
    """Create ``run.path``, or the first free ``version_M`` above it, and return that run.

    ``os.mkdir`` either creates the directory or fails because it exists, atomically, so runs
    started together in one directory each get their own version.

    Raises:
        CLIError: the directory cannot be created, naming it, the cause and the fix.
    """
    version = run.version
    while True:
        path = run.root / f"version_{version}"
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
