"""W&B and the other loggers: every sparsity callback's settings go into the run config
(`sparsity_hparams`), the run summary into the W&B run summary (`flat_summary`). W&B runs
offline under ``tmp_path``; the values are read back from the offline run's ``run-*.wandb`` file
(wandb >= 0.19 writes ``config.yaml`` and ``wandb-summary.json`` only for online runs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_sparse import SET, Group, RigL, Static
from lightning_sparse.lightning.summary import SparseRunSummary
from tests.helpers import TinyLM, token_loader, trainer


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
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def offline_run(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, summary) of the one offline run under ``tmp_path/wandb``, as W&B would show."""
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for record in wandb_records(run):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                summary[key] = json.loads(item.value_json)
    return config, summary


def test_wandb_run_config_and_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rigl = RigL(0.75, update={"freq": 2}, drop_fraction=0.25, param_filter="*fc1.weight", seed=3)
    static = Static(0.5, param_filter="*fc2.weight", init_method="topk")
    summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    logger = WandbLogger(save_dir=str(tmp_path), project="test", offline=True)
    t = trainer(tmp_path, max_steps=4, logger=logger, callbacks=[rigl, static, summary])
    t.fit(TinyLM(), token_loader())
    wandb.finish()

    config, run_summary = offline_run(tmp_path)
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
