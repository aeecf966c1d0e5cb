"""`SparseRunSummary` tells what ran: the sparsity stages, which validation key it read (or why
there is none). Asserts on the printed lines and the JSON values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_sparse import GMP, Static
from lightning_sparse.lightning import VariableSPDF
from lightning_sparse.lightning.summary import SparseRunSummary
from tests.helpers import TinyLM, token_loader, trainer


class ValLM(TinyLM):
    """`TinyLM` that logs its validation loss under ``key``."""

    def __init__(self, key: str = "val_loss") -> None:
        super().__init__()
        self.key = key

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        self.log(self.key, loss)


def _fit(tmp_path: Path, module: TinyLM, callbacks: list, **kwargs: object) -> SparseRunSummary:
    summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    options = {"max_steps": 6, "limit_val_batches": 1, "num_sanity_val_steps": 0, **kwargs}
    t = trainer(tmp_path, callbacks=[*callbacks, summary], **options)
    t.fit(module, token_loader(), token_loader(n=8) if isinstance(module, ValLM) else None)
    return summary


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def test_variable_spdf_stages_and_algorithm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _fit(tmp_path, TinyLM(), [Static(0.75), VariableSPDF(4, verbose=False)])
    out = capsys.readouterr().out
    assert _line(out, "stages:") == "stages: sparse 75.0% for steps 0-4, then dense for steps 4-6"
    assert "algorithms Static" in _line(out, "steps 6")  # not "dense" after the switch
    assert _line(out, "sparsity at the end:").startswith("sparsity at the end: no masked layers")
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["algorithms"] == ["Static"]
    stages = saved["stages"]
    assert [(s["kind"], s["steps"]) for s in stages] == [("sparse", [0, 4]), ("dense", [4, 6])]
    assert stages[0]["sparsity"] == pytest.approx([0.75, 0.75], abs=1e-3)
    assert stages[1]["sparsity"] is None


def test_a_ramp_is_one_stage_from_first_to_last_sparsity(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    gmp = GMP(
        sparsity={"type": "cubic", "init": 0.0, "final": 0.5, "begin": 0, "end": 4},
        update={"freq": 2},
    )
    summary = _fit(tmp_path, TinyLM(), [gmp])
    (stage,) = summary.summary["stages"]  # type: ignore[index]
    assert stage["kind"] == "sparse" and stage["steps"] == [0, 6]
    assert stage["sparsity"][0] < stage["sparsity"][1] == pytest.approx(0.5, abs=1e-2)
    assert " -> 50.0% for steps 0-6" in _line(capsys.readouterr().out, "stages:")


@pytest.mark.parametrize("key", ["val_loss", "val/loss"])
def test_validation_found_under_common_keys(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    summary = _fit(tmp_path, ValLM(key), [], val_check_interval=3, check_val_every_n_epoch=None)
    val = summary.summary["val"]  # type: ignore[index]
    assert val["key"] == key and val["step"] == 6 and val["runs"] == 2 and val["note"] is None
    assert _line(capsys.readouterr().out, "validation").startswith(
        f"validation at step 6 ({key!r}): loss {val['loss']:.4f} nats/token"
    )


def test_validation_key_of_the_checkpoint_monitor(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/nll", save_top_k=1)
    summary = _fit(
        tmp_path,
        ValLM("val/nll"),
        [checkpoint],
        val_check_interval=3,
        check_val_every_n_epoch=None,
        enable_checkpointing=True,
    )
    val = summary.summary["val"]  # type: ignore[index]
    assert val["looked_for"] == ["val/nll", "val/loss", "val_loss"] and val["key"] == "val/nll"


def test_validation_that_did_not_run_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    summary = _fit(
        tmp_path, ValLM(), [], max_steps=5, val_check_interval=200, check_val_every_n_epoch=None
    )
    assert summary.summary["val"]["loss"] is None  # type: ignore[index]
    assert _line(capsys.readouterr().out, "validation") == (
        "validation: no 'val/loss' or 'val_loss' logged (validation did not run: "
        "val_check_interval 200 > 5 steps; lower --trainer.val_check_interval)"
    )


def test_validation_under_another_key_names_the_keys_logged(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _fit(tmp_path, ValLM("val/nll"), [], val_check_interval=3, check_val_every_n_epoch=None)
    assert _line(capsys.readouterr().out, "validation") == (
        "validation: no 'val/loss' or 'val_loss' logged (validation ran 2 times and logged "
        "'val/nll'; set --summary.monitor to the validation loss key)"
    )
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["val"]["runs"] == 2 and saved["val"]["looked_for"] == ["val/loss", "val_loss"]


def test_stages_survive_a_resume(tmp_path: Path) -> None:
    first = SparseRunSummary(path=str(tmp_path / "a.json"))
    first.stages = [{"kind": "sparse", "steps": [0, 4], "sparsity": [0.75, 0.75]}]
    first.algorithm_names = {"Static"}
    second = SparseRunSummary()
    second.load_state_dict(first.state_dict())
    assert second.stages == first.stages and second.algorithm_names == {"Static"}
