"""W&B and the other loggers: every sparsity callback's settings go into the run config
(`sparsity_hparams`), the run summary into the W&B run summary (`flat_summary`). W&B runs
offline under ``tmp_path``; the values are read back from the offline run's ``run-*.wandb`` file
(wandb >= 0.19 writes ``config.yaml`` and ``wandb-summary.json`` only for online runs)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_sparse import SET, Group, RigL, Static

# Optional packages (the GPU image has neither): W&B itself, and the command's jsonargparse.
pytest.importorskip("wandb")
pytest.importorskip("jsonargparse")
from lightning_sparse.app import compare, compare_runs  # noqa: E402
from lightning_sparse.lightning.summary import SparseRunSummary  # noqa: E402
from tests.helpers import TinyLM, token_loader, trainer  # noqa: E402


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf ``Record``s of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version),
    then the LevelDB log format (32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/
    LAST)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        kind = data[pos + 6] if left >= 7 else 0
        if kind == 0:  # block trailer or zero padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        if pos + 7 + length > len(data):
            return  # still being written
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def offline_run(tmp_path: Path, history: list | None = None) -> tuple[dict, dict]:
    """(config, summary) of the one offline run under ``tmp_path/wandb``, as W&B would show;
    the logged rows are appended to ``history``."""
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B's service writes the file on its own; finish() can return before the last records
    # (the exit record closes the file) are written.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        records = list(wandb_records(run))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"{run} has no exit record after 30 s")
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # wandb.init(config=...) comes with the run record
            updates = (record.run.config if kind == "run" else record.config).update
            config.update({i.key: json.loads(i.value_json) for i in updates})
        elif kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                summary[key] = json.loads(item.value_json)
        elif kind == "history" and history is not None:
            row: dict[str, Any] = {}
            for item in record.history.item:
                *parents, last = [item.key] if item.key else list(item.nested_key)
                node = row
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[last] = json.loads(item.value_json)
            history.append(row)
    return config, summary


def test_wandb_run_config_and_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # What `compare` sets for each run it starts (`compare_runs.child_env`): W&B groups by it.
    monkeypatch.setenv("WANDB_RUN_GROUP", "rigl")
    monkeypatch.setenv("WANDB_JOB_TYPE", "fit")
    # W&B reads WANDB_* variables once per process, at its first set-up (compare's runs are
    # fresh processes); an earlier test's run in this process would hide these.
    import wandb

    wandb.teardown()
    rigl = RigL(0.75, update={"freq": 2}, drop_fraction=0.25, param_filter="*fc1.weight", seed=3)
    static = Static(0.5, param_filter="*fc2.weight", init_method="topk")
    summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    logger = WandbLogger(save_dir=str(tmp_path), project="test", offline=True)
    t = trainer(tmp_path, max_steps=4, logger=logger, callbacks=[rigl, static, summary])
    t.fit(TinyLM(), token_loader())
    logger.experiment.finish()

    config, run_summary = offline_run(tmp_path)
    assert run_group(tmp_path) == ("rigl", "fit")
    assert config["sparsity/0/algorithm"] == "rigl"
    assert config["sparsity/0/sparsity"] == 0.75
    assert config["sparsity/0/drop_fraction"] == 0.25
    assert config["sparsity/0/update"] == repr(rigl.update_schedule)
    assert config["sparsity/0/seed"] == 3
    assert config["sparsity/0/params"] == 1
    assert config["sparsity/0/param_filter"] == "glob_filter(['*fc1.weight'])"
    assert config["sparsity/1/algorithm"] == "static"
    assert config["sparsity/1/sparsity"] == 0.5
    assert config["sparsity/1/init_method"] == "topk"
    assert "sparsity/1/drop_fraction" not in config
    assert config["lr"] == 1e-2  # the module's own hyper-parameters are still there

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert run_summary["summary/steps"] == 4
    assert run_summary["summary/algorithms"] == "RigL+Static"
    assert run_summary["summary/flops/train"] == pytest.approx(saved["flops"]["train"], rel=1e-12)
    assert run_summary["summary/tokens"] == saved["tokens"] > 0
    fc1 = run_summary["summary/sparsity/layers/net.fc1.weight"]
    assert fc1 == pytest.approx(0.75, abs=1 / 960)
    assert run_summary["summary/sparsity/layers/net.fc2.weight"] == pytest.approx(0.5, abs=1e-3)
    assert run_summary["summary/stages"].startswith("sparse ")
    assert not any(k.endswith("_curve") for k in run_summary)


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_group_hparams_reach_csv_and_tensorboard(tmp_path: Path, kind: str) -> None:
    if kind == "tensorboard":
        pytest.importorskip("tensorboard")
        logger = TensorBoardLogger(tmp_path, name="tb")
    else:
        logger = CSVLogger(tmp_path, name="csv")
    group = Group({"*fc1.weight": SET(0.6, update={"freq": 3}), "*fc2.weight": Static(0.3)})
    t = trainer(tmp_path, max_steps=2, log_every_n_steps=1, logger=logger, callbacks=[group])
    t.fit(TinyLM(), token_loader())
    # The metrics the callbacks log are still written next to the hyper-parameters.
    if kind == "csv":
        header = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()[0]
        assert "sparsity/actual" in header

    hparams = yaml.safe_load(Path(logger.log_dir, "hparams.yaml").read_text())
    assert hparams["sparsity/algorithm"] == "group"
    assert hparams["sparsity/members"] == 2
    assert hparams["sparsity/0/algorithm"] == "set"
    assert hparams["sparsity/0/sparsity"] == 0.6
    assert hparams["sparsity/0/param_filter"] == "glob_filter(['*fc1.weight'])"
    assert hparams["sparsity/0/params"] == 1
    assert hparams["sparsity/1/algorithm"] == "static"
    assert hparams["sparsity/1/sparsity"] == 0.3
    assert hparams["lr"] == 1e-2


def _finished_run(
    out: Path, name: str, seed: int, loss: float, sparsity: float, flops: float
) -> None:
    """A run `compare` reuses as finished: ``run.json`` with its command, ``summary.json``,
    and the offline W&B run its logger left (a directory only: `compare` resumes it)."""
    run_dir = out / name / f"seed_{seed}"
    wandb_dir = run_dir / f"outputs/{name}_llama/wandb"
    (wandb_dir / f"offline-run-20261123_000000-{name}{seed}").mkdir(parents=True)
    summary_path = run_dir / "summary.json"
    command = compare_runs.fit_command(compare.resolve_recipe(name), summary_path, seed, None, [])
    record = {"name": name, "seed": seed, "command": command, "process_time_s": 1.0}
    (run_dir / "run.json").write_text(json.dumps(record))
    summary = {
        "algorithms": [name], "wall_time_s": 1.0,
        "val": {"loss": loss, "ppl": 2.0 ** loss}, "val_curve": [[1, loss + 1], [2, loss]],
        "sparsity": {"sparse_layers": sparsity},
        "flops": {"train": flops, "train_dense": 4e9, "inference_per_token": flops / 1e6,
                  "inference_per_token_dense": 4e3},
    }  # fmt: skip
    summary_path.write_text(json.dumps(summary))


def run_group(log_dir: Path) -> tuple[str, str]:
    """(group, job type) of the one offline run under ``log_dir/wandb``."""
    (run,) = (log_dir / "wandb").glob("offline-run-*/run-*.wandb")
    (record,) = [r for r in wandb_records(run) if r.WhichOneof("record_type") == "run"]
    return record.run.run_group, record.run.job_type


def test_compare_logs_seeds_intervals_and_groups_to_wandb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cmp"
    losses = {"static": (4.0, 4.2), "rigl": (3.75, 3.85)}
    for name, pair in losses.items():
        for seed, loss in enumerate(pair):
            _finished_run(out, name, seed, loss, 0.8, 1e9)
    args = ["--recipes", "static", "rigl", "--seeds", "2", "--out", str(out)]
    compare.main(args)

    # The comparison run: every method's figures; rigl - static paired by seed: d = -0.25, -0.35,
    # mean -0.3, sd 0.1 / sqrt(2), half width t(0.975, 1) * sd / sqrt(2) = 12.706205 * 0.05.
    history: list[dict[str, Any]] = []
    config, summary = offline_run(out, history)
    assert config["recipes"] == ["static", "rigl"] and config["seeds"] == [0, 1]
    assert summary["rigl/val_loss"] == pytest.approx(3.8)
    assert summary["rigl/val_loss_vs_static"] == pytest.approx(-0.3)
    half = 12.706205 * 0.05
    assert summary["rigl/val_loss_vs_static_ci95_low"] == pytest.approx(-0.3 - half, abs=1e-6)
    assert summary["rigl/val_loss_vs_static_ci95_high"] == pytest.approx(-0.3 + half, abs=1e-6)
    assert summary["static/val_loss_ci95_high"] == pytest.approx(4.1 + 12.706205 * 0.1, abs=1e-6)
    assert "static/val_loss_vs_static" not in summary and summary["rigl/seeds"] == 2
    (row,) = [h for h in history if "val_loss" in h]
    assert row["val_loss"]["_type"] == "html-file" and row["comparison"]["_type"] == "table-file"
    (files,) = out.glob("wandb/offline-run-*/files")
    html = (files / row["val_loss"]["path"]).read_text()
    assert html.count("<polyline") == 2 and html.count("<polygon") == 2 and ">rigl<" in html
    assert (out / "val_loss.svg").read_text() in html
    table = json.loads((files / row["comparison"]["path"]).read_text())
    assert [r[0] for r in table["data"]] == ["static", "rigl"]
    chart = row["val_loss_chart_table"]  # W&B's line chart of the means: its data table
    points = json.loads((files / chart["path"]).read_text())
    assert sorted(map(tuple, points["data"]))[:2] == [(1, "rigl", 4.8), (1, "static", 5.1)]

    # Every training run: resumed in its group, its method's figures in its summary.
    for name, pair in losses.items():
        for seed in range(2):
            log_dir = out / name / f"seed_{seed}/outputs/{name}_llama"
            assert run_group(log_dir) == (name, "fit")
            _, run_summary = offline_run(log_dir)
            assert run_summary["compare/val_loss"] == pytest.approx(sum(pair) / 2)
            assert run_summary["compare/seed"] == seed and run_summary["compare/method"] == name
            assert ("compare/val_loss_vs_static" in run_summary) == (name == "rigl")
            assert run_summary["compare/val_loss_ci95_low"] < run_summary["compare/val_loss"]
    printed = capsys.readouterr().out
    assert f"wandb sync {files.parent.relative_to(tmp_path)}" in printed
    assert "wandb sync cmp/rigl/seed_1/outputs/rigl_llama/wandb/offline-run-" in printed
    # Run again: the summaries already hold these figures, so no run is resumed twice.
    compare.main(args)
    assert "0 run summaries given" in capsys.readouterr().out
    assert len(list(out.glob("*/seed_*/outputs/*/wandb/offline-run-*/run-*.wandb"))) == 4


def test_compare_without_wandb_runs_starts_no_wandb_run(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    _finished_run(out, "dense", 0, 3.5, 0.0, 4e9)
    for found in out.rglob("wandb"):
        found.rename(found.with_name("csv"))  # the run logged to CSV only
    compare.main(["--recipes", "dense", "--out", str(out)])
    assert (out / "val_loss.svg").is_file() and not (out / "wandb").exists()
