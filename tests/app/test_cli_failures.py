"""`lightning-sparse` never loses a run: every expected failure is one line naming the file and
the fix with a non-zero exit status (no traceback); runs started together get their own
directories; partial checkpoint files of killed writes are removed; a fit stopped by SIGTERM
exits 143 and names its last checkpoint.

In-process runs use ``cli.main`` (what the command runs); the signal and concurrency tests start
real processes (one torch thread each, W&B offline, CSV logs).
"""

from __future__ import annotations

import csv
import errno
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from jsonargparse import Namespace

from lightning_sparse.app import cli, fit, run_dirs
from lightning_sparse.lightning import checkpointing
from tests.helpers import repo_pythonpath

REPO = Path(__file__).resolve().parents[2]
CSV = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
TINY = [
    *("--trainer.accelerator", "cpu"),  # the recipes say auto: the GPU where there is one
    *("--model.dim", "32", "--model.n_layers", "1", "--model.max_seq_len", "32"),
    *("--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"),
    *("--data.val_windows", "4", "--trainer.enable_progress_bar", "false"),
    *("--trainer.enable_model_summary", "false"),
]


@pytest.fixture(autouse=True)
def _offline_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("LIGHTNING_SPARSE_THREADS", "1")
    monkeypatch.delenv("LIGHTNING_SPARSE_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


def one_line_failure(args: list[str], capsys: pytest.CaptureFixture, code: int = 2) -> str:
    """Run ``lightning-sparse <args>``; it must exit with ``code`` and one line on stderr (besides
    the thread count every run states there first)."""
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == code, info.value.code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if " torch thread(s) (" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("lightning-sparse: ") and "Traceback" not in err
    return lines[0]


def process_env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "LIGHTNING_SPARSE_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "PYTHONPATH": repo_pythonpath(),
    }


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_sparse.app.cli", *args],
        cwd=cwd,
        env=process_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# ---------------------------------------------------------------- config files and --ckpt_path

BAD_CONFIGS = {
    "missing": (None, "'recipe.yaml' (--config) does not exist", "recipe YAML"),
    "directory": ("dir", "'recipe.yaml' (--config) is a directory", "YAML file inside it"),
    "syntax": (
        "trainer:\n  max_steps: [1, 2\nmodel: {}\n",
        "'recipe.yaml' (--config): line 3, column 6: YAML syntax error",
        "fix the YAML there",
    ),
    "tab": (
        "trainer:\n\tmax_steps: 5\n",
        "'recipe.yaml' (--config): line 2, column 1: YAML syntax error",
        "fix the YAML",
    ),
    "list": (
        "- trainer: {}\n- model: {}\n",
        "'recipe.yaml' (--config) holds a list at the top level",
        "mapping of keys",
    ),
    "scalar": (
        "42\n",
        "'recipe.yaml' (--config) holds a single int value at the top level",
        "mapping of keys",
    ),
    "binary": (b"\xff\xfe\x00\x81", "'recipe.yaml' (--config) is not text", "check the path"),
    "empty": ("", "'recipe.yaml' (--config) is empty (no keys, or comments only)", "shipped"),
    "comments": ("# only a comment\n", "'recipe.yaml' (--config) is empty", "recipes in"),
}


@pytest.mark.parametrize("kind", list(BAD_CONFIGS))
@pytest.mark.parametrize("form", ["--config", "--config=", "-c"])
def test_bad_config_file_is_one_line_naming_the_file(
    kind: str, form: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    content, problem, fix = BAD_CONFIGS[kind]
    path = tmp_path / "recipe.yaml"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    option = ["--config=recipe.yaml"] if form == "--config=" else [form, "recipe.yaml"]
    line = one_line_failure(["fit", *option, "--trainer.max_steps", "1"], capsys)
    assert f"config file {problem}" in line and fix in line, line
    assert "<unicode string>" not in line
    assert not (tmp_path / "outputs").exists()  # refused before anything ran


def test_inline_config_is_still_lightning_clis(capsys: pytest.CaptureFixture) -> None:
    """``--config '{...}'`` (a YAML mapping, not a path) is LightningCLI's inline form."""
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", "{trainer: {max_steps: 1}}", "--print_config"])
    assert info.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["max_steps"] == 1


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_missing_checkpoint_is_one_line_before_anything_is_built(
    subcommand: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    line = one_line_failure([subcommand, *TINY, *CSV, "--ckpt_path", "nope.ckpt"], capsys)
    assert "checkpoint 'nope.ckpt' (--ckpt_path) does not exist" in line
    assert "written by fit" in line
    assert ("--ckpt_path last" in line) == (subcommand == "fit")
    assert not (tmp_path / "outputs").exists()  # no run directory, no model built
    (tmp_path / "ckpts").mkdir()
    line = one_line_failure([subcommand, *TINY, *CSV, "--ckpt_path", "ckpts"], capsys)
    assert "'ckpts' (--ckpt_path) is a directory; pass the .ckpt file inside it" in line


# ---------------------------------------------------------------- files that cannot be written


def test_output_path_blocked_by_a_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "outputs").write_text("not a directory")
    line = one_line_failure(["fit", *TINY, "--trainer.max_steps", "1"], capsys, code=1)
    assert "cannot create the run directory 'outputs/rigl_llama/version_0'" in line
    assert "'outputs' is a file, not a directory; move it away" in line
    assert (tmp_path / "outputs").read_text() == "not a directory"


def test_output_directory_without_permission(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The tests run as root, where a read-only directory still takes writes: ``os.mkdir`` is
    made to refuse inside ``outputs`` as it does for a user without write permission."""
    real_mkdir = os.mkdir

    def denied(path: Any, *args: Any, **kwargs: Any) -> None:
        if "outputs" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", denied)
    line = one_line_failure(["fit", *TINY, "--trainer.max_steps", "1"], capsys, code=1)
    assert "cannot create the run directory 'outputs/rigl_llama/version_0'" in line
    assert f"permission denied; make {str(tmp_path)!r} writable" in line and "chmod" in line


def test_full_disk_while_writing_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def full(obj: object, f: Any, *args: object, **kwargs: object) -> None:
        f.write(b"PK partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpointing.torch, "save", full)
    args = ["fit", *TINY, *CSV, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
    line = one_line_failure(args, capsys, code=1)
    assert line.startswith("lightning-sparse: could not save checkpoint '")
    assert "/checkpoints/last.ckpt'" in line and "no space left on device" in line
    assert "free space there" in line
    (checkpoints,) = tmp_path.glob("outputs/**/checkpoints")
    assert list(checkpoints.iterdir()) == []  # no partial file left


# ---------------------------------------------------------------- runs started together


def csv_run_config(save_dir: str = "outputs") -> Namespace:
    return Namespace(
        trainer=Namespace(
            logger=Namespace(
                class_path="lightning.pytorch.loggers.CSVLogger",
                init_args=Namespace(save_dir=save_dir, name="run"),
            ),
            callbacks=[],
        ),
        ckpt_path=None,
    )


def test_threads_planning_runs_at_once_get_distinct_directories(tmp_path: Path) -> None:
    planned: list[int] = []
    barrier = threading.Barrier(12)

    def plan() -> None:
        barrier.wait()
        run = run_dirs.plan_run_dir(csv_run_config())
        assert run is not None
        planned.append(run.version)

    threads = [threading.Thread(target=plan) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(planned) == list(range(12))
    assert sorted(p.name for p in (tmp_path / "outputs/run").iterdir()) == sorted(
        f"version_{v}" for v in range(12)
    )


def test_a_run_that_fails_before_it_starts_leaves_no_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", *TINY, *CSV, "--model.dim", "30"])  # refused by the model
    assert "configuration error in model.init_args.dim" in str(info.value.code)
    assert (tmp_path / "outputs").is_dir()  # the directory was reserved, then given back
    assert list(tmp_path.glob("outputs/**/version_*")) == []


def train_loss_steps(metrics: Path) -> list[int]:
    with open(metrics, newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


def test_two_fits_started_together_write_to_their_own_directories(tmp_path: Path) -> None:
    common = ["fit", *TINY, *CSV, "--trainer.logger.init_args.save_dir", "outputs"]
    common += ["--trainer.logger.init_args.name", "runs", "--trainer.log_every_n_steps", "1"]
    runs = {
        steps: start([*common, "--trainer.max_steps", str(steps)], tmp_path) for steps in (2, 4)
    }
    for process in runs.values():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, (out + err)[-3000:]
    versions = sorted((tmp_path / "outputs/runs").iterdir())
    assert [v.name for v in versions] == ["version_0", "version_1"]
    seen = set()
    for version in versions:
        steps = json.loads((version / "summary.json").read_text())["steps"]
        saved = yaml.safe_load((version / "config.yaml").read_text())
        assert saved["trainer"]["max_steps"] == steps  # this run's own configuration
        assert train_loss_steps(version / "metrics.csv") == list(range(steps))  # only its own
        assert (
            torch.load(next(version.rglob("last.ckpt")), weights_only=False)["global_step"] == steps
        )
        seen.add(steps)
    assert seen == {2, 4}


# ---------------------------------------------------------------- partial checkpoint files


def test_a_new_run_removes_partial_checkpoints_of_killed_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed during its first checkpoint write left only a temporary file, so
    ``--ckpt_path last`` starts a new run: that run removes the leftover (only it)."""
    root = tmp_path / "outputs/rigl_llama"  # CSVLogger: save_dir (its name is save_dir's own)
    killed = root / "version_0/checkpoints"
    killed.mkdir(parents=True)
    leftovers = [
        killed / ".last.ckpt.k2j4h5g6.partial.tmp",
        killed / ".last.ckpt.abcd_123.tmp",  # written by an earlier version of the writer
    ]
    kept = [
        killed / ".notes.abcdefgh.tmp",  # hidden and .tmp, but no checkpoint's temporary
        killed / "last.ckpt.tmp",
        killed / "keep.partial.tmp",
    ]
    for path in leftovers + kept:
        path.write_bytes(b"PK partial")
    args = ["fit", *TINY, *CSV, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1"]
    said: list[str] = []
    said_to = logging.Handler()
    said_to.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    lightning_log = logging.getLogger("lightning.pytorch")  # Lightning's own, not propagated
    monkeypatch.setattr(lightning_log, "handlers", [*lightning_log.handlers, said_to])
    cli.main([*args, "--ckpt_path", "last"])
    (line,) = [m for m in said if "partial checkpoint" in m]
    assert line.startswith("lightning-sparse: removed 2 partial checkpoint file(s) left by ")
    assert all(str(p.relative_to(tmp_path)) in line for p in leftovers)
    assert not any(p.exists() for p in leftovers)
    assert all(p.exists() for p in kept)
    assert (root / "version_1/checkpoints/last.ckpt").is_file()


def test_a_temporary_being_written_by_another_process_is_not_removed(tmp_path: Path) -> None:
    """A writer holds its temporary file locked until the rename: a cleanup at that moment (as
    another run starting in the same directory does) leaves it, and the write completes."""
    target = tmp_path / "ckpts" / "last.ckpt"
    written, release = threading.Event(), threading.Event()

    class PausedCommit(checkpointing.AtomicCheckpointIO):
        def commit(self, temporary: Path, target: Path) -> None:
            written.set()
            assert release.wait(60)
            super().commit(temporary, target)

    errors: list[BaseException] = []

    def save() -> None:
        try:
            PausedCommit().save_checkpoint({"step": 7}, target)
        except BaseException as err:  # reported below
            errors.append(err)

    writer = threading.Thread(target=save)
    writer.start()
    assert written.wait(60)
    (temporary,) = target.parent.glob(".last.ckpt.*.partial.tmp")
    assert checkpointing.remove_stale_temporaries(target.parent) == []  # held: left alone
    assert temporary.exists()
    release.set()
    writer.join()
    assert not errors and torch.load(target) == {"step": 7}
    stale = target.parent / ".last.ckpt.zzzzzzzz.partial.tmp"
    stale.write_bytes(b"partial")  # nobody holds it: a killed writer's
    assert checkpointing.remove_stale_temporaries(target.parent) == [stale]


# ---------------------------------------------------------------- SIGTERM


def test_sigterm_stops_fit_with_status_143_and_names_its_last_checkpoint(tmp_path: Path) -> None:
    config = yaml.safe_load(fit.DEFAULT_RECIPE.read_text())
    config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(config))
    args = ["fit", "--config", "recipe.yaml", *TINY, *CSV]
    run = start([*args, "--trainer.max_steps", "100000"], tmp_path)
    deadline = time.monotonic() + 240
    while (last := next(tmp_path.glob("outputs/**/version_0/checkpoints/last.ckpt"), None)) is None:
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    last = Path(os.path.realpath(last))  # as ModelCheckpoint names it
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 143, (out + err)[-3000:]
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]  # the command's last word
    assert line.startswith("lightning-sparse: "), err[-3000:]
    assert "fit stopped by SIGTERM at step " in line and "(exit status 143)" in line
    assert f"its last checkpoint is {str(last)!r}" in line
    assert "the same command with --ckpt_path last resumes from it" in line
    step = torch.load(last, weights_only=False)["global_step"]
    assert step >= 2 and step % 2 == 0


def test_resuming_another_algorithms_run_is_one_line_before_anything_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A static run resumed with the RigL recipe: refused before the weights are loaded."""
    static = str(REPO / "recipes" / "static_llama.yaml")
    cli.main(["fit", "--config", static, *TINY, *CSV, "--trainer.max_steps", "2"])
    ckpt = next(Path("outputs").rglob("last.ckpt"))
    capsys.readouterr()
    loaded = []
    monkeypatch.setattr(fit.SparseCLI, "instantiate_classes", _recording(loaded))
    line = one_line_failure(
        ["fit", *TINY, *CSV, "--trainer.max_steps", "4", "--ckpt_path", str(ckpt)], capsys
    )
    assert "sparsity state of Static but none of RigL" in line and str(ckpt) in line, line
    (module,) = loaded
    assert not any(name.endswith("_mask") for name, _ in module.named_buffers())  # not applied


def _recording(loaded: list[Any]) -> Any:
    """`SparseCLI.instantiate_classes` that also records the LightningModule it built."""
    original = fit.SparseCLI.instantiate_classes

    def instantiate(self: fit.SparseCLI) -> None:
        original(self)
        loaded.append(self.model)

    return instantiate


@pytest.mark.parametrize("version", [(3, 10, 12), sys.version_info])
def test_config_error_note_on_every_supported_python(
    version: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`note_key` marks a configuration error on Python 3.10 too (requires-python), which has no
    ``BaseException.add_note``: the note goes into ``__notes__``, where `short_error` finds it."""
    from lightning_sparse.app import errors

    monkeypatch.setattr(sys, "version_info", version)
    err = ValueError("sparsity=1.5 must be in [0, 1)")
    errors.note_key(err, Namespace())
    assert [n for n in err.__notes__ if n.startswith(errors.CONFIG_ERROR_NOTE)]
    assert "sparsity=1.5" in errors.short_error(err)


def test_a_precision_plugin_whose_package_is_missing_is_a_short_error(tmp_path: Path) -> None:
    """Lightning's own refusals while the Trainer is built (here: the precision plugin's package
    is not installed) are a few lines, not a traceback, and train nothing."""
    pytest.importorskip("lightning")
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed: the precision is accepted")
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", *TINY, *CSV, "--trainer.precision", "transformer-engine"])
    message = str(info.value.code)
    assert message.startswith("lightning-sparse: configuration error")
    assert "ModuleNotFoundError: Requirement 'transformer_engine" in message
    assert "Traceback" not in message and len(message.splitlines()) == 3
    assert list(tmp_path.glob("outputs/**/version_*")) == []


@pytest.mark.parametrize(
    "recipe",
    [[], ["--config", str(REPO / "recipes" / "rigl_llama_3b_wse.yaml")]],
    ids=["default", "built-sparse"],
)
def test_a_precision_the_device_refuses_is_one_line(
    recipe: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The device's refusal comes during fit (the sparsity callback asks it first): one line,
    nothing trained, no run folder left; a model built sparse (still on the meta device when
    the refusal comes) ends the same way, not with Lightning failing to move it."""
    small = ["--model.n_heads", "4", "--model.ffn_hidden", "64"] if recipe else []
    line = one_line_failure(
        ["fit", *recipe, *TINY, *small, *CSV, "--trainer.accelerator", "wse",
         "--trainer.precision", "bf16-mixed"],
        capsys,
    )  # fmt: skip
    assert "accelerator='wse' does not support precision='bf16-mixed'" in line
    assert line.endswith("; nothing was trained")
    assert list(tmp_path.glob("outputs/**/version_*")) == []


# ---------------------------------------------------------------- the data the settings select
DATA_MISTAKES = {
    # windows the model cannot see: refused before anything trains
    "seq_len": (
        ["--data.seq_len", "64"],
        "lightning-sparse: --data.seq_len=64 is longer than the model's context, "
        "--model.max_seq_len=32: every window must fit it; lower --data.seq_len or raise "
        "--model.max_seq_len",
    ),
    # one file: the split by path hash leaves one side empty
    "one file": (
        ["--data.paths", "[one.py]"],
        "left the validation split empty; pass more files, change val_every, or name validation "
        "files with val_paths= (on the command line: --data.paths, --data.val_every, "
        "--data.val_paths)",
    ),
    # a directory without a file of the pattern
    "no match": (
        ["--data.paths", "[texts/]"],
        "lightning-sparse: data: no files matching '*.py' under directory 'texts'; name files or "
        "directories that hold some, or change pattern= (on the command line: --data.paths, "
        "--data.pattern)",
    ),
}


@pytest.mark.parametrize("kind", list(DATA_MISTAKES))
def test_data_settings_that_give_no_data_are_one_line_naming_the_flags(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Found while the data are read (in ``setup``, inside ``fit``) or when the model and the
    data meet: still one line with the ``--data.*`` flags to change, exit 2, no traceback, and
    no run directory left behind (these once printed a 45-line traceback)."""
    (tmp_path / "one.py").write_text("x = 1\n" * 2000)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts/notes.txt").write_text("no python here\n")
    flags, expected = DATA_MISTAKES[kind]
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", *TINY, *CSV, "--trainer.max_steps", "2", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("lightning-sparse: ")
    assert expected in err.strip().splitlines()[-1]
    assert list(tmp_path.glob("outputs/**/version_*")) == []


def test_resuming_with_another_optimizer_is_one_line_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A run trained with ``--optimizer SGD`` (one parameter group) resumed with the recipe's
    AdamW (two groups): torch refuses the optimizer state after the weights loaded; the command
    says so in one line with the fix (it printed a 70-line traceback)."""
    steps = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
    cli.main(["fit", *TINY, *CSV, *steps, "--optimizer", "SGD", "--optimizer.lr", "0.1"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", *TINY, *CSV, "--trainer.max_steps", "4", "--ckpt_path", "last"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lightning-sparse: --ckpt_path ") and last.endswith(
        "the checkpoint's optimizer state does not fit this run's optimizer (loaded state dict "
        "has a different number of parameter groups); resume with the optimizer the run trained "
        "with (--config <run>/config.yaml, the config it saved), or start a new run from its "
        "weights with the LoadWeights callback (docs/workflows.md); nothing was trained"
    )
