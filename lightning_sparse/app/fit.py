"""``lightning-sparse fit / validate / test / predict``: LightningCLI (`SparseCLI`, `run`).

With no ``--config`` it runs the default recipe, ``recipes/rigl_llama.yaml``: a small Llama
decoder on byte-level text from the Python standard library, RigL at 80% on the decoder's linear
layers. Any recipe, or any LightningCLI option, can be given on the command line::

    lightning-sparse fit                                   # the default recipe
    lightning-sparse fit --config recipes/static_llama.yaml --trainer.max_steps 50
    lightning-sparse fit --ckpt_path last                  # resume the recipe's latest run
    lightning-sparse test --ckpt_path last                 # evaluate it on the test split

Every run gets a `SparseRunSummary` callback (options under ``summary:``) and its own directory
(`lightning_sparse.app.run_dirs`; ``validate`` / ``test`` / ``predict`` a folder inside the run
they evaluate, with ``results.json`` or ``predictions.jsonl``: `lightning_sparse.app.evaluation`);
on a CUDA GPU, TF32 matmuls (`lightning_sparse.app.tensor_cores`). Before the objects are built
the configuration is adjusted to the flags given (`lightning_sparse.app.config_edits`: no
logger, ``fast_dev_run``, evaluations without W&B). Model and data are any LightningModule /
LightningDataModule named by ``class_path``. Only the subcommand on the command line gets a
parser (`subcommand_of`).

What a user can fix ends the command with one line and a non-zero exit status
(`lightning_sparse.app.errors.CLIError`): a ``--config`` file that is missing or not a YAML
mapping and a ``--ckpt_path`` that names no file or a file that is not a checkpoint
(`lightning_sparse.app.preflight`, before anything is built), a run directory or checkpoint that
cannot be written (no permission, disk full), and a run stopped by SIGTERM (exit status 143,
naming its last checkpoint, so that ``fit && next-stage`` stops too). A parse error is one line
with the closest name (`lightning_sparse.app.parse_errors`).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import lightning.pytorch as pl
from jsonargparse import ArgumentParser
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

import lightning_sparse.wse  # noqa: F401  (registers accelerator="wse" for recipes)
from lightning_sparse.app.common import LIGHTNING_SUBCOMMANDS, PROG
from lightning_sparse.app.config_edits import edit_for_run
from lightning_sparse.app.errors import (
    EXIT_FAILED,
    EXIT_SIGTERM,
    CLIError,
    describe_os_error,
    note_key,
)
from lightning_sparse.app.evaluation import PredictionWriter, write_results
from lightning_sparse.app.parse_errors import shorten
from lightning_sparse.app.preflight import (
    check_checkpoint_file,
    check_ckpt_path,
    check_config_files,
)
from lightning_sparse.app.progress import step_progress_bar
from lightning_sparse.app.quiet import plain_model_summary
from lightning_sparse.app.run_dirs import RUN_ENV, RunDir, plan_run_dir, run_config_of
from lightning_sparse.app.tensor_cores import use_tensor_cores
from lightning_sparse.app.threads import set_threads
from lightning_sparse.app.wandb_mode import active_wandb_run, set_wandb_mode
from lightning_sparse.data import DataError
from lightning_sparse.lightning import SparseRunSummary
from lightning_sparse.lightning.callback import check_resumable
from lightning_sparse.recipes import RECIPES_DIR
from lightning_sparse.wse.lightning import UnsupportedConfiguration

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = [
    "DEFAULT_RECIPE",
    "SparseCLI",
    "build_args",
    "last_checkpoint",
    "main",
    "run",
    "subcommand_of",
]

DEFAULT_RECIPE = RECIPES_DIR / "rigl_llama.yaml"


class _Parser(LightningArgumentParser):
    """A parse error prints a one-line usage (the full one is ~50 lines of options) and one line
    for the error, with the closest name where there is one (`parse_errors.shorten`)."""

    def print_usage(self, file: SupportsWrite[str] | None = None) -> None:
        prog = self.prog.replace(" [options]", "")
        (file or sys.stderr).write(f"usage: {prog} [options] (all options: {prog} --help)\n")

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # a class's own parser: its message goes into the outer one
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        usage = parser.prog.replace(" [options]", "")
        super().error(shorten(message, _option_names(parser), usage), ex)


def _option_names(parser: ArgumentParser) -> list[str]:
    """Every key (``trainer.max_steps``) and option string (``--trainer.max_steps``) of
    ``parser`` and of its subcommands' parsers."""
    names: list[str] = []
    for action in parser._actions:
        names += [action.dest, *action.option_strings]
        for sub in (getattr(action, "_name_parser_map", None) or {}).values():
            names += _option_names(sub)
    return names


class SparseCLI(LightningCLI):
    """LightningCLI with any LightningModule / LightningDataModule (``class_path`` in the recipe),
    a `SparseRunSummary` on every run (configured under ``summary:``) and one directory per run
    (`plan_run_dir`).

    Args:
        subcommand: build only this subcommand's parser (``fit``, ...); default: all four. Each
            is a full signature walk of the Trainer, model and data classes, so the command,
            which knows its subcommand from the command line (`subcommand_of`), builds one.
        *args, **kwargs: LightningCLI's.
    """

    run_dir: RunDir | None = None

    def __init__(self, *args: Any, subcommand: str | None = None, **kwargs: Any) -> None:
        self._only = subcommand
        command_line = kwargs.get("args")
        self._logger_asked = isinstance(command_line, list) and any(  # the class, by name
            a == "--trainer.logger" or str(a).startswith("--trainer.logger=") for a in command_line
        )
        try:
            super().__init__(*args, **kwargs)  # parses, builds and runs the subcommand
        except BaseException:
            if self.run_dir is not None:
                self.run_dir.release()  # a failed run leaves no version_N with nothing in it
            raise

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  # (static there)
        every = LightningCLI.subcommands()
        return every if self._only is None else {self._only: every[self._only]}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(SparseRunSummary, "summary")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads the checkpoint's hyper-parameters here, before any check of ours:
        # a path that is no file, or a file that is no checkpoint, is refused first.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        check_ckpt_path(ckpt_path, subcommand)
        if ckpt_path and Path(ckpt_path).is_file():
            check_checkpoint_file(str(ckpt_path))
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        # config.yaml keeps the configuration as given: run again from it, it makes a new run.
        self._config_as_given = config.clone()
        for line in edit_for_run(config, self.subcommand, self._logger_asked):
            rank_zero_info(line)
        set_wandb_mode(config)
        worker = os.environ.get(RUN_ENV)
        self.run_dir = plan_run_dir(config, self.subcommand, worker)
        if self.run_dir is not None:
            os.environ[RUN_ENV] = self.run_dir.to_env()  # run() restores it
            removed = [] if worker else self.run_dir.remove_stale_temporaries()
            if removed:
                rank_zero_info(
                    f"lightning-sparse: removed {len(removed)} partial checkpoint file(s) left by "
                    f"writes that were killed: {', '.join(str(p) for p in removed)}"
                )

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, ImportError, MisconfigurationException) as err:
            # A value a class refuses; Lightning's own refusals (an accelerator this machine
            # lacks, a precision plugin whose package is missing) among them.
            note_key(err, self.config[self.subcommand] if self.subcommand else self.config)
            raise
        check_context(self.model, self.datamodule)
        # Trainer.callbacks (and log_every_n_steps, datamodule) are set by Lightning's connectors,
        # undeclared on the class: mypy finds no such attribute.
        plain_model_summary(self.trainer.callbacks)  # type: ignore[attr-defined]
        step_progress_bar(self.trainer.callbacks)  # type: ignore[attr-defined]
        use_tensor_cores(self.trainer.accelerator)  # before Lightning's advice to do so
        if self.run_dir is not None:
            rank_zero_info(self.run_dir.describe())
            for callback in self.trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, SaveConfigCallback):
                    callback.config = self._config_as_given
            if self.subcommand == "predict":
                self.trainer.callbacks.append(PredictionWriter(self.run_dir.path))  # type: ignore[attr-defined]
        for logger in self.trainer.loggers:
            if logger.save_dir:  # W&B looks for a git repository there and warns if it is missing
                Path(logger.save_dir).mkdir(parents=True, exist_ok=True)
            if isinstance(logger, WandbLogger) and logger._wandb_init.get("anonymous") is None:
                # Lightning passes anonymous=None, which wandb >= 0.19 warns about on every run.
                logger._wandb_init.pop("anonymous", None)

    def _run_subcommand(self, subcommand: str) -> None:
        ckpt_path = self._prepare_subcommand_kwargs(subcommand).get("ckpt_path")
        if ckpt_path and Path(ckpt_path).is_file():
            try:  # another algorithm's checkpoint: refused before Lightning loads its weights
                check_resumable(self.trainer, ckpt_path)
            except ValueError as err:
                raise CLIError(str(err)) from err
        try:
            super()._run_subcommand(subcommand)
        except UnsupportedConfiguration as refused:  # the device's check, before any step
            raise CLIError(f"{refused}; nothing was trained") from refused
        except DataError as bad:  # the data the settings select, found unusable in setup
            flags = ", ".join(f"--data.{key}" for key in bad.keys)
            raise CLIError(
                f"data: {bad}" + (f" (on the command line: {flags})" if flags else "")
            ) from bad
        except ValueError as err:
            if ckpt_path and _optimizer_mismatch(err):  # torch's refusal, after the weights loaded
                raise CLIError(
                    f"--ckpt_path {ckpt_path}: the checkpoint's optimizer state does not fit this "
                    f"run's optimizer ({err}); resume with the optimizer the run trained with "
                    "(--config <run>/config.yaml, the config it saved), or start a new run from "
                    "its weights with the LoadWeights callback (docs/workflows.md); nothing was "
                    "trained"
                ) from err
            raise
        except SIGTERMException as stop:  # a SystemExit that would end the process with 0
            last = last_checkpoint(self.trainer)
            # In a run directory, "last" continues there; elsewhere the file itself.
            again = "last" if self.run_dir is not None else repr(str(last))
            where = (
                f"its last checkpoint is {str(last)!r} (the same command with --ckpt_path "
                f"{again} resumes from it)"
                if last is not None
                else "it wrote no checkpoint"
            )
            raise CLIError(
                f"{subcommand} stopped by SIGTERM at step {self.trainer.global_step}, before it "
                f"finished (exit status {EXIT_SIGTERM}); {where}",
                EXIT_SIGTERM,
            ) from stop

    # LightningCLI runs ``self.<subcommand>`` where it exists, else ``trainer.<subcommand>``.
    def validate(self, **kwargs: Any) -> None:
        self._save_results("validate", self.trainer.validate(**kwargs), kwargs.get("ckpt_path"))

    def test(self, **kwargs: Any) -> None:
        self._save_results("test", self.trainer.test(**kwargs), kwargs.get("ckpt_path"))

    def _save_results(self, subcommand: str, metrics: Any, ckpt_path: str | None) -> None:
        if self.run_dir is not None and self.trainer.is_global_zero:
            path = write_results(self.run_dir.path, subcommand, ckpt_path, metrics)
            print(f"{PROG}: {subcommand} results saved to {path}", flush=True)


def last_checkpoint(trainer: pl.Trainer) -> Path | None:
    """The newest checkpoint file the trainer's `ModelCheckpoint` callbacks know of (their
    ``last_model_path`` / ``best_model_path`` or a ``.ckpt`` in their ``dirpath``), or None."""
    found: set[Path] = set()
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):  # no files the base Checkpoint names
            continue
        for known in (callback.last_model_path, callback.best_model_path):
            if known and Path(known).is_file():
                found.add(Path(known))
        if callback.dirpath and Path(callback.dirpath).is_dir():
            found.update(p for p in Path(callback.dirpath).glob("*.ckpt") if p.is_file())
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def _optimizer_mismatch(err: ValueError) -> bool:
    """Whether ``err`` is ``Optimizer.load_state_dict``'s refusal of another optimizer's state
    (other parameter groups, or groups of other sizes)."""
    text = str(err)
    return "different number of parameter groups" in text or "size of optimizer's group" in text


def check_context(model: object, datamodule: object) -> None:
    """Refuse data windows longer than the package's `Llama` can see (its ``max_seq_len``),
    before the sanity check would fail on the first batch.

    Raises:
        CLIError: ``--data.seq_len`` above ``--model.max_seq_len``.
    """
    seq_len = getattr(getattr(datamodule, "hparams", None), "seq_len", None)
    config = getattr(getattr(model, "model", None), "config", None)
    context = getattr(config, "max_seq_len", None)
    if isinstance(seq_len, int) and isinstance(context, int) and seq_len > context:
        raise CLIError(
            f"--data.seq_len={seq_len} is longer than the model's context, --model.max_seq_len="
            f"{context}: every window must fit it; lower --data.seq_len or raise "
            "--model.max_seq_len"
        )


def subcommand_of(args: list[str]) -> str | None:
    """The LightningCLI subcommand ``args`` names: the first word, or the word after
    LightningCLI's own leading options (``-c all.yaml fit``, a config with a ``fit:`` key);
    ``None`` when there is none (no words, or options only)."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 2 if args[i] in ("-c", "--config") else 1
    return args[i] if i < len(args) and args[i] in LIGHTNING_SUBCOMMANDS else None


def build_args(args: list[str]) -> list[str]:
    """The LightningCLI argument list: ``fit`` when no subcommand is named (no arguments, or
    options only: they are fit's); when no config, the default recipe, or for ``validate`` /
    ``test`` / ``predict`` of a checkpoint inside a run directory the run's own ``config.yaml``
    (the model, data and callbacks that wrote it; the recipe's would evaluate another model).

    Raises:
        FileNotFoundError: the default recipe is needed but missing (not a source checkout).
    """
    args = list(args)
    if subcommand_of(args) is None:
        args.insert(0, "fit")
    has_config = any(a in ("--config", "-c") or a.startswith("--config=") for a in args)
    if args[0] in LIGHTNING_SUBCOMMANDS and args[0] != "fit" and not has_config:
        saved = run_config_of(option_value(args, "--ckpt_path"))
        if saved is not None:
            print(f"{PROG}: no --config: using the run's own, {saved}", file=sys.stderr)
            args[1:1] = ["--config", str(saved)]
            has_config = True
    if args[0] in LIGHTNING_SUBCOMMANDS and not has_config:
        if not DEFAULT_RECIPE.is_file():
            raise FileNotFoundError(
                f"default recipe {DEFAULT_RECIPE} not found: the installation is incomplete "
                "(reinstall lightning-sparse) or pass --config path/to/recipe.yaml"
            )
        args[1:1] = ["--config", str(DEFAULT_RECIPE)]
    return args


def option_value(args: list[str], option: str) -> str | None:
    """The last value ``args`` gives ``option`` (``--opt value`` or ``--opt=value``), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{option}="):
            value = arg.split("=", 1)[1]
    return value


def run(args: list[str]) -> SparseCLI:
    """Run a LightningCLI subcommand (after `build_args`) and return the CLI object."""
    args = build_args(args)
    subcommand = subcommand_of(args)
    if subcommand is None:  # build_args has named one
        raise RuntimeError(f"no LightningCLI subcommand in {args}")
    subcommand_kwargs: dict[str, Any] = {"allow_abbrev": False}
    if subcommand == "fit":
        subcommand_kwargs["description"] = (
            "Train. Without --config: the default recipe, recipes/rigl_llama.yaml (installed at "
            f"{DEFAULT_RECIPE}). Each run writes to its own <logger save_dir>/version_N; "
            "--ckpt_path last resumes the latest run."
        )
    saved_run_env = os.environ.get(RUN_ENV)
    outer_wandb_run = active_wandb_run()
    # No base classes: model and data are any LightningModule / LightningDataModule named by
    # class_path, and data is optional (a LightningModule may bring its own dataloaders).
    try:
        with warnings.catch_warnings():
            # We pass the (possibly completed) command line as `args` on purpose.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            return SparseCLI(
                args=args,
                subcommand=subcommand,
                parser_class=_Parser,
                save_config_kwargs={"overwrite": True},
                parser_kwargs={"prog": PROG, "allow_abbrev": False, subcommand: subcommand_kwargs},
            )
    finally:
        if saved_run_env is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = saved_run_env
        # A W&B run this call started ends with it: WandbLogger reuses the process's active run,
        # so the next in-process run (a sweep's next point) would log into this one.
        wandb_run = active_wandb_run()
        if wandb_run is not None and wandb_run is not outer_wandb_run:
            wandb_run.finish()


def _only_prints(args: list[str]) -> bool:
    """Whether ``args`` only print something (help, ``--print_config``) and run nothing."""
    return any(
        re.fullmatch(r"-h|--help|--[\w.]+\.help(=.*)?|--print_config(=.*)?", a) for a in args
    )


def main(args: list[str]) -> None:
    """``lightning-sparse [fit|validate|test|predict] ...``: ``args`` is the whole command line
    after ``lightning-sparse`` (the subcommand's name included). Checks the ``--config`` files,
    sets torch's threads for a run (`set_threads`), then `run`.

    Raises:
        CLIError: a bad ``--config`` file or ``--ckpt_path``, a file that cannot be written, a
            run stopped by SIGTERM (see the module docstring).
    """
    check_config_files(args)
    if not _only_prints(args):  # idle cores only: two threads thrash beside a busy one
        print(set_threads(), file=sys.stderr, flush=True)  # stdout: --print_config's YAML
    try:
        run(args)
    except OSError as err:  # a directory or checkpoint that cannot be written, a full disk
        raise CLIError(describe_os_error(err), EXIT_FAILED) from err
