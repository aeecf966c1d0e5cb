"""Recipes: each trains (tiny, a few steps); they are twins; bad recipes fail before training;
ModelZoo sparsity blocks, a plain LightningModule and the Hugging Face path.

Runs are in-process (`lightning_sparse.app.cli.run`) in a temporary working directory, so the
recipes' relative ``outputs/`` paths land there. W&B is forced offline.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from torch import nn

from lightning_sparse.app import cli
from lightning_sparse.core.flops import FlopReport, transformer_flops
from lightning_sparse.lightning.callback import SparsityCallback
from tests.helpers import MODELZOO_FIXTURES, one_torch_thread

RECIPES = cli.RECIPES_DIR
NAMES = ("dense", "static", "set", "rigl", "granet")
MODELZOO_RIGL = MODELZOO_FIXTURES / "v2.10" / "params_gpt3_125m_rigl75.yaml"
# A tiny model and corpus; the recipes' own schedules (updates every 50 steps) stay as written.
TINY = [
    *("--trainer.accelerator", "cpu"),  # the recipes say auto: the GPU where there is one
    *("--model.dim", "32", "--model.n_layers", "1", "--model.max_seq_len", "32"),
    *("--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"),
    *("--data.val_windows", "4", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2"),
    *("--trainer.log_every_n_steps", "2", "--trainer.enable_progress_bar", "false"),
    *("--trainer.enable_model_summary", "false"),
]
CSV = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]


@pytest.fixture(autouse=True)
def _offline_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    with one_torch_thread():
        yield


def recipe(name: str) -> Path:
    return RECIPES / f"{name}_llama.yaml"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load(recipe(name).read_text())


def write(tmp_path: Path, config: dict[str, Any], name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def summary_of(cli_obj: cli.SparseCLI) -> dict[str, Any]:
    callback = next(c for c in cli_obj.trainer.callbacks if isinstance(c, cli.SparseRunSummary))
    assert callback.summary is not None
    return callback.summary


def sparsity_callbacks(cli_obj: cli.SparseCLI) -> list[SparsityCallback]:
    return [c for c in cli_obj.trainer.callbacks if isinstance(c, SparsityCallback)]


# ---------------------------------------------------------------- every recipe trains


@pytest.mark.parametrize("name", NAMES)
def test_recipe_trains_tiny_and_summarises(name: str, tmp_path: Path) -> None:
    logger = [] if name == "rigl" else CSV  # the default recipe keeps its W&B logger (offline)
    run = cli.run(["fit", "--config", str(recipe(name)), *TINY, *logger])
    assert run.trainer.global_step == 4
    if name == "rigl":  # the W&B run ended with the call: the next in-process run is a new one
        assert sys.modules["wandb"].run is None
    summary = summary_of(run)
    saved = json.loads(Path(run.trainer.log_dir, "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))  # the JSON is what was printed
    assert summary["val"]["step"] == 4 and math.isfinite(summary["val"]["loss"])
    assert summary["val"]["ppl"] == pytest.approx(math.exp(summary["val"]["loss"]), rel=1e-5)
    assert [s for s, _ in summary["val_curve"]] == [2, 4]
    assert summary["tokens"] == 4 * 4 * 32
    layers = summary["sparsity"]["layers"]
    flops = summary["flops"]
    kind = "dense" if name == "dense" else "sparse"
    assert [(s["kind"], s["steps"]) for s in summary["stages"]] == [(kind, [0, 4])]
    assert summary["val"]["key"] == "val/loss"
    if name == "dense":
        assert layers == {} and summary["algorithms"] == ["dense"]
        assert flops["train"] == flops["train_dense"]
        return
    # The decoder's 7 linear layers are sparse; embeddings, norms and the head stay dense.
    assert sorted(n.rsplit(".", 2)[-2] for n in layers) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    expected = 0.5 if name == "granet" else 0.8  # GraNet starts at 50% (first update at 100)
    assert summary["sparsity"]["sparse_layers"] == pytest.approx(expected, abs=2e-3)
    assert flops["train"] < flops["train_dense"]
    assert flops["inference_per_token"] < flops["inference_per_token_dense"]
    # One directory per run: checkpoints, summary and config side by side.
    checkpoints = Path(run.trainer.checkpoint_callback.dirpath)
    assert checkpoints.name == "checkpoints" and checkpoints.parent.name == "version_0"
    assert (checkpoints / "last.ckpt").is_file()
    assert checkpoints.parent.resolve() == Path(run.trainer.log_dir).resolve()


def test_dynamic_recipes_update_masks_when_updates_fall_in_the_run() -> None:
    """SET / RigL / GraNet with the update cadence shrunk to the tiny run, from the command
    line: the sparsity callback is the recipes' last, so ``trainer.callbacks.init_args`` is it."""
    for name in ("set", "rigl", "granet"):
        cadence = ["--trainer.callbacks.init_args.update", "{freq: 2, stop: 6}"]
        cadence += ["--trainer.callbacks.init_args.drop_fraction", "0.3"]
        if name == "granet":
            cubic = "{type: cubic, init: 0.5, final: 0.8, begin: 0, end: 2}"
            cadence += ["--trainer.callbacks.init_args.sparsity", cubic]
        run = cli.run(["fit", "--config", str(recipe(name)), *TINY, *CSV, *cadence])
        (algorithm,) = sparsity_callbacks(run)
        assert algorithm.step == 4 and algorithm.last_update  # updated at step 2
        summary = summary_of(run)
        assert summary["sparsity"]["sparse_layers"] == pytest.approx(0.8, abs=2e-3)
        # RigL and GraNet pay dense weight gradients on their update step; SET does not.
        expected_steps = 0 if name == "set" else 1
        assert summary["flops"]["dense_grad_steps"] == expected_steps
        # Against the config arithmetic of transformer_flops: 4 batches of 4 x 32 tokens, the
        # first three at the initial sparsity (GraNet: 50%), the last after the update at step 2.
        first = 0.5 if name == "granet" else 0.8
        f0, f1 = flops_at(first), flops_at(0.8)
        train = 3 * 128 * (3 * f0.forward_flops_per_token + f1.forward_flops_per_token)
        extra = 0 if name == "set" else 128 * f0.dense_grad_flops_per_token
        assert summary["flops"]["train"] == pytest.approx(train + extra, rel=1e-3)
        assert summary["flops"]["dense_grad_extra"] == pytest.approx(extra, rel=1e-3)
        assert summary["flops"]["train_dense"] == 4 * 3 * 128 * f0.dense_forward_flops_per_token


def flops_at(sparsity: float) -> FlopReport:
    """The TINY Llama (dim 32, 1 layer, 4 heads, SwiGLU 96, vocab 256, 32 tokens), by config."""
    return transformer_flops(1, 32, 4, 32, 256, 96, "swiglu", sparsity=sparsity)


def test_recipes_are_twins() -> None:
    """Same model, data, steps and trainer; outputs under outputs/<recipe>; dynamic ones share
    the mask-update cadence and drop fraction."""
    configs = {name: load(name) for name in NAMES}
    base = configs["rigl"]
    for name, config in configs.items():
        stem = f"{name}_llama"
        assert config["model"] == base["model"] and config["data"] == base["data"]
        assert config["seed_everything"] == base["seed_everything"]
        trainer = {k: v for k, v in config["trainer"].items() if k not in ("logger", "callbacks")}
        assert trainer == {
            k: v for k, v in base["trainer"].items() if k not in ("logger", "callbacks")
        }
        assert config["trainer"]["logger"]["init_args"]["save_dir"] == f"outputs/{stem}"
        by_class = {c["class_path"].rsplit(".", 1)[-1]: c for c in config["trainer"]["callbacks"]}
        assert by_class["ModelCheckpoint"]["init_args"]["dirpath"] == f"outputs/{stem}/checkpoints"
        assert "DeviceStatsMonitor" in by_class
        sparse = [
            c["init_args"]
            for c in config["trainer"]["callbacks"]
            if "sparsity" in c.get("init_args", {})
        ]
        assert len(sparse) == (0 if name == "dense" else 1)
        if sparse:  # last, so that --trainer.callbacks.init_args.<arg> overrides it
            assert sparse[0] is config["trainer"]["callbacks"][-1]["init_args"]
            assert sparse[0]["param_filter"] == ["*layers.*_proj.weight"]
        if sparse:  # seed 000: random masks, the same sparsity in every matrix ("uniformly")
            assert (sparse[0]["init_method"], sparse[0]["distribution"]) == ("random", "uniform")
        if name in ("set", "granet"):
            rigl = base["trainer"]["callbacks"][-1]["init_args"]
            assert sparse[0]["update"] == rigl["update"]
            assert sparse[0]["drop_fraction"] == rigl["drop_fraction"]
    # Seed 000's dynamic runs: drop fraction 0.5 with a cosine to 0 at 75% of training, when the
    # mask updates stop (every 100 steps: RigL's dT).
    rigl = base["trainer"]["callbacks"][-1]["init_args"]
    stop = 0.75 * base["trainer"]["max_steps"]
    assert rigl["drop_fraction"] == {"type": "cosine", "init": 0.5, "half_period": stop}
    assert rigl["update"] == {"freq": 100, "stop": stop}
    granet = configs["granet"]["trainer"]["callbacks"][-1]["init_args"]["sparsity"]
    assert granet == {"type": "cubic", "init": 0.5, "final": 0.8, "begin": 0, "end": 1200}


# ---------------------------------------------------------------- invalid recipes


def test_unknown_key_fails_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = load("rigl")
    config["trainer"]["max_step"] = 5
    with pytest.raises(SystemExit):
        cli.run(["fit", "--config", write(tmp_path, config)])
    assert "trainer.max_step" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()


def test_bad_sparsity_raises_our_error_before_training(tmp_path: Path) -> None:
    config = load("rigl")
    config["trainer"]["callbacks"][-1]["init_args"]["sparsity"] = 1.5
    with pytest.raises(ValueError, match=r"sparsity=1\.5 must be in \[0, 1\)") as info:
        cli.run(["fit", "--config", write(tmp_path, config), *TINY, *CSV])
    assert any("before any training step" in note for note in info.value.__notes__)
    assert not list(tmp_path.glob("outputs/**/checkpoints"))


def test_bad_modelzoo_key_raises_before_training(tmp_path: Path) -> None:
    config = load("dense")
    config["trainer"]["callbacks"].insert(
        0,
        {
            "class_path": "lightning_sparse.ModelZooSparsity",
            "init_args": {"sparsity": {"algorithm": "rigl", "sparsity": 0.8, "drop_fractoin": 0.3}},
        },
    )
    with pytest.raises(ValueError, match=r"does not take \['drop_fractoin'\]"):
        cli.run(["fit", "--config", write(tmp_path, config), *TINY, *CSV])


# ---------------------------------------------------------------- ModelZoo blocks, unchanged


def modelzoo_block() -> dict[str, Any]:
    return yaml.safe_load(MODELZOO_RIGL.read_text())["trainer"]["init"]["sparsity"]


def test_modelzoo_block_in_a_recipe(tmp_path: Path) -> None:
    """The ModelZoo file's block pasted into the dense twin, with this package's layer names."""
    block = copy.deepcopy(modelzoo_block())
    block["param_filter"] = ["*layers.*_proj.weight"]  # the GPT-3 names do not exist in Llama
    config = load("dense")
    config["trainer"]["callbacks"].insert(
        0, {"class_path": "lightning_sparse.ModelZooSparsity", "init_args": {"sparsity": block}}
    )
    run = cli.run(["fit", "--config", write(tmp_path, config), *TINY, *CSV])
    (group,) = sparsity_callbacks(run)
    assert isinstance(group, cli.ModelZooSparsity) and type(group[0]).__name__ == "RigL"
    assert group[0].update_schedule.freq == 100 and group[0].drop_fraction.half_period == 3584
    assert summary_of(run)["sparsity"]["sparse_layers"] == pytest.approx(0.75, abs=2e-3)
    assert len(summary_of(run)["sparsity"]["layers"]) == 7


class ModelZooNamedLM(pl.LightningModule):
    """A plain LightningModule (its own data) with ModelZoo GPT parameter names."""

    def __init__(self, dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embedding_layer = nn.Embedding(vocab, dim)
        self.proj_q_dense_layer = nn.Linear(dim, dim)
        self.proj_k_dense_layer = nn.Linear(dim, dim)
        self.proj_v_dense_layer = nn.Linear(dim, dim)
        self.proj_output_dense_layer = nn.Linear(dim, dim)
        self.ffn = nn.ModuleList([nn.ModuleDict({"linear_layer": nn.Linear(dim, 2 * dim)})])
        self.lm_head = nn.Linear(2 * dim, vocab)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        h = self.embedding_layer(tokens[:, :-1])
        h = self.proj_output_dense_layer(
            self.proj_q_dense_layer(h) + self.proj_k_dense_layer(h) + self.proj_v_dense_layer(h)
        )
        logits = self.lm_head(self.ffn[0]["linear_layer"](h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.randint(0, 32, (32, 9), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_modelzoo_file_path_and_a_plain_lightning_module(tmp_path: Path) -> None:
    """The ModelZoo params file itself, on a user's own LightningModule with GPT-3 names and its
    own dataloader (no data module): the callbacks need nothing from the model."""
    assert MODELZOO_RIGL.is_file(), f"{MODELZOO_RIGL} (a repository fixture) is missing"
    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 3,
            "logger": False,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "default_root_dir": str(tmp_path),
            "callbacks": [
                {
                    "class_path": "lightning_sparse.ModelZooSparsity",
                    "init_args": {"sparsity": str(MODELZOO_RIGL)},
                }
            ],
        },
        "model": {"class_path": f"{__name__}.ModelZooNamedLM"},
    }
    run = cli.run(["fit", "--config", write(tmp_path, config)])
    masked = summary_of(run)["sparsity"]["layers"]
    assert sorted(masked) == [
        "ffn.0.linear_layer.weight",
        "proj_k_dense_layer.weight",
        "proj_output_dense_layer.weight",
        "proj_q_dense_layer.weight",
        "proj_v_dense_layer.weight",
    ]
    assert all(s == pytest.approx(0.75, abs=0.01) for s in masked.values())
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


# ---------------------------------------------------------------- Hugging Face models


def test_hugging_face_model_without_transformers_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("lightning_sparse.models.hf")
    try:
        import transformers  # noqa: F401

        pytest.skip("transformers is installed; only the missing-package error is tested")
    except ModuleNotFoundError:
        pass
    args = [
        "--model.model",
        "lightning_sparse.models.hf.HFCausalLM",
        "--model.model.path",
        str(tmp_path),
    ]
    # jsonargparse reports the constructor's ModuleNotFoundError inside its ValueError.
    with pytest.raises((ModuleNotFoundError, ValueError), match="pip install transformers"):
        cli.run(["fit", "--config", str(recipe("rigl")), *TINY, *CSV, *args])


def test_every_recipe_checkpoint_replaces_its_last_ckpt() -> None:
    """A recipe's `ModelCheckpoint` writes ``last.ckpt`` in place on a re-run into the same
    directory (``enable_version_counter: false``): ``last-v1.ckpt`` beside a stale ``last.ckpt``
    would leave a chained stage (``vspdf_dense.yaml`` reads ``vspdf_chained/sparse``) on the old
    weights."""
    checked = 0
    for path in sorted(RECIPES.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        for callback in config.get("trainer", {}).get("callbacks") or []:
            if callback.get("class_path", "").endswith("ModelCheckpoint"):
                checked += 1
                assert callback["init_args"].get("enable_version_counter") is False, path.name
    assert checked >= 8
