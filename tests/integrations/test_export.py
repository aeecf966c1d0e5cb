"""`export`: sparse models as Hugging Face directories that ``from_pretrained`` loads without a
warning and that give the trained model's logits; the compressed-tensors sparse-bitmask format;
``fit`` checkpoints through ``lightning-sparse export``; atomic writes and the error messages.

Models are tiny and random (nothing downloaded); the size test uses the ``small`` preset's shape.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file  # noqa: E402

from lightning_sparse import Static, export  # noqa: E402
from lightning_sparse.app import cli  # noqa: E402
from lightning_sparse.core.state_dict import checkpoint_masks, restore_masks  # noqa: E402
from lightning_sparse.integrations import export as export_module  # noqa: E402
from lightning_sparse.integrations.compressed import load_compressed  # noqa: E402
from lightning_sparse.models import LitCausalLM, Llama, LlamaConfig  # noqa: E402
from lightning_sparse.models.hf import HFCausalLM  # noqa: E402
from tests.helpers import full_state, one_thread, repo_pythonpath, sparse_hf_lit  # noqa: E402, F401  (autouse: one thread)

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def no_warnings() -> Iterator[None]:
    """Fails if Python or transformers' logger warns inside the block."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.removeHandler(handler)
    assert not [str(w.message) for w in caught]
    assert not [r.getMessage() for r in records]


def load(path: Path, compressed: bool = False) -> nn.Module:
    """``from_pretrained`` (or `load_compressed`) with no warning and no key left over."""
    with no_warnings():
        if compressed:
            model, info = load_compressed(path, output_loading_info=True)
        else:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                path, output_loading_info=True
            )
    assert not any(info.values()), info  # missing / unexpected / mismatched keys, errors
    return model.eval()


def sparse_llama(**overrides: Any) -> Llama:
    """The tiny preset (GQA) with non-default RoPE base and eps, random norm gains, 80% sparse."""
    torch.manual_seed(0)
    cfg = LlamaConfig.from_preset("tiny", vocab_size=96, rope_theta=500.0, norm_eps=1e-4)
    model = Llama(LlamaConfig(**{**cfg.__dict__, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # gains of 1 would hide a mapping error
    model.apply(Static(0.8))
    return model.eval()


def masks_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k[: -len("_mask")]: v for k, v in model.named_buffers() if k.endswith("_mask")}


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def assert_same_logits(
    live: Callable[[torch.Tensor], torch.Tensor], hf: nn.Module, vocab: int
) -> None:
    idx = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = live(idx), hf(input_ids=idx).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_exports_as_llama_for_causal_lm_with_the_same_logits(
    tmp_path: Path, tied: bool
) -> None:
    model = sparse_llama(tie_embeddings=tied)
    lit = LitCausalLM(model=model)
    before = full_state(model)
    export(lit, tmp_path / "hf")
    after = full_state(model)
    assert before.keys() == after.keys()  # masks kept on the live model
    assert all(torch.equal(before[k], after[k]) for k in before)

    saved = saved_tensors(tmp_path / "hf")
    assert not [k for k in saved if k.endswith("_mask")]
    masks = masks_of(model)
    assert len(masks) == 14  # the 7 projections of each of the 2 blocks
    for name, mask in masks.items():
        weight = saved[f"model.{name}"]
        assert torch.equal(weight[~mask], torch.zeros(int((~mask).sum())))
        assert torch.equal(weight, after[name])
    hf = load(tmp_path / "hf")
    assert isinstance(hf, transformers.LlamaForCausalLM)
    c = hf.config
    assert c.num_key_value_heads == 2 and c.rope_parameters["rope_theta"] == 500.0
    assert c.rms_norm_eps == 1e-4 and c.tie_word_embeddings is tied
    assert_same_logits(lit, hf, 96)
    # transformers 4.x reads RoPE's base from the top level (5.x writes only rope_parameters).
    assert json.loads((tmp_path / "hf/config.json").read_text())["rope_theta"] == 500.0


def test_hf_models_plain_and_wrapped_export_with_the_same_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0,
            eos_token_id=0,
        )
    ).eval()  # fmt: skip
    gpt2.apply(Static(0.8))
    before = {k: v.clone() for k, v in gpt2.state_dict().items()}
    export(gpt2, tmp_path / "gpt2")
    after = gpt2.state_dict()  # untouched, masks included
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    saved = saved_tensors(tmp_path / "gpt2")
    for name, mask in masks_of(gpt2).items():  # Conv1D weights, stored as they are
        assert torch.equal(saved[name][~mask], torch.zeros(int((~mask).sum())))
    assert_same_logits(lambda x: gpt2(input_ids=x).logits, load(tmp_path / "gpt2"), 128)

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    lit = LitCausalLM(model=HFCausalLM(str(tmp_path / "base")))
    lit.apply(Static(0.8))
    lit.eval()
    export(lit, tmp_path / "wrapped")
    assert_same_logits(lit, load(tmp_path / "wrapped"), 96)
    assert len(masks_of(lit)) == 14  # the live model still holds its masks


def test_compressed_format_loads_with_the_same_logits_and_stores_bitmasks(
    tmp_path: Path,
) -> None:
    model = sparse_llama()
    export(model, tmp_path / "c", format="compressed")
    saved = saved_tensors(tmp_path / "c")
    config = json.loads((tmp_path / "c/config.json").read_text())
    sparsity = config["quantization_config"]["sparsity_config"]
    assert sparsity["format"] == "sparse-bitmask" and len(sparsity["targets"]) == 14
    for name, mask in masks_of(model).items():
        prefix = f"model.{name[: -len('.weight')]}"
        assert f"model.{name}" not in saved
        assert saved[f"{prefix}.compressed"].numel() == int(mask.sum())  # no stored zeros
        bits = saved[f"{prefix}.bitmask"].numpy()  # [rows, ceil(cols / 8)], little bit order
        unpacked = torch.from_numpy(
            numpy.unpackbits(bits, axis=-1, count=mask.shape[1], bitorder="little")
        ).bool()
        assert torch.equal(unpacked, mask)
    assert abs(sparsity["global_sparsity"] - 0.8) < 0.01
    assert_same_logits(model, load(tmp_path / "c", compressed=True), 96)


def test_compressed_config_holds_only_what_compressed_tensors_writes(tmp_path: Path) -> None:
    """compressed-tensors <= 0.14 treats any top-level key of ``quantization_config`` other than
    these as a quantization config: the ``"format": "dense"`` written before made
    ``ModelCompressor.from_pretrained`` fail (``.ci/reader_check`` runs that reader)."""
    from compressed_tensors.config import SparsityCompressionConfig

    export(sparse_llama(), tmp_path / "c", format="compressed")
    config = json.loads((tmp_path / "c/config.json").read_text())["quantization_config"]
    assert set(config) == {"quant_method", "sparsity_config"}
    assert config["quant_method"] == "compressed-tensors"
    fields = dict(config["sparsity_config"])
    parsed = SparsityCompressionConfig.load_from_registry(fields.pop("format"), **fields)
    assert parsed.format == "sparse-bitmask" and parsed.sparsity_structure == "unstructured"
    assert parsed.targets == [f"model.{n[: -len('.weight')]}" for n in sorted(masks_of(
        sparse_llama()))]  # fmt: skip


def _bitmask_decompressor_missing() -> str:
    """Why compressed-tensors' own sparse-bitmask decompression cannot run here ("" if it can)."""
    import compressed_tensors
    from compressed_tensors import ModelCompressor
    from compressed_tensors.compressors import BaseCompressor

    if hasattr(ModelCompressor, "from_pretrained") and (
        "sparse-bitmask" in BaseCompressor.registered_names()
    ):
        return ""
    return (
        f"compressed-tensors {compressed_tensors.__version__} has no sparse-bitmask "
        "decompressor (0.14.0.1 is the last with one); .ci/reader_check runs this check with "
        "compressed-tensors 0.14.0.1 and transformers 4.55-4.57 in a venv of their own"
    )


@pytest.mark.skipif(bool(_bitmask_decompressor_missing()), reason=_bitmask_decompressor_missing())
def test_compressed_tensors_own_decompressor_gives_the_dense_weights(tmp_path: Path) -> None:
    from compressed_tensors import ModelCompressor

    model = sparse_llama()
    export(model, tmp_path / "c", format="compressed")
    export(model, tmp_path / "hf")
    compressor = ModelCompressor.from_pretrained(str(tmp_path / "c"))
    assert compressor.quantization_config is None
    state = dict(compressor.sparsity_compressor.decompress(str(tmp_path / "c")))
    dense = saved_tensors(tmp_path / "hf")
    assert state.keys() == dense.keys()
    assert all(torch.equal(state[k], dense[k]) for k in dense)


def test_compressed_file_is_at_most_035x_the_dense_one_at_80_percent(tmp_path: Path) -> None:
    """The ``small`` preset's shape (the sparse projections are 96% of the weights), fp32."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("small"))
    model.apply(Static(0.8))
    dense = export(model, tmp_path / "hf") / "model.safetensors"
    small = export(model, tmp_path / "c", format="compressed") / "model.safetensors"
    ratio = small.stat().st_size / dense.stat().st_size
    assert 0.2 < ratio <= 0.35, ratio


# ---------------------------------------------------------------- checkpoints and the CLI


def test_fit_checkpoint_exports_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = [
        *("--model.dim", "32", "--model.n_layers", "1", "--model.max_seq_len", "32"),
        *("--model.n_kv_heads", "2", "--model.tie_embeddings", "true"),
        *("--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"),
        *("--data.val_windows", "4", "--trainer.enable_progress_bar", "false"),
        *("--trainer.enable_model_summary", "false", "--trainer.max_steps", "3"),
        *("--trainer.logger", "lightning.pytorch.loggers.CSVLogger"),
        *("--trainer.accelerator", "cpu"),  # the recipe says auto: the GPU where there is one
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "PYTHONPATH": repo_pythonpath(),
    }
    done = subprocess.run(
        [sys.executable, "-m", "lightning_sparse.app.cli", "fit", *tiny],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (ckpt,) = tmp_path.rglob("last.ckpt")

    cli.main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "hf")])
    cli.main(["export", "--ckpt_path", str(ckpt), "--format", "compressed",
              "--output", str(tmp_path / "c")])  # fmt: skip

    # The reference: the module rebuilt by hand from the checkpoint (masks from its callback
    # state).
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    hp = {k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}
    lit = LitCausalLM(**hp)
    restore_masks(lit, checkpoint)
    lit.load_state_dict(checkpoint["state_dict"])
    lit.eval()
    masks = {k[len("model.") :]: v for k, v in checkpoint_masks(checkpoint).items()}
    assert len(masks) == 7 and all(0.75 < 1 - m.float().mean() < 0.85 for m in masks.values())
    saved = saved_tensors(tmp_path / "hf")
    assert not [k for k in saved if k.endswith("_mask")]
    for name, mask in masks.items():
        assert torch.equal(saved[f"model.{name}"][~mask], torch.zeros(int((~mask).sum())))
    assert_same_logits(lit, load(tmp_path / "hf"), 256)
    assert_same_logits(lit, load(tmp_path / "c", compressed=True), 256)

    # Checkpoints that keep masks out of the state dict (weights still exactly zero) give the
    # same files: the bitmask comes from the weights' nonzeros.
    maskless = ckpt.with_name("maskless.ckpt")
    checkpoint["state_dict"] = {
        k: v for k, v in checkpoint["state_dict"].items() if not k.endswith("_mask")
    }
    torch.save(checkpoint, maskless)
    cli.main(["export", "--ckpt_path", str(maskless), "--format", "compressed",
              "--output", str(tmp_path / "c2")])  # fmt: skip
    first, second = saved_tensors(tmp_path / "c"), saved_tensors(tmp_path / "c2")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert sum(k.endswith(".bitmask") for k in first) == 7

    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "hf")])
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["export", "--ckpt_path", str(tmp_path / "nope.ckpt"), "--output", "x"])
    assert "nope.ckpt' is not a file" in capsys.readouterr().err


def test_checkpoint_of_a_recipe_given_hf_model_is_rebuilt_from_the_run_config(
    tmp_path: Path,
) -> None:
    """`LitCausalLM` does not save its ``model`` argument; the run's config.yaml records it."""
    lit = sparse_hf_lit(tmp_path / "base")
    run = tmp_path / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    hparams = {"_class_path": "lightning_sparse.models.LitCausalLM", **lit.hparams}
    ckpt = run / "checkpoints/last.ckpt"
    torch.save({"hyper_parameters": hparams, "state_dict": lit.state_dict()}, ckpt)
    with pytest.raises(ValueError, match="cannot rebuild the module of checkpoint.*yourself"):
        export(ckpt, tmp_path / "no_config")  # a default Llama does not fit these weights
    (run / "config.yaml").write_text(
        "model:\n  class_path: lightning_sparse.models.LitCausalLM\n  init_args:\n    model:\n"
        "      class_path: lightning_sparse.models.hf.HFCausalLM\n"
        f"      init_args: {{path: {tmp_path / 'base'}}}\n"
    )
    export(ckpt, tmp_path / "hf")
    assert_same_logits(lit, load(tmp_path / "hf"), 96)


# ---------------------------------------------------------------- atomic writes and errors


def test_existing_output_is_refused_unless_overwrite_and_tokenizer_is_copied(
    tmp_path: Path,
) -> None:
    model = sparse_llama()
    out = tmp_path / "out"
    export(model, out)
    with pytest.raises(ValueError, match=r"output=.*already exists.*overwrite=True"):
        export(model, out)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"version": "1.0"}')
    export(model, out, tokenizer=tokenizer, overwrite=True)
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "lightning_sparse_export.json"} <= set(names)
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    marker = json.loads((out / "lightning_sparse_export.json").read_text())
    assert marker["writer"] == "lightning_sparse" and marker["format"] == "hf"
    assert sorted(marker["files"]) == sorted(set(names) - {"lightning_sparse_export.json"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tok"]  # no temporary left


def test_a_failure_while_writing_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sparse.integrations import compressed

    def broken(path: Path, names: Any = None) -> None:
        raise OSError(28, "No space left on device")

    export(sparse_llama(), tmp_path / "out", format="hf")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    monkeypatch.setattr(compressed, "compress_directory", broken)
    with pytest.raises(OSError, match=r"export to .*new. failed: .*No space.*free space"):
        export(sparse_llama(), tmp_path / "new", format="compressed")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(OSError, match="No space left on device"):
        export(sparse_llama(), tmp_path / "out", format="compressed", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the old one, intact
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_bad_requests_are_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = sparse_llama()
    with pytest.raises(ValueError, match=r"format='onnx'.*'hf' or 'compressed'"):
        export(model, tmp_path / "a", format="onnx")
    classifier = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, pad_token_id=0,
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match="LlamaForSequenceClassification.*causal LM"):
        export(classifier, tmp_path / "b")
    with pytest.raises(ValueError, match="cannot export a Linear"):
        export(nn.Linear(4, 4), tmp_path / "c")
    model.layers[0].self_attn.q_proj = nn.Linear(32, 32, bias=True)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.q_proj.bias'\]"):
        export(model, tmp_path / "d")
    with pytest.raises(ValueError, match=r"cannot represent.*rope_theta=-1.0 \(must be"):
        export(Llama(LlamaConfig.from_preset("tiny", rope_theta=-1.0)), tmp_path / "h")
    with pytest.raises(FileNotFoundError, match="tokenizer="):
        export(sparse_llama(), tmp_path / "e", tokenizer=tmp_path / "missing")
    model_dir = tmp_path / "model_files"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds model files \['config.json'\]"):
        export(sparse_llama(), tmp_path / "e", tokenizer=model_dir)

    real = importlib.util.find_spec
    monkeypatch.setattr(
        export_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "compressed_tensors" else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install compressed-tensors"):
        export(sparse_llama(), tmp_path / "f", format="compressed")
    monkeypatch.setattr(export_module.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match="'transformers'.*`pip install transformers`"):
        export(sparse_llama(), tmp_path / "g")
    assert [p.name for p in tmp_path.iterdir()] == ["model_files"]  # nothing written
