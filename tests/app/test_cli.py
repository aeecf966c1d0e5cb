"""The `lightning-sparse` command: argument handling, W&B mode, atomic checkpoints, resume after
a kill (bit-identical to an uninterrupted run), DDP from the same recipe, and ``compare``.

Subprocess runs use one thread each (``OMP_NUM_THREADS=1``), W&B offline and CSV logs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_sparse.app import cli, compare
from lightning_sparse.lightning.checkpointing import AtomicCheckpointIO

REPO = Path(__file__).resolve().parents[2]
CSV = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
TINY = [
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
        "PYTHONPATH": str(REPO),  # tests.test_cli.SlowCommitCheckpointIO, for the subprocesses
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
    assert cli.build_args([]) == ["fit", "--config", str(cli.DEFAULT_RECIPE)]
    assert cli.build_args(["fit", "--trainer.max_steps", "5"])[:3] == [
        "fit",
        "--config",
        str(cli.DEFAULT_RECIPE),
    ]
    assert cli.build_args(["validate"])[1:3] == ["--config", str(cli.DEFAULT_RECIPE)]
    own = ["fit", "--config", "mine.yaml"]
    assert cli.build_args(own) == own and cli.build_args(["fit", "-c", "x.yaml"]) == [
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


def test_wandb_is_online_only_with_an_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    assert cli.wandb_mode() == "offline"
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine example.org login x password y\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert cli.wandb_mode() == "offline"
    netrc_file.write_text("machine api.wandb.ai login user password k3y\n")
    assert cli.wandb_mode() == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert cli.wandb_mode() == "offline"  # the key is for another host
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert cli.wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert cli.wandb_mode() == "disabled"  # the user's choice wins


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
    config = yaml.safe_load((cli.RECIPES_DIR / "rigl_llama.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=40, val_check_interval=10, log_every_n_steps=5)
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
    return torch.load(run_dir / "outputs/rigl_llama/checkpoints/last.ckpt", weights_only=False)


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
    ckpts = chain / "outputs/rigl_llama/checkpoints"
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
    masks = [k for k in a["state_dict"] if k.endswith("_mask")]
    assert len(masks) == 14  # 7 linear layers x 2 blocks
    for key, value in a["state_dict"].items():  # weights and masks, bit for bit
        assert torch.equal(value, b["state_dict"][key]), key
    for sa, sb in zip(
        a["optimizer_states"][0]["state"].values(),
        b["optimizer_states"][0]["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert (
        a["callbacks"]["RigL"]["last_update_step"]
        == b["callbacks"]["RigL"]["last_update_step"]
        == 33
    )
    assert (
        a["loops"]["fit_loop"]["state_dict"] == b["loops"]["fit_loop"]["state_dict"]
    )  # data position
    sa, sb = (
        json.loads(next(d.glob("outputs/rigl_llama/version_*/summary.json")).read_text())
        for d in (straight, chain)
    )
    assert sa["tokens"] == sb["tokens"] and sa["flops"] == sb["flops"]  # counters survive the kills


# ---------------------------------------------------------------- DDP and compare


def test_ddp_two_processes_from_the_same_recipe(tmp_path: Path) -> None:
    args = ["fit", "--config", str(cli.DEFAULT_RECIPE), *TINY, *CSV]
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
        if line.startswith("| dense") or line.startswith("| static")
    ]
    assert (
        len(rows) == 2
        and rows[0].split("|")[3].strip() == "0.0%"
        and rows[1].split("|")[3].strip() == "80.0%"
    )
    assert "| 1.00x |" in rows[0] and rows[0] in printed
    svg = (out / "val_loss.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and ">static<" in svg
    runs = json.loads((out / "comparison.json").read_text())
    assert [len(r["summary"]["val_curve"]) for r in runs] == [4, 4]  # validation every step
    compare.main(args)  # finished runs are read back, not trained again
    assert capsys.readouterr().out.count("reusing the finished run") == 2
