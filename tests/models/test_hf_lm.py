"""`HFCausalLM`: train mode (dropout on in training_step), ``dtype`` and its deprecated alias,
random init from a config (dict, file or directory), clear errors; the `hf_llama_tiny` recipe
trains through the CLI with a BPE tokenizer it saves for reuse."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lightning_sparse.core.state_dict import checkpoint_masks  # noqa: E402
from lightning_sparse.models import LitCausalLM  # noqa: E402
from lightning_sparse.models.hf import HFCausalLM  # noqa: E402
from tests.helpers import hf_llama_fields, one_torch_thread, trainer  # noqa: E402

LLAMA = {"model_type": "llama", **hf_llama_fields(num_hidden_layers=1, intermediate_size=48)}
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "hf_llama_tiny.yaml"
DROPOUT = {**LLAMA, "attention_dropout": 0.5}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def built(config: object, seed: int = 0, **kwargs: object) -> HFCausalLM:
    torch.manual_seed(seed)
    return HFCausalLM(config=config, **kwargs)


def saved_pretrained(tmp_path: Path, config: dict) -> Path:
    """A save_pretrained directory of a random tiny model (from_pretrained puts it in eval)."""
    fields = dict(config)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    )
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


# ---------------------------------------------------------------- train mode


def test_from_pretrained_is_put_in_train_mode(tmp_path: Path) -> None:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved_pretrained(tmp_path, LLAMA))
    assert not loaded.training  # what HFCausalLM has to undo
    model = HFCausalLM(path=str(tmp_path / "model"))
    assert all(m.training for m in model.modules())


class DropoutProbe(pl.Callback):
    """Before each training batch: is every module in train mode, and do two forwards of the
    same batch differ (dropout active)? In validation: do they agree (dropout off)?"""

    def __init__(self) -> None:
        self.train_seen: list[tuple[bool, bool]] = []
        self.val_seen: list[bool] = []

    @staticmethod
    def differ(pl_module: pl.LightningModule, batch: torch.Tensor) -> bool:
        with torch.no_grad():
            return not torch.equal(pl_module(batch[:, :-1]), pl_module(batch[:, :-1]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        modes = all(m.training for m in pl_module.modules())
        self.train_seen.append((modes, self.differ(pl_module, batch)))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, *a) -> None:  # noqa: ANN001
        self.val_seen.append(self.differ(pl_module, batch))


@pytest.mark.parametrize("source", ["path", "config"])
def test_dropout_is_active_in_training_step_and_off_in_validation(
    source: str, tmp_path: Path
) -> None:
    if source == "path":
        model = HFCausalLM(path=str(saved_pretrained(tmp_path, DROPOUT)))
    else:
        model = built(DROPOUT)
    lit = LitCausalLM(model=model, warmup_steps=1, max_steps=4)
    data = torch.randint(0, 64, (16, 9), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    probe = DropoutProbe()
    # Validation first (sanity check) and in between: the mode must come back after it.
    fit = trainer(tmp_path, max_steps=4, callbacks=[probe], val_check_interval=2)
    fit.fit(lit, loader, loader)
    assert probe.train_seen == [(True, True)] * 4
    assert probe.val_seen and not any(probe.val_seen)


# ---------------------------------------------------------------- dtype and config forms


def test_dtype_and_deprecated_torch_dtype_alias() -> None:
    assert {p.dtype for p in built(LLAMA, dtype="bfloat16").parameters()} == {torch.bfloat16}
    with pytest.warns(FutureWarning, match="use dtype='bfloat16'"):
        old = built(LLAMA, torch_dtype="bfloat16")
    assert {p.dtype for p in old.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="disagree"):
        HFCausalLM(config=LLAMA, dtype="float16", torch_dtype="bfloat16")


def test_config_dict_file_and_directory_build_the_same_random_model(tmp_path: Path) -> None:
    fields = {k: v for k, v in LLAMA.items() if k != "model_type"}
    transformers.LlamaConfig(**fields).save_pretrained(tmp_path)  # writes config.json only
    assert not list(tmp_path.glob("*.safetensors"))
    models = [built(LLAMA), built(str(tmp_path / "config.json")), built(str(tmp_path))]
    reference = models[0].state_dict()
    for other in models[1:]:
        assert other.state_dict().keys() == reference.keys()
        assert all(torch.equal(other.state_dict()[k], v) for k, v in reference.items())
    assert not torch.equal(
        built(LLAMA, seed=1).model.lm_head.weight, models[0].model.lm_head.weight
    )
    idx = torch.randint(0, 64, (2, 7))
    models[0].eval()
    with torch.no_grad():
        expected = models[0].model(input_ids=idx).logits
        assert torch.equal(models[0](idx), expected)
    assert models[0](idx).shape == (2, 7, 64)
    assert models[0].config.vocab_size == 64


def test_bad_arguments_name_the_value_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of path= .* and config="):
        HFCausalLM()
    with pytest.raises(ValueError, match="exactly one of path="):
        HFCausalLM(path=str(tmp_path), config=LLAMA)
    with pytest.raises(ValueError, match="no 'model_type'"):
        HFCausalLM(config={"hidden_size": 32})
    with pytest.raises(FileNotFoundError, match="neither a config.json file nor a directory"):
        HFCausalLM(config=str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HFCausalLM(path=str(tmp_path))


# ---------------------------------------------------------------- the recipe, through the CLI


def test_hf_llama_tiny_recipe_trains_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jsonargparse")  # the command's (an optional package)
    from lightning_sparse.app import cli

    monkeypatch.chdir(tmp_path)
    recipe = RECIPE  # not cli.RECIPES_DIR: that is the installed checkout's, maybe not this one
    short = [
        "--trainer.accelerator",  # the recipe says auto: the GPU where there is one
        "cpu",
        "--trainer.max_steps",
        "12",
        "--trainer.val_check_interval",
        "6",
        "--trainer.enable_progress_bar",
        "false",
        "--data.max_bytes",
        "60000",
        "--data.val_windows",
        "4",
        "--trainer.callbacks.init_args.update",
        "{freq: 5, stop: 11}",
    ]
    run = cli.run(["fit", "--config", str(recipe), *short])
    assert run.trainer.global_step == 12
    summary = json.loads(Path(run.trainer.log_dir, "summary.json").read_text())
    layers = summary["sparsity"]["layers"]
    assert sorted({n.rsplit(".", 2)[-2] for n in layers}) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert len(layers) == 14 and all(s == pytest.approx(0.8, abs=1e-3) for s in layers.values())
    (rigl,) = [c for c in run.trainer.callbacks if type(c).__name__ == "RigL"]
    assert rigl.last_update_step == 10  # masks were updated in the run (steps 5 and 10)
    # The model's vocabulary is the tokenizer's, which was saved and loads back as it was.
    hf = run.model.model
    assert hf.config.vocab_size == run.datamodule.vocab_size == 384
    assert hf.training and summary["val"]["loss"] < torch.log(torch.tensor(384.0)).item()
    saved = transformers.AutoTokenizer.from_pretrained(
        "outputs/hf_llama_tiny/tokenizer", local_files_only=True
    )
    text = "def f(x):\n    return x + 1\n"
    assert saved(text)["input_ids"] == run.datamodule.tokenizer(text)["input_ids"]
    # Pruned weights are exactly zero in the last checkpoint.
    saved = torch.load(
        Path(run.trainer.checkpoint_callback.dirpath, "last.ckpt"), weights_only=True
    )
    state, masks = saved["state_dict"], checkpoint_masks(saved)
    assert len(masks) == 14 and not [k for k in state if k.endswith("_mask")]
    for name, mask in masks.items():
        weight = state[name]
        assert torch.equal(weight[~mask], torch.zeros_like(weight[~mask]))
