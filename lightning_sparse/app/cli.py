"""`lightning-sparse`: LightningCLI (fit / validate / test / predict), ``compare`` and ``sweep``.

With no ``--config`` it runs the default recipe, ``recipes/rigl_llama.yaml``: a small Llama
decoder on byte-level text from the Python standard library, RigL at 80% on the decoder's linear
layers. Any recipe, or any LightningCLI option, can be given on the command line::

    lightning-sparse fit                                   # the default recipe
    lightning-sparse fit --config recipes/static_llama.yaml --trainer.max_steps 50
    lightning-sparse fit --ckpt_path last                  # resume the recipe's latest run
    lightning-sparse compare --steps 100                   # dense / static / SET / RigL / GraNet
    lightning-sparse sweep ...                             # see lightning_sparse/app/sweep.py
    lightning-sparse export --ckpt_path last.ckpt --output hf_model   # see app/export_cmd.py
    lightning-sparse generate --model hf_model --prompt "def "         # see app/generate.py

Every run gets a `SparseRunSummary` callback (options under ``summary:``) and its own directory,
``<logger save_dir>/version_N`` (`plan_run_dir`): logger files, ``summary.json``, ``config.yaml``
and the checkpoints; ``--ckpt_path last`` continues the newest run that has a ``last*.ckpt``.
Weights & Biases runs offline unless an account is configured (``WANDB_API_KEY`` or an
``api.wandb.ai`` entry in ``~/.netrc``); ``WANDB_MODE`` set by the user always wins.
Configuration errors print a few lines (``LIGHTNING_SPARSE_DEBUG=1`` or ``--debug``: the
traceback); Lightning's and W&B's advice that does not apply here is filtered out (`quiet`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import netrc
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, RichModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info

import lightning_sparse.wse  # noqa: F401  (registers accelerator="wse" for recipes)
from lightning_sparse.app.threads import set_threads
from lightning_sparse.lightning import ModelZooSparsity, SparseRunSummary
from lightning_sparse.recipes import RECIPES_DIR

__all__ = [
    "DEBUG_ENV",
    "DEFAULT_RECIPE",
    "RECIPES_DIR",
    "ModelZooSparsity",
    "RunDir",
    "SparseCLI",
    "build_args",
    "main",
    "plan_run_dir",
    "quiet",
    "run",
    "wandb_mode",
]

DEFAULT_RECIPE = RECIPES_DIR / "rigl_llama.yaml"
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
DEBUG_ENV = "LIGHTNING_SPARSE_DEBUG"
# The run directory chosen by the launching process, for the DDP workers Lightning starts (they
# parse the same command line and must not pick the next version_N).
RUN_ENV = "LIGHTNING_SPARSE_RUN"
SUBCOMMAND_HELP = {
    "fit": "train (default; no --config: recipes/rigl_llama.yaml)",
    "validate": "one validation epoch (a checkpoint: --ckpt_path)",
    "test": "one test epoch (a checkpoint: --ckpt_path)",
    "predict": "predictions over the predict dataloader",
    "compare": "train recipes in turn; table and plot (compare --help)",
    "sweep": "run a W&B sweep config locally (sweep --help)",
    "export": "checkpoint -> Hugging Face directory (export --help)",
    "generate": "continue a prompt with a sparse model served in CSR (generate --help)",
}
_CONFIG_ERROR_NOTE = "lightning-sparse: raised while building the configured objects"


class _Parser(LightningArgumentParser):
    """A parse error prints a one-line usage (the full one is ~50 lines of options)."""

    def print_usage(self, file: TextIO | None = None) -> None:
        prog = self.prog.replace(" [options]", "")
        (file or sys.stderr).write(f"usage: {prog} [options] (all options: {prog} --help)\n")


class SparseCLI(LightningCLI):
    """LightningCLI with any LightningModule / LightningDataModule (``class_path`` in the recipe),
    a `SparseRunSummary` on every run (configured under ``summary:``) and one directory per run
    (`plan_run_dir`)."""

    run_dir: RunDir | None = None

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(SparseRunSummary, "summary")

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        # One line per subcommand in --help, compare and sweep included (main() dispatches them
        # before LightningCLI; these entries only document them).
        super()._add_subcommands(parser, **kwargs)
        action = parser._subcommands_action
        for name in ("compare", "sweep", "export", "generate"):
            action.add_subcommand(name, self.parser_class(), help=SUBCOMMAND_HELP[name])
        for choice in action._choices_actions:
            choice.help = SUBCOMMAND_HELP.get(choice.dest, choice.help)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        _set_wandb_mode(config)
        # config.yaml keeps the configuration as given: run again from it, it makes a new run.
        self._config_as_given = config.clone()
        self.run_dir = plan_run_dir(config, self.subcommand, os.environ.get(RUN_ENV))
        if self.run_dir is not None:
            os.environ[RUN_ENV] = self.run_dir.to_env()  # run() restores it

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:
            config = self.config[self.subcommand] if self.subcommand else self.config
            key = _offending_key(config, err)
            err.add_note(
                f"{_CONFIG_ERROR_NOTE}{f' ({key})' if key else ''}, before any training step; "
                "fix the recipe value named above (or its command-line override)"
            )
            raise
        plain_model_summary(self.trainer.callbacks)
        if self.run_dir is not None:
            rank_zero_info(self.run_dir.describe())
            for callback in self.trainer.callbacks:
                if isinstance(callback, SaveConfigCallback):
                    callback.config = self._config_as_given
        for logger in self.trainer.loggers:
            if logger.save_dir:  # W&B looks for a git repository there and warns if it is missing
                Path(logger.save_dir).mkdir(parents=True, exist_ok=True)
            if isinstance(logger, WandbLogger) and logger._wandb_init.get("anonymous") is None:
                # Lightning passes anonymous=None, which wandb >= 0.19 warns about on every run.
                logger._wandb_init.pop("anonymous", None)


# ------------------------------------------------------------------------------ run directories
@dataclass(frozen=True)
class RunDir:
    """Where one run writes: ``root/version_N``; ``resume`` is the checkpoint it continues."""

    root: Path
    version: int
    resume: Path | None = None
    asked_to_resume: bool = False
    continues: bool = True  # fit continues in the resumed run's directory

    @property
    def path(self) -> Path:
        return self.root / f"version_{self.version}"

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
    than the highest existing; with ``--ckpt_path last`` the newest ``last*.ckpt`` of the highest
    version that has one is loaded, and ``fit`` continues in that version's directory. ``None``
    (nothing changed) without such a logger or when the logger's ``version`` is set (the run
    directory is then the user's choice). ``worker``: a DDP worker's `RUN_ENV` value, the
    launching process's decision.
    """
    loggers = [
        (entry, cls)
        for entry in _as_list(config.get("trainer.logger"))
        if (cls := _class_of(entry)) is not None
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
    for callback in _as_list(config.get("trainer.callbacks")):
        cls = _class_of(callback)
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


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, list):
        return value
    return [] if value is None or isinstance(value, bool) else [value]


def _class_of(entry: Any) -> type | None:
    """The class a config entry (``class_path`` + ``init_args``) names; ``None`` otherwise."""
    class_path = entry.get("class_path") if isinstance(entry, Namespace) else None
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) else None


# ------------------------------------------------------------------------------ errors and noise
def _offending_key(config: Namespace, err: BaseException) -> str | None:
    """The config key of the object whose constructor raised ``err`` (its innermost cause),
    with the argument the message starts with (``sparsity=1.5 ...``) when it is one of its."""
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    raised_in = next(
        (
            type(frame.f_locals["self"])
            for frame, _ in traceback.walk_tb(cause.__traceback__)
            if frame.f_code.co_name == "__init__" and "self" in frame.f_locals
        ),
        None,
    )
    if raised_in is None:
        return None
    for key, entry in _class_entries(config):
        if _class_of(entry) is raised_in:
            match = re.match(r"(\w+)=", str(cause))
            args = entry.get("init_args") or Namespace()
            if match and match[1] in args:
                return f"{key}.init_args.{match[1]} ({entry.class_path})"
            return f"{key} ({entry.class_path})"
    return None


def _class_entries(value: Any, key: str = "") -> Iterator[tuple[str, Namespace]]:
    if isinstance(value, Namespace):
        if isinstance(value.get("class_path"), str):
            yield key, value
        for name, item in vars(value).items():
            if name != "init_args":
                yield from _class_entries(item, f"{key}.{name}" if key else name)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _class_entries(item, f"{key}[{index}]")


class _DropRecords(logging.Filter):
    """Drops log records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


class _NoZeroFlops(logging.Filter):
    """Lightning's model summary without its FLOPs column and "0 Total Flops" line, which only
    count with ``example_input_array`` set (the parameter counts stay)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = drop_zero_flops(str(record.msg))
        return True


def plain_model_summary(callbacks: list[Any]) -> None:
    """Swap Lightning's rich model summary (chosen when ``rich`` is installed) for the plain one,
    in place: the rich table always shows a FLOPs column, 0 here (`drop_zero_flops` filters the
    plain one; the run summary reports the sparse FLOPs)."""
    for i, callback in enumerate(callbacks):
        if type(callback) is RichModelSummary:
            callbacks[i] = ModelSummary(max_depth=callback._max_depth)


def drop_zero_flops(table: str) -> str:
    """``table`` (Lightning's model summary) without the FLOPs column if the total is 0."""
    lines = table.split("\n")
    if not any(re.fullmatch(r"0\s+Total Flops", line) for line in lines):
        return table
    header = next((i for i, line in enumerate(lines) if " | FLOPs" in line), None)
    lines = [line for line in lines if not re.fullmatch(r"0\s+Total Flops", line)]
    if header is None:
        return "\n".join(lines)
    start = lines[header].index(" | FLOPs")
    end = lines[header].find(" | ", start + 3)
    end = len(lines[header]) if end < 0 else end
    for i in range(header, len(lines)):
        line = lines[i]
        if "Trainable params" in line:
            break  # the totals below the table
        if line and set(line) == {"-"}:
            lines[i] = "-" * (len(line) - (end - start))
        else:
            lines[i] = (line[:start] + line[end:]).rstrip()
    return "\n".join(lines)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Filters, for the duration, the messages that do not apply to this package's runs:
    Lightning's litlogger / litmodels tips, its FLOPs-less model summary column, the pytree
    deprecation warning of Lightning on newer torch. (W&B's "anonymous setting" warning is
    avoided in `SparseCLI.instantiate_classes`.)"""
    tips = _DropRecords("💡 Tip:")
    flops = _NoZeroFlops()
    rank_zero = [
        logging.getLogger(n)
        for n in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
    ]
    summary = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    for logger in rank_zero:
        logger.addFilter(tips)
    summary.addFilter(flops)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
            yield
    finally:
        for logger in rank_zero:
            logger.removeFilter(tips)
        summary.removeFilter(flops)


# ------------------------------------------------------------------------------ W&B
def wandb_mode() -> str:
    """``WANDB_MODE`` if set; ``online`` when a W&B account is configured; else ``offline``.

    An account is ``WANDB_API_KEY`` or a ``~/.netrc`` (``$NETRC``) entry for the W&B host
    (``api.wandb.ai``, or the host of ``WANDB_BASE_URL``).
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host or "api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        entry = None
    return "online" if entry and entry[2] else "offline"


def _set_wandb_mode(config: Namespace) -> None:
    """Decide ``WANDB_MODE`` once (DDP workers and wandb inherit it); say so if a W&B logger
    is configured and it is offline. Runs after parsing, so not for ``--help``."""
    if os.environ.get("WANDB_MODE"):
        return
    os.environ["WANDB_MODE"] = wandb_mode()
    uses_wandb = any(
        (cls := _class_of(e)) is not None and issubclass(cls, WandbLogger)
        for e in _as_list(config.get("trainer.logger"))
    )
    if os.environ["WANDB_MODE"] == "offline" and uses_wandb:
        rank_zero_info(
            "W&B: offline (no account configured): runs are kept under the logger's "
            "save_dir; upload them later with `wandb sync`"
        )


# ------------------------------------------------------------------------------ entry points
def build_args(args: list[str]) -> list[str]:
    """The LightningCLI argument list: ``fit`` when empty; the default recipe when no config.

    Raises:
        FileNotFoundError: the default recipe is needed but missing (not a source checkout).
    """
    args = list(args) or ["fit"]
    has_config = any(a in ("--config", "-c") or a.startswith("--config=") for a in args)
    if args[0] in LIGHTNING_SUBCOMMANDS and not has_config:
        if not DEFAULT_RECIPE.is_file():
            raise FileNotFoundError(
                f"default recipe {DEFAULT_RECIPE} not found: the installation is incomplete "
                "(reinstall lightning-sparse) or pass --config path/to/recipe.yaml"
            )
        args[1:1] = ["--config", str(DEFAULT_RECIPE)]
    return args


def run(args: list[str]) -> SparseCLI:
    """Run a LightningCLI subcommand (after `build_args`) and return the CLI object."""
    subcommand_kwargs: dict[str, Any] = {
        name: {"allow_abbrev": False} for name in LIGHTNING_SUBCOMMANDS
    }
    subcommand_kwargs["fit"]["description"] = (
        "Train. Without --config: the default recipe, recipes/rigl_llama.yaml (installed at "
        f"{DEFAULT_RECIPE}). Each run writes to its own <logger save_dir>/version_N; "
        "--ckpt_path last resumes the latest run."
    )
    saved_run_env = os.environ.get(RUN_ENV)
    outer_wandb_run = _wandb_run()
    # No base classes: model and data are any LightningModule / LightningDataModule named by
    # class_path, and data is optional (a LightningModule may bring its own dataloaders).
    try:
        with warnings.catch_warnings():
            # We pass the (possibly completed) command line as `args` on purpose.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            return SparseCLI(
                args=build_args(args),
                parser_class=_Parser,
                save_config_kwargs={"overwrite": True},
                parser_kwargs={
                    "prog": "lightning-sparse",
                    "allow_abbrev": False,
                    **subcommand_kwargs,
                },
            )
    finally:
        if saved_run_env is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = saved_run_env
        # A W&B run this call started ends with it: WandbLogger reuses the process's active run,
        # so the next in-process run (a sweep's next point) would log into this one.
        run = _wandb_run()
        if run is not None and run is not outer_wandb_run:
            run.finish()


def _wandb_run() -> Any:
    """The process's active W&B run (``wandb.run``), or None; never imports wandb."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None)


def main(args: list[str] | None = None) -> None:
    """Entry point: ``compare``, ``sweep`` and ``export`` go to their modules, the rest to
    `SparseCLI`.

    Configuration errors exit with a few lines naming the key; ``--debug`` (anywhere) or
    ``LIGHTNING_SPARSE_DEBUG=1`` shows the full traceback instead.
    """
    args = list(sys.argv[1:] if args is None else args)
    debug = "--debug" in args or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    if args[:1] in ([], ["fit"], ["validate"], ["test"], ["predict"]) and "--help" not in args:
        print(set_threads(), flush=True)  # idle cores only: two threads thrash beside a busy one
    with quiet():
        try:
            _dispatch(args)
        except (ValueError, TypeError) as err:
            if debug or not any(n.startswith(_CONFIG_ERROR_NOTE) for n in _notes(err)):
                raise
            sys.exit(_short_error(err))


def _dispatch(args: list[str]) -> None:
    if args and args[0] == "compare":
        from lightning_sparse.app import compare

        compare.main(args[1:])
    elif args and args[0] == "sweep":
        from lightning_sparse.app import sweep  # written separately; imported only when asked for

        sweep.main(args[1:])
    elif args and args[0] == "export":
        from lightning_sparse.app import export_cmd  # needs transformers only when it runs

        export_cmd.main(args[1:])
    elif args and args[0] == "generate":
        from lightning_sparse.app import generate  # needs transformers only for HF models

        generate.main(args[1:])
    elif args and not args[0].startswith("-") and args[0] not in LIGHTNING_SUBCOMMANDS:
        sys.exit(f"lightning-sparse: unknown subcommand {args[0]!r}; {_EPILOG}")
    else:
        run(args)


def _notes(err: BaseException) -> list[str]:
    return list(getattr(err, "__notes__", []))


def _short_error(err: BaseException) -> str:
    """A few lines: the library's message (the innermost cause), the key, how to see more."""
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    where = next((n for n in _notes(err) if n.startswith(_CONFIG_ERROR_NOTE)), "")
    key = re.search(r"\((.+)\), before", where)
    return "\n".join(
        [
            f"lightning-sparse: configuration error{f' in {key[1]}' if key else ''}:",
            f"  {type(cause).__name__}: {cause}",
            "Fix the recipe value (or its command-line override); nothing was trained. "
            f"Full traceback: {DEBUG_ENV}=1 or --debug.",
        ]
    )


_EPILOG = (
    "subcommands: fit (default), validate, test, predict (LightningCLI), compare (train and "
    "tabulate several recipes: lightning-sparse compare --help), sweep (lightning-sparse sweep "
    "--help), export (checkpoint to a Hugging Face directory: lightning-sparse export --help), "
    "generate (a sparse model served in CSR: lightning-sparse generate --help)"
)


if __name__ == "__main__":
    main()
