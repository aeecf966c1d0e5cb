"""The `lightning-sparse` command: argument handling, help and short configuration errors, W&B
mode, one directory per run, atomic checkpoints, resume after a kill (bit-identical to an
uninterrupted run), DDP from the same recipe, and ``compare``.

Subprocess runs use one thread each (``OMP_NUM_THREADS=1``), W&B offline and CSV logs.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from jsonargparse import Namespace

from lightning_sparse.app import cli, common, compare, fit, quiet, run_dirs
from lightning_sparse.app.wandb_mode import wandb_mode
from lightning_sparse.core.state_dict import checkpoint_masks
from lightning_sparse.lightning.checkpointing import AtomicCheckpointIO
from tests.helpers import assert_state_equal, repo_pythonpath

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
def _offline_single_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inherited by the runs `compare` starts.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        # tests.app.test_cli.SlowCommitCheckpointIO, for subprocesses
        "PYTHONPATH": repo_pythonpath(),
        "COLUMNS": "80",  # --help wraps at the terminal width
    }


def lightning_sparse(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_sparse.app.cli", *args],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 120) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]
    return output


# ---------------------------------------------------------------- arguments and dispatch


def test_no_arguments_fit_the_default_recipe() -> None:
    assert fit.build_args([]) == ["fit", "--config", str(fit.DEFAULT_RECIPE)]
    assert fit.build_args(["fit", "--trainer.max_steps", "5"])[:3] == [
        "fit",
        "--config",
        str(fit.DEFAULT_RECIPE),
    ]
    assert fit.build_args(["validate"])[1:3] == ["--config", str(fit.DEFAULT_RECIPE)]
    # Options without a subcommand are fit's (LightningCLI's parser exits on them otherwise),
    # and the subcommand after LightningCLI's own leading options is kept: it alone is built.
    assert fit.build_args(["--trainer.max_steps", "3"])[:4] == [
        "fit",
        "--config",
        str(fit.DEFAULT_RECIPE),
        "--trainer.max_steps",
    ]
    assert fit.subcommand_of(["-c", "all.yaml", "test", "--ckpt_path", "x"]) == "test"
    assert fit.subcommand_of(["--print_config"]) is None
    own = ["fit", "--config", "mine.yaml"]
    assert fit.build_args(own) == own and fit.build_args(["fit", "-c", "x.yaml"]) == [
        "fit",
        "-c",
        "x.yaml",
    ]


def test_compare_and_sweep_are_dispatched_before_lightning_cli(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(compare, "main", lambda args: seen.append(("compare", args)))
    fake_sweep = type(sys)("lightning_sparse.app.sweep")
    fake_sweep.main = lambda args: seen.append(("sweep", args))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning_sparse.app.sweep", fake_sweep)
    monkeypatch.setattr("lightning_sparse.app.sweep", fake_sweep, raising=False)
    cli.main(["compare", "--steps", "3"])
    cli.main(["sweep", "a", "--b"])
    assert seen == [("compare", ["--steps", "3"]), ("sweep", ["a", "--b"])]
    with pytest.raises(SystemExit, match="unknown subcommand 'fitt'.*compare"):
        cli.main(["fitt"])


def test_a_subcommand_is_a_line_in_the_table_and_a_module_with_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for subcommand in common.SUBCOMMANDS:  # every entry names a module that has main(args)
        assert callable(subcommand.main()), subcommand
    assert [common.subcommand_for(a).name for a in ([], ["--config", "x.yaml"], ["test"])] == [
        "fit",
        "fit",
        "test",
    ]
    assert common.subcommand_for(["nope"]) is None
    # A new subcommand: its module and one Subcommand line.
    module = type(sys)("lightning_sparse.app.hello")
    module.main = lambda args: print(f"hello {args}")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning_sparse.app.hello", module)
    hello = common.Subcommand("hello", "hello", "say hello (hello --help)")
    monkeypatch.setattr(common, "SUBCOMMANDS", (*common.SUBCOMMANDS, hello))
    cli.main(["hello", "--name", "x"])
    assert capsys.readouterr().out == "hello ['--name', 'x']\n"
    with pytest.raises(SystemExit, match="hello .say hello: lightning-sparse hello --help"):
        cli.main(["helo"])


def test_names_imported_from_cli_before_the_split_still_resolve() -> None:
    from lightning_sparse import lightning, recipes
    from lightning_sparse.app import quiet as quiet_module
    from lightning_sparse.app import wandb_mode as wandb_module

    homes = {
        common: ("DEBUG_ENV", "LIGHTNING_SUBCOMMANDS", "SUBCOMMAND_HELP"),
        fit: ("DEFAULT_RECIPE", "SparseCLI", "build_args", "run"),
        run_dirs: ("RunDir", "RUN_ENV", "plan_run_dir"),
        quiet_module: ("quiet", "drop_zero_flops", "plain_model_summary"),
        wandb_module: ("wandb_mode",),
        recipes: ("RECIPES_DIR",),
        lightning: ("ModelZooSparsity", "SparseRunSummary"),
    }
    for home, names in homes.items():
        for name in names:
            assert getattr(cli, name) is getattr(home, name), name
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        cli.nope  # noqa: B018


def test_wandb_is_online_only_with_an_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    assert wandb_mode() == "offline"
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine example.org login x password y\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_mode() == "offline"
    netrc_file.write_text("machine api.wandb.ai login user password k3y\n")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode() == "offline"  # the key is for another host
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"  # the user's choice wins


# ---------------------------------------------------------------- help and errors


def test_help_lists_every_subcommand_on_one_line_and_no_wandb_status(tmp_path: Path) -> None:
    no_account = {k: v for k, v in env().items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    no_account["NETRC"] = str(tmp_path / "missing")  # W&B would be offline, and says so on runs
    command = [sys.executable, "-m", "lightning_sparse.app.cli", "--help"]
    done = subprocess.run(command, env=no_account, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    lines = output.splitlines()
    for name in (*common.LIGHTNING_SUBCOMMANDS, "compare", "sweep"):
        (line,) = [i for i, line in enumerate(lines) if line.split()[:1] == [name]]
        assert lines[line].split(maxsplit=1)[1] == common.SUBCOMMAND_HELP[name]
        following = "".join(lines[line + 1 : line + 2]).split()[:1]
        assert following in ([], *([n] for n in common.SUBCOMMAND_HELP))  # not a wrapped help
    assert not any(line.startswith("W&B") for line in lines)


def test_fit_help_names_the_default_recipe(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--help"])
    assert info.value.code == 0
    printed = capsys.readouterr().out.replace("\n", " ")
    assert "the default recipe, recipes/rigl_llama.yaml" in printed


def test_abbreviated_options_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--trainer.max_step", "10"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    expected = "error: unrecognized arguments: --trainer.max_step 10; did you mean "
    assert expected + "'--trainer.max_steps'?" in lines
    assert len(lines) <= 4  # a one-line usage, not the ~50 lines of every option
    for main, args in (
        (compare.main, ["--step", "3"]),
        (cli.main, ["sweep", "s.yaml", "--coun", "2"]),
    ):
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2
        assert "unrecognized arguments: --" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        (
            ["--trainer.callbacks.init_args.sparsity", "1.5"],
            "trainer.callbacks[2].init_args.sparsity (lightning_sparse.RigL)",
            "ValueError: sparsity=1.5 must be in [0, 1)",
        ),
        (
            ["--model.dim", "30"],
            "model.init_args.dim (lightning_sparse.models.LitCausalLM)",
            "ValueError: dim=30 must be divisible by n_heads=4",
        ),
    ],
)
def test_configuration_errors_are_a_few_lines(
    override: list[str], key: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(common.DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", *TINY, *CSV, *override])
    lines = str(info.value.code).splitlines()
    assert len(lines) == 3
    assert lines[0] == f"lightning-sparse: configuration error in {key}:"
    assert lines[1].strip().startswith(message)
    assert common.DEBUG_ENV in lines[2] and "--debug" in lines[2]
    assert not list(tmp_path.glob("outputs/**/checkpoints"))
    # The full traceback (the exception itself) behind the debug flag or variable.
    with pytest.raises(ValueError, match=re.escape(message.split(": ", 1)[1])):
        cli.main(["fit", *TINY, *CSV, *override, "--debug"])
    monkeypatch.setenv(common.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match=re.escape(message.split(": ", 1)[1])):
        cli.main(["fit", *TINY, *CSV, *override])


def test_zero_flops_column_is_dropped_and_parameter_counts_stay() -> None:
    table = "\n".join(
        [
            "  | Name  | Type   | Params | Mode  | FLOPs",
            "--------------------------------------------",
            "0 | model | Llama  | 29.8 K | train | 0    ",
            "--------------------------------------------",
            "29.8 K    Trainable params",
            "0         Total Flops",
        ]
    )
    assert quiet.drop_zero_flops(table).splitlines() == [
        "  | Name  | Type   | Params | Mode",
        "------------------------------------",
        "0 | model | Llama  | 29.8 K | train",
        "------------------------------------",
        "29.8 K    Trainable params",
    ]
    counted = table.replace("| 0    ", "| 1.2 K").replace("0         Total", "1.2 K     Total")
    assert quiet.drop_zero_flops(counted) == counted  # FLOPs that were counted stay


# ---------------------------------------------------------------- one directory per run

NOISE = (
    "💡 Tip",  # Lightning's litlogger / litmodels advertisements
    "The anonymous setting has no effect",  # W&B, for Lightning's anonymous=None
    "isinstance(treespec, LeafSpec)",  # Lightning's pytree use on newer torch
    "Total Flops",  # the model summary's FLOPs, 0 without example_input_array
)


def test_each_run_has_its_own_directory_and_last_resumes_the_newest(tmp_path: Path) -> None:
    args = ["fit", *TINY[:-2], "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
    first = finish(lightning_sparse(*args, cwd=tmp_path))  # the default recipe: W&B, offline
    finish(lightning_sparse(*args, cwd=tmp_path))
    root = tmp_path / "outputs/rigl_llama"
    runs = sorted(p.name for p in root.iterdir())
    assert runs == ["version_0", "version_1"]
    for run in runs:  # each with its own summary, checkpoint, config and W&B files
        assert json.loads((root / run / "summary.json").read_text())["steps"] == 2
        assert (root / run / "checkpoints/last.ckpt").is_file()
        assert (root / run / "config.yaml").is_file() and (root / run / "wandb").is_dir()
    assert "lightning-sparse: this run writes to outputs/rigl_llama/version_0" in first
    assert "summary saved to outputs/rigl_llama/version_0/summary.json" in first
    assert "Total params" in first  # the model summary stays
    saved = yaml.safe_load((root / "version_0/config.yaml").read_text())["trainer"]
    assert saved["logger"]["init_args"]["save_dir"] == "outputs/rigl_llama"  # as given: a run
    assert saved["callbacks"][0]["init_args"]["dirpath"] == "outputs/rigl_llama/checkpoints"
    for noise in NOISE:
        assert noise not in first, noise

    v0 = (root / "version_0/summary.json").read_text()
    resumed = finish(
        lightning_sparse(*args, "--trainer.max_steps", "3", "--ckpt_path", "last", cwd=tmp_path)
    )
    last = "outputs/rigl_llama/version_1/checkpoints/last.ckpt"
    expected = (
        f"lightning-sparse: resuming the latest run, outputs/rigl_llama/version_1, from {last}"
    )
    assert expected in resumed.splitlines()
    assert sorted(p.name for p in root.iterdir()) == runs  # continued in place
    assert json.loads((root / "version_1/summary.json").read_text())["steps"] == 3
    assert (root / "version_0/summary.json").read_text() == v0  # the finished run stays


def test_explicit_logger_version_keeps_its_directory(tmp_path: Path) -> None:
    """The chained Variable SPDF recipes name their directories (``version: sparse``)."""
    config = Namespace(
        trainer=Namespace(
            logger=Namespace(
                class_path="lightning.pytorch.loggers.CSVLogger",
                init_args=Namespace(save_dir=str(tmp_path), name="", version="sparse"),
            ),
            callbacks=[],
        ),
        ckpt_path=None,
    )
    assert run_dirs.plan_run_dir(config) is None
    config.trainer.logger.init_args.version = None
    (tmp_path / "version_4").mkdir()
    run = run_dirs.plan_run_dir(config)
    assert run is not None and run.path == tmp_path / "version_5"
    assert config.trainer.logger.init_args.version == 5


# ---------------------------------------------------------------- atomic checkpoint writes


class SlowCommitCheckpointIO(AtomicCheckpointIO):
    """Sleeps between writing the temporary file and renaming it: a window to kill the writer."""

    def __init__(self, delay: float = 0.25) -> None:
        super().__init__()
        self.delay = delay

    def commit(self, temporary: Path, target: Path) -> None:
        time.sleep(self.delay)
        super().commit(temporary, target)


class FailingCommitIO(AtomicCheckpointIO):
    def commit(self, temporary: Path, target: Path) -> None:
        raise KeyboardInterrupt  # as if killed after the write, before the rename


def test_atomic_writer_never_exposes_a_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "ckpts" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, target)
    with pytest.raises(KeyboardInterrupt):
        FailingCommitIO().save_checkpoint({"step": 2}, target)
    assert torch.load(target) == {"step": 1}  # the old checkpoint, whole
    assert len(list(target.parent.glob(".last.ckpt.*.tmp"))) == 1  # the interrupted write
    AtomicCheckpointIO().save_checkpoint({"step": 3}, target)
    assert torch.load(target) == {"step": 3}
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # stale temporary removed


# ---------------------------------------------------------------- resume after kill


def resume_recipe(tmp_path: Path, slow: bool) -> str:
    """The RigL recipe, tiny: 40 steps over 31-batch epochs, masks updated every 3 steps,
    a checkpoint every 4 steps."""
    config = yaml.safe_load(fit.DEFAULT_RECIPE.read_text())
    trainer = config["trainer"]
    trainer.update(accelerator="cpu", max_steps=40, val_check_interval=10, log_every_n_steps=5)
    trainer["enable_progress_bar"] = trainer["enable_model_summary"] = False
    trainer["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "outputs/rigl_llama", "name": ""},
    }
    if slow:
        trainer["plugins"] = [{"class_path": "tests.app.test_cli.SlowCommitCheckpointIO"}]
    checkpoint, rigl = trainer["callbacks"][0]["init_args"], trainer["callbacks"][-1]["init_args"]
    rigl.update(update={"freq": 3, "stop": 36}, drop_fraction=0.3)
    checkpoint["every_n_train_steps"] = 4
    config["model"]["init_args"].update(dim=32, n_layers=2, max_seq_len=16)
    config["data"]["init_args"].update(seq_len=16, batch_size=4, max_bytes=2000, val_windows=2)
    path = tmp_path / ("slow.yaml" if slow else "recipe.yaml")
    path.write_text(yaml.safe_dump(config))
    return str(path)


def load_last(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "outputs/rigl_llama/version_0/checkpoints/last.ckpt"  # every run: version_0
    return torch.load(path, weights_only=False)


def wait_for(condition: Any, process: subprocess.Popen, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_killed_runs_resume_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    straight, chain = tmp_path / "straight", tmp_path / "chain"
    straight.mkdir(), chain.mkdir()
    uninterrupted = lightning_sparse(
        "fit", "--config", resume_recipe(tmp_path, slow=False), cwd=straight
    )
    slow = resume_recipe(tmp_path, slow=True)
    ckpts = chain / "outputs/rigl_llama/version_0/checkpoints"
    last = ckpts / "last.ckpt"

    # 1. Killed while writing its second checkpoint: last.ckpt stays the first, whole.
    run = lightning_sparse("fit", "--config", slow, cwd=chain)
    wait_for(lambda: last.is_file() and any(ckpts.glob(".last.ckpt.*.tmp")), run, "a second write")
    kill(run)
    assert any(ckpts.glob(".last.ckpt.*.tmp"))  # the kill hit the write
    assert load_last(chain)["global_step"] == 4

    # 2. Resumed, then killed at a random moment after its first new checkpoint.
    mtime = last.stat().st_mtime_ns
    run = lightning_sparse("fit", "--config", slow, "--ckpt_path", "last", cwd=chain)
    wait_for(lambda: last.stat().st_mtime_ns != mtime, run, "a new checkpoint")
    time.sleep(random.uniform(0.0, 0.4))
    killed_early = run.poll() is not None
    kill(run)
    step = load_last(chain)["global_step"]
    assert 8 <= step <= 40 and not killed_early

    # 3. Resumed again, to the end.
    finish(lightning_sparse("fit", "--config", slow, "--ckpt_path", "last", cwd=chain))
    finish(uninterrupted)

    a, b = load_last(straight), load_last(chain)
    assert a["global_step"] == b["global_step"] == 40
    assert a["state_dict"].keys() == b["state_dict"].keys()
    masks = checkpoint_masks(a)
    assert len(masks) == 14  # 7 linear layers x 2 blocks
    assert_state_equal(masks, checkpoint_masks(b))  # masks, bit for bit
    for key, value in a["state_dict"].items():  # weights, bit for bit
        assert torch.equal(value, b["state_dict"][key]), key
    for sa, sb in zip(
        a["optimizer_states"][0]["state"].values(),
        b["optimizer_states"][0]["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert (
        a["sparsity"]["RigL"]["last_update_step"] == b["sparsity"]["RigL"]["last_update_step"] == 33
    )
    assert (
        a["loops"]["fit_loop"]["state_dict"] == b["loops"]["fit_loop"]["state_dict"]
    )  # data position
    assert [p.name for p in (chain / "outputs/rigl_llama").iterdir()] == ["version_0"]
    sa, sb = (
        json.loads((d / "outputs/rigl_llama/version_0/summary.json").read_text())
        for d in (straight, chain)
    )
    assert sa["tokens"] == sb["tokens"] and sa["flops"] == sb["flops"]  # counters survive the kills


# ---------------------------------------------------------------- DDP and compare


def test_ddp_two_processes_from_the_same_recipe(tmp_path: Path) -> None:
    args = ["fit", "--config", str(fit.DEFAULT_RECIPE), *TINY, *CSV]
    args += [
        "--trainer.devices",
        "2",
        "--trainer.max_steps",
        "3",
        "--trainer.val_check_interval",
        "3",
    ]
    output = finish(lightning_sparse(*args, cwd=tmp_path))
    assert "distributed_backend=gloo" in output and "All distributed processes registered" in output
    summary = json.loads(next(tmp_path.glob("outputs/rigl_llama/**/summary.json")).read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["tokens"] == 3 * 4 * 32 * 2  # both ranks' batches
    assert summary["sparsity"]["sparse_layers"] == pytest.approx(0.8, abs=2e-3)


def test_compare_tabulates_and_plots_two_recipes(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cmp"
    args = ["--recipes", "dense", "static", "--steps", "4", "--out", str(out), "--", *TINY, *CSV]
    compare.main(args)
    printed = capsys.readouterr().out
    table = (out / "comparison.md").read_text()
    rows = [
        line
        for line in table.splitlines()
        if (line.startswith("| dense") or line.startswith("| static")) and line.count("|") > 5
    ]  # the main table (the per-seed table below it has the losses only)
    assert (
        len(rows) == 2
        and rows[0].split("|")[3].strip() == "0.0%"
        and rows[1].split("|")[3].strip() == "80.0%"
    )
    assert "| 1.00x |" in rows[0] and rows[0] in printed
    svg = (out / "val_loss.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and ">static<" in svg
    assert "<polygon" not in svg  # one seed: no band
    runs = json.loads((out / "comparison.json").read_text())["runs"]
    assert [len(r["summary"]["val_curve"]) for r in runs] == [4, 4]  # validation every step
    compare.main(args)  # finished runs are read back, not trained again
    assert capsys.readouterr().out.count("reusing the finished run") == 2


def test_compare_lists_wandb_sync_paths_that_work_from_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline = tmp_path / "cmp/rigl/outputs/rigl_llama/version_0/wandb/offline-run-20261123_1-ab"
    offline.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    (command,) = compare.wandb_sync_commands([Path("cmp/rigl"), Path("cmp/dense")])
    assert command == f"wandb sync {offline.relative_to(tmp_path)}"
    assert (tmp_path / command.removeprefix("wandb sync ")).is_dir()
    # The W&B logger's directory is absolute, so W&B's own `wandb sync` line works anywhere.
    config = Namespace(
        trainer=Namespace(
            logger=Namespace(
                class_path="lightning.pytorch.loggers.WandbLogger",
                init_args=Namespace(save_dir="outputs/rigl_llama"),
            ),
            callbacks=None,
        ),
        ckpt_path=None,
    )
    run_dirs.plan_run_dir(config)
    save_dir = Path(config.trainer.logger.init_args.save_dir)
    assert save_dir == tmp_path / "outputs/rigl_llama/version_0"


def test_rich_model_summary_becomes_the_plain_one_without_flops() -> None:
    """With ``rich`` installed Lightning picks RichModelSummary, whose table always has a FLOPs
    column (0 here); the CLI swaps it for the plain summary, which `drop_zero_flops` filters."""
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    callbacks = [RichModelSummary(max_depth=3)]
    quiet.plain_model_summary(callbacks)
    assert type(callbacks[0]) is ModelSummary and callbacks[0]._max_depth == 3


def test_fast_dev_run_promises_a_summary_only_where_one_is_printed() -> None:
    """``fit`` prints its summary under ``fast_dev_run``; ``validate`` / ``test`` / ``predict``
    have none, so their line does not mention one."""
    from jsonargparse import Namespace

    from lightning_sparse.app.config_edits import edit_for_run

    def said(subcommand: str) -> str:
        config = Namespace(trainer=Namespace(fast_dev_run=True, callbacks=[], logger=True))
        return " ".join(edit_for_run(config, subcommand, logger_asked=False))

    assert "fast_dev_run" in said("fit") and "the summary is printed, not saved" in said("fit")
    for subcommand in ("validate", "test", "predict"):
        assert "fast_dev_run" in said(subcommand) and "summary" not in said(subcommand)
