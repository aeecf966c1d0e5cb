"""`lightning-sparse` as a Lightning user meets it (issue 34), through the real entry point in
subprocesses: every subcommand in ``--help`` works on the recipes, every Lightning flag works or
is refused in one line, mistakes are one line with a suggestion, runs never share files, files
get the user's umask, and ``--help`` loads neither torch nor Lightning.

One tiny ``fit`` (module fixture ``trained``) serves the evaluation and export tests; runs that
do not depend on each other are started together (`run_all`). Subprocesses run one torch thread
each with W&B offline.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_sparse.app import compare_runs, parse_errors
from tests.helpers import repo_pythonpath

REPO = Path(__file__).resolve().parents[2]
CSV = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
SMALL = [
    *("--trainer.accelerator", "cpu"),
    *("--model.dim", "32", "--model.n_layers", "1", "--model.max_seq_len", "32"),
    *("--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"),
    *("--data.val_windows", "4", "--data.test_windows", "4"),
    *("--trainer.enable_model_summary", "false"),
]
QUIET = ["--trainer.enable_progress_bar", "false"]
STEPS = ["--trainer.max_steps", "4", "--trainer.val_check_interval", "4"]
THREADS_LINE = " torch thread(s) ("  # the line every run starts with, on stderr
CKPT = "outputs/rigl_llama/version_0/checkpoints/last.ckpt"


def start(args: list[str], cwd: Path, umask: int | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "PYTHONPATH": repo_pythonpath(),
        "COLUMNS": "100",
    }
    env.pop("LIGHTNING_SPARSE_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_sparse.app.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=None if umask is None else (lambda: os.umask(umask)),
    )


def run_all(*commands: tuple[list[str], Path]) -> list[tuple[int, str, str]]:
    """Run the commands at once; (exit status, stdout, stderr) of each, in order."""
    processes = [start(args, cwd) for args, cwd in commands]
    outputs = [p.communicate(timeout=300) for p in processes]
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]


def errors_of(stderr: str) -> list[str]:
    """stderr without the thread-count line (a diagnostic every run prints first)."""
    return [line for line in stderr.strip().splitlines() if THREADS_LINE not in line]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The default recipe, tiny, with a CSV logger and the progress bar on, under umask 027:
    (working directory, stdout + stderr)."""
    cwd = tmp_path_factory.mktemp("trained")
    process = start(["fit", *SMALL, *CSV, *STEPS], cwd, umask=0o027)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, (out + err)[-3000:]
    return cwd, out + err


# ---------------------------------------------------------------- 1. every subcommand works


def test_fit_writes_one_run_directory_with_the_users_umask(trained: tuple[Path, str]) -> None:
    cwd, output = trained
    run = cwd / "outputs/rigl_llama/version_0"
    assert sorted(p.name for p in (cwd / "outputs/rigl_llama").iterdir()) == ["version_0"]
    assert (run / "metrics.csv").is_file()  # not outputs/rigl_llama/rigl_llama/version_0
    for path in (run / "checkpoints/last.ckpt", run / "summary.json"):
        assert path.stat().st_mode & 0o777 == 0o640, path  # umask 027, atomic write or not
    # The bar of a step-limited run has no epoch total, and its last frame precedes the summary.
    assert "Epoch 0/-2" not in output
    lines = output.splitlines()
    summary = next(i for i, line in enumerate(lines) if "lightning-sparse run summary" in line)
    assert not any(line.lstrip().startswith("Epoch 0") for line in lines[summary:])


def test_validate_test_predict_report_into_the_run_they_evaluate(
    trained: tuple[Path, str],
) -> None:
    cwd, _ = trained
    run = cwd / "outputs/rigl_llama/version_0"
    subcommands = ("validate", "test", "predict")
    # The recipe's W&B logger, as a user leaves it: no W&B run is started for an evaluation.
    done = run_all(*(([s, *SMALL, *QUIET, "--ckpt_path", "last"], cwd) for s in subcommands))
    for subcommand, (code, out, err) in zip(subcommands, done, strict=True):
        assert code == 0, (out + err)[-3000:]
        said = out + err
        folder = f"outputs/rigl_llama/version_0/{subcommand}_0"
        assert (
            f"lightning-sparse: {subcommand} of the checkpoint {CKPT}; writing to {folder}" in said
        )
        assert (
            f"lightning-sparse: {subcommand} logs to CSV in its folder and starts no W&B run "
            "(--trainer.logger WandbLogger for one)" in said
        )
        assert "dirpath has changed" not in said and "Be aware that when using" not in said
        assert not (run / f"{subcommand}_0" / "wandb").exists()
    assert sorted(p.name for p in (cwd / "outputs/rigl_llama").iterdir()) == ["version_0"]
    for subcommand, prefix in (("validate", "val"), ("test", "test")):
        results = json.loads((run / f"{subcommand}_0/results.json").read_text())
        assert results["subcommand"] == subcommand and results["ckpt_path"] == CKPT
        metrics = results["metrics"]
        assert sorted(metrics) == [f"{prefix}/loss", f"{prefix}/ppl"]
        assert metrics[f"{prefix}/ppl"] == pytest.approx(math.exp(metrics[f"{prefix}/loss"]))
    summary = json.loads((run / "summary.json").read_text())
    validated = json.loads((run / "validate_0/results.json").read_text())["metrics"]
    assert validated["val/loss"] == pytest.approx(summary["val"]["loss"], rel=1e-5)
    tested = json.loads((run / "test_0/results.json").read_text())["metrics"]
    assert tested["test/loss"] != validated["val/loss"]  # other windows of the held-out files
    rows = [json.loads(line) for line in (run / "predict_0/predictions.jsonl").open()]
    assert len(rows) == 8  # predict_prompts
    assert all(isinstance(r["prompt"], str) and isinstance(r["continuation"], str) for r in rows)
    assert (
        "8 predictions saved to outputs/rigl_llama/version_0/predict_0/predictions.jsonl"
        in (done[2][1])
    )


def test_evaluating_a_runs_checkpoint_without_config_uses_the_runs_own_config(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    """``validate --ckpt_path <a run's checkpoint>`` with no ``--config`` evaluates the model the
    run trained (its ``config.yaml``: here a 32-wide model the default recipe does not build), not
    the default recipe's; ``--ckpt_path last`` with no run refuses in one line, evaluating
    nothing (it used to evaluate a freshly initialised model and exit 0)."""
    cwd, _ = trained
    run = cwd / "outputs/rigl_llama/version_0"
    (empty := tmp_path / "empty").mkdir()
    (own, nothing) = run_all(
        (["validate", *QUIET, "--ckpt_path", CKPT], cwd),
        (["test", *QUIET, "--ckpt_path", "last"], empty),
    )
    code, out, err = own
    assert code == 0, (out + err)[-3000:]
    assert (
        "lightning-sparse: no --config: using the run's own, "
        "outputs/rigl_llama/version_0/config.yaml" in err
    )
    folder = max(run.glob("validate_*"), key=lambda p: int(p.name.split("_")[1]))
    assert f"writing to outputs/rigl_llama/version_0/{folder.name}" in err
    validated = json.loads((folder / "results.json").read_text())["metrics"]
    summary = json.loads((run / "summary.json").read_text())
    assert validated["val/loss"] == pytest.approx(summary["val"]["loss"], rel=1e-5)
    code, out, err = nothing
    assert code == 2, (out + err)[-3000:]
    assert errors_of(err)[-1] == (
        "lightning-sparse: --ckpt_path last: no run under outputs/rigl_llama has a last*.ckpt, "
        "so there is nothing to test; train one first (lightning-sparse fit with the same "
        "--config), or pass --ckpt_path path/to/file.ckpt"
    )
    assert "Traceback" not in err
    assert not (empty / "outputs").exists() or not any((empty / "outputs").rglob("*.json"))


def test_export_follows_the_umask_and_names_its_flags(trained: tuple[Path, str]) -> None:
    pytest.importorskip("transformers")
    cwd, _ = trained
    args = ["export", "--ckpt_path", CKPT, "--output", "hf"]
    first = start(args, cwd, umask=0o027)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, (out + err)[-3000:]
    assert (cwd / "hf/model.safetensors").stat().st_mode & 0o777 == 0o640
    ((code, out, err),) = run_all((args, cwd))
    assert code == 1
    assert err.strip() == (
        "lightning-sparse export: --output 'hf' already exists; choose a new directory or pass "
        "--overwrite (which replaces only an export written by lightning_sparse)"
    )


# ---------------------------------------------------------------- 2. Lightning flags


def test_no_logger_and_fast_dev_run(tmp_path: Path) -> None:
    (tmp_path / "off").mkdir(), (tmp_path / "dev").mkdir()
    (off, dev) = run_all(
        (["fit", *SMALL, *QUIET, *STEPS, "--trainer.logger", "false"], tmp_path / "off"),
        (["fit", *SMALL, *QUIET, "--trainer.fast_dev_run", "true"], tmp_path / "dev"),
    )
    code, out, err = off
    assert code == 0, (out + err)[-3000:]
    assert (
        "lightning-sparse: no logger (--trainer.logger false): left out DeviceStatsMonitor (it "
        "needs a logger)" in err
    )
    run = tmp_path / "off/outputs/rigl_llama/version_0"
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert (run / "checkpoints/last.ckpt").is_file()
    assert "summary saved to outputs/rigl_llama/version_0/summary.json" in out
    code, out, err = dev
    assert code == 0, (out + err)[-3000:]
    assert "summary not saved (fast_dev_run; --summary.path saves it)" in out
    assert list((tmp_path / "dev").iterdir()) == []  # no summary.json, no outputs/, no last.ckpt


def test_print_config_round_trips_through_config(tmp_path: Path) -> None:
    ((code, printed, err),) = run_all((["fit", "--print_config"], tmp_path))
    assert code == 0, err[-3000:]
    assert "lightning-sparse:" not in printed  # diagnostics go to stderr
    assert yaml.safe_load(printed)["trainer"]["max_steps"] == 2400
    (tmp_path / "c.yaml").write_text(printed)
    ((code, again, err),) = run_all((["fit", "--config", "c.yaml", "--print_config"], tmp_path))
    assert code == 0, err[-3000:]
    assert again == printed


# ---------------------------------------------------------------- 3. mistakes: one line


def test_mistakes_are_one_line_with_a_suggestion(tmp_path: Path) -> None:
    recipe = yaml.safe_load((REPO / "recipes/rigl_llama.yaml").read_text())
    recipe["trainer"]["callbacks"][-1]["init_args"]["drop_fractoin"] = 0.3
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    done = run_all(
        (["fit", "--config", "typo.yaml"], tmp_path),
        (["fit", "--trainer.callbacks+=lightning_sparse.Rigl"], tmp_path),
        (["fit", *SMALL, "--ckpt_path", "notes.txt"], tmp_path),
    )
    expected = [
        "error: trainer.callbacks: lightning_sparse.RigL takes no argument 'drop_fractoin'; did "
        "you mean 'drop_fraction'? (its arguments: lightning-sparse fit --trainer.callbacks.help "
        "lightning_sparse.RigL)",
        "error: trainer.callbacks: class_path 'lightning_sparse.Rigl' names no class "
        "(lightning_sparse has no 'Rigl'); did you mean 'lightning_sparse.RigL'?",
        "lightning-sparse: checkpoint 'notes.txt' (--ckpt_path) is not a checkpoint: torch.load "
        "cannot read it (text, another format, or a truncated file); pass a checkpoint written "
        "by fit (e.g. outputs/<recipe>/version_N/checkpoints/last.ckpt)",
    ]
    for (code, out, err), line in zip(done, expected, strict=True):
        assert code == 2, (out + err)[-3000:]
        lines = errors_of(err)
        assert lines[-1] == line
        assert len(lines) <= 3 and "Traceback" not in err and "weights_only" not in err
    assert not (tmp_path / "outputs").exists()


# jsonargparse 4.53's messages (as ``ArgumentParser.error`` receives them), shortened.
UNION = """Parser key "{key}":
  Does not validate against any of the Union subtypes
  Subtypes: [{subtypes}]
  Errors:
{errors}
  Given value type: <class 'dict'>
  Given value: {{'class_path': 'x'}}"""


def _union(key: str, subtypes: str, errors: str) -> str:
    return UNION.format(key=key, subtypes=subtypes, errors=errors)


SHORTENED = {
    "module typo": (
        _union(
            "model",
            "<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>",
            "    - Problem with given class_path 'lightning_sparse.modles.LitCausalLM':\n"
            "        module 'lightning_sparse' has no attribute 'modles'\n"
            "    - Expected a <class 'NoneType'>",
        ),
        "model: class_path 'lightning_sparse.modles.LitCausalLM' names no class "
        "(lightning_sparse has no 'modles'); did you mean 'lightning_sparse.models.LitCausalLM'?",
    ),
    "model argument": (
        _union(
            "model",
            "<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>",
            "    - Problem with given class_path 'lightning_sparse.models.LitCausalLM':\n"
            "        Option 'dimm' is not accepted\n"
            "    - Expected a <class 'NoneType'>",
        ),
        "model: lightning_sparse.models.LitCausalLM takes no argument 'dimm'; did you mean "
        "'dim'? (its arguments: lightning-sparse fit --model.help "
        "lightning_sparse.models.LitCausalLM)",
    ),
    "nested type": (
        _union(
            "model",
            "<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>",
            "    - Problem with given class_path 'lightning_sparse.models.LitCausalLM':\n"
            '        Parser key "dim":\n'
            "          Expected a <class 'int'>. Got value: abc\n"
            "    - Expected a <class 'NoneType'>",
        ),
        "model.init_args.dim (lightning_sparse.models.LitCausalLM): expected int, got 'abc'",
    ),
    "literal": (
        _union(
            "trainer.precision",
            "typing.Literal[64, 32, 16], typing.Literal['16-mixed', 'bf16-mixed'], "
            "<class 'NoneType'>",
            "    - Expected a typing.Literal[64, 32, 16]\n    - Expected a <class 'NoneType'>",
        ).replace("{'class_path': 'x'}", "bf16-mixd"),
        "trainer.precision: 'bf16-mixd' is not accepted; did you mean 'bf16-mixed'? (accepted: "
        "64, 32, 16, 16-mixed, bf16-mixed, null)",
    ),
    "yaml key": (
        "Subcommand 'fit' does not accept option 'trainr.logger.init_args.save_dir'",
        "Subcommand 'fit' does not accept option 'trainr.logger.init_args.save_dir'; did you "
        "mean 'trainer.logger.init_args.save_dir'?",
    ),
    "unknown form": ("something else entirely", "something else entirely"),
}


@pytest.mark.parametrize("case", list(SHORTENED))
def test_parse_errors_are_shortened(case: str) -> None:
    message, expected = SHORTENED[case]
    options = ["trainer.logger", "--trainer.logger", "trainer.max_steps", "model", "data"]
    assert parse_errors.shorten(message, options, "lightning-sparse fit") == expected


# ---------------------------------------------------------------- 4. runs never share files


def test_a_run_that_fails_leaves_no_version_folder(tmp_path: Path) -> None:
    ((code, out, err),) = run_all(
        (["fit", *SMALL, *QUIET, *CSV, "--data.paths", "[nope]"], tmp_path)
    )
    assert code == 1, (out + err)[-3000:]
    assert errors_of(err)[-1] == "lightning-sparse: text data path 'nope' does not exist"
    assert list((tmp_path / "outputs/rigl_llama").iterdir()) == []  # version_0 given back


def test_compare_says_the_threads_its_runs_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_SPARSE_THREADS", "1")
    assert compare_runs.run_threads(1) == (1, "LIGHTNING_SPARSE_THREADS=1")
    monkeypatch.delenv("LIGHTNING_SPARSE_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert compare_runs.run_threads(2) == (3, "OMP_NUM_THREADS=3")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(compare_runs, "available_cores", lambda: 4)
    assert compare_runs.run_threads(2) == (2, "4 core(s) / 2")


# ---------------------------------------------------------------- 6. start-up

HELP_IMPORTS = """
import sys
from lightning_sparse.app.cli import main
texts = {}
for args in (["--help"], ["compare", "--help"], ["sweep", "--help"], ["export", "--help"],
             ["generate", "--help"]):
    try:
        main(args)
    except SystemExit as stop:
        assert stop.code in (0, None), (args, stop.code)
heavy = sorted(m for m in ("torch", "lightning", "wandb", "transformers") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_help_loads_neither_torch_nor_lightning() -> None:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-c", HELP_IMPORTS], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "HEAVY []"
    assert "usage: lightning-sparse [subcommand] [options]" in done.stdout
    compare_help = done.stdout.replace("\n", " ")
    assert "95% intervals" in compare_help and "95%%" not in compare_help


def test_startup_benchmark_prints_its_table(tmp_path: Path) -> None:
    script = REPO / "benchmarks/bench_cli_startup.py"
    done = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "--only", "help,compare"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("  ")[0]: line for line in done.stdout.splitlines()}
    assert "lightning-sparse --help" in rows and "lightning-sparse compare --help" in rows
    assert "CPU " in done.stdout and "goal: lightning-sparse --help <= 3 s: " in done.stdout
