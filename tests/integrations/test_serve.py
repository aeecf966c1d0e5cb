"""`load_on_wse` and ``lightning-sparse generate``: compressed exports, dense exports and Lightning
checkpoints load straight onto the device in CSR (no dense float tensor of a compressed layer at
any time), generate the tokens of ``load_compressed`` + ``on_wse`` and of the dense model, hold
<= 0.3x the dense model at 90%; bad inputs give one line naming the problem."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from lightning_sparse import Static, export, strip_masks  # noqa: E402
from lightning_sparse.integrations.compressed import load_compressed  # noqa: E402
from lightning_sparse.integrations.serve import load_on_wse  # noqa: E402
from lightning_sparse.models import LitCausalLM, Llama, LlamaConfig  # noqa: E402
from lightning_sparse.models.hf import HFCausalLM  # noqa: E402
from lightning_sparse.wse import on_wse, register_masks  # noqa: E402
from lightning_sparse.wse.csr_linear import CSRLinear  # noqa: E402
from lightning_sparse.wse.native import compiled_available  # noqa: E402
from tests.helpers import hf_llama_fields, one_thread, repo_pythonpath  # noqa: E402, F401  (autouse)

REPO = Path(__file__).resolve().parents[2]
# Shapes chosen so no dense tensor of the model has a masked layer's element count: q/o 48x48,
# k/v 24x48, gate/up/down 128x48, embedding/head 256x48, rotary tables 64x12.
CONFIG = dict(vocab_size=256, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def sparse_llama(sparsity: float = 0.9) -> Llama:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG)).eval()
    model.apply(Static(sparsity))  # the 14 projections; embeddings, norms and head stay dense
    return model


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    model = sparse_llama()
    return {
        "compressed": export(model, root / "compressed", format="compressed"),
        "hf": export(model, root / "hf"),
    }


def prompt(n: int = 9, vocab: int = 256) -> torch.Tensor:
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(3))


def hf_generate(model: nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip


CSR_PATH = "compiled" if compiled_available() else "torch"


def on_wse_baseline(path: Path) -> nn.Module:
    """Today's path: decompress to the dense model, masks from the nonzeros, then `on_wse`."""
    model = load_compressed(path).eval()
    weights = {k: v for k, v in model.state_dict().items() if k.endswith("proj.weight")}
    masks = {f"{k}_mask": v != 0 for k, v in weights.items()}
    assert len(register_masks(model, {**weights, **masks})) == 14
    return model


class DenseAllocations(TorchDispatchMode):
    """Records every floating-point tensor an op creates off the meta device with one of the
    given element counts."""

    def __init__(self, numels: set[int]) -> None:
        super().__init__()
        self.numels, self.seen = numels, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if torch.is_tensor(t) and t.is_floating_point() and t.device.type != "meta":
                if t.numel() in self.numels:
                    self.seen.append((str(func), tuple(t.shape)))
        return out


def test_a_compressed_export_never_holds_a_dense_weight_of_a_compressed_layer(
    exports: dict[str, Path],
) -> None:
    model = sparse_llama()
    masked = {m.weight.numel() for m in model.modules() if hasattr(m, "weight_mask")}
    assert masked == {48 * 48, 24 * 48, 128 * 48}
    with DenseAllocations(masked) as watch:
        served = load_on_wse(exports["compressed"])
    assert watch.seen == []
    assert len(served.layers) == 14 and all(
        isinstance(layer, CSRLinear) for layer in served.layers.values()
    )
    assert not any(n.endswith("proj.weight") for n, _ in served.model.named_parameters())
    with DenseAllocations(masked) as watch:  # the detector sees today's path do it
        load_compressed(exports["compressed"])
    assert watch.seen


@pytest.mark.parametrize("source", ["compressed", "hf"])
def test_tokens_equal_load_compressed_on_wse_and_the_dense_model(
    exports: dict[str, Path], source: str
) -> None:
    served = load_on_wse(exports[source])
    ids = prompt()
    baseline = on_wse_baseline(exports["compressed"])
    with on_wse(baseline, path=CSR_PATH) as executor:  # CSR, as served (auto may run dense)
        expected = hf_generate(baseline, ids, 12)
    flops = executor.stats.as_dict()
    assert flops["total_flops_forward"] < 0.5 * flops["total_flops_forward_dense"]  # in CSR
    dense = transformers.AutoModelForCausalLM.from_pretrained(exports["hf"]).eval()
    assert torch.equal(hf_generate(dense, ids, 12), expected)
    assert torch.equal(served.generate(ids, 12), expected)
    with torch.no_grad():
        torch.testing.assert_close(
            served.logits(ids), dense(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(served.logits(ids), sparse_llama()(ids), rtol=1e-5, atol=1e-5)


def test_bfloat16_storage_matches_on_wse_bfloat16(exports: dict[str, Path]) -> None:
    served = load_on_wse(exports["compressed"], inference_dtype="bfloat16")
    assert {layer.values.dtype for layer in served.layers.values()} == {torch.bfloat16}
    baseline = on_wse_baseline(exports["compressed"])
    ids = prompt()
    with torch.no_grad(), on_wse(baseline, path=CSR_PATH, inference_dtype="bfloat16"):
        expected = baseline(input_ids=ids).logits
        tokens = hf_generate(baseline, ids, 8)
    torch.testing.assert_close(served.logits(ids), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(served.generate(ids, 8), tokens)


def test_held_memory_at_90_percent_is_under_03x_the_dense_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=16, dim=128, n_layers=2, n_heads=4, max_seq_len=32))
    model.apply(Static(0.9))
    dense_bytes = sum(p.nbytes for p in model.parameters())
    served = load_on_wse(export(model.eval(), tmp_path / "c", format="compressed"))
    held, csr_dense = served.csr_dense_bytes()
    assert served.held_bytes() <= 0.3 * dense_bytes
    assert held <= 0.2 * csr_dense  # values + 16-bit (or int32) columns + row pointers


def test_a_gpt2_export_runs_its_conv1d_layers_in_csr(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    model.apply(Static(0.9))  # the 8 Conv1D weights ([in, out]); the tied head stays dense
    served = load_on_wse(export(model, tmp_path / "c", format="compressed"))
    assert len(served.layers) == 8
    assert served.model.lm_head.weight is served.model.transformer.wte.weight
    ids = prompt(vocab=64)
    with torch.no_grad():
        torch.testing.assert_close(served.logits(ids), model(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(served.generate(ids, 10), hf_generate(model, ids, 10))


def lit_checkpoint(tmp_path: Path, lit: LitCausalLM, masks: bool) -> Path:
    """A Lightning checkpoint of ``lit``: with mask entries (the format up to now) or without
    (weights exactly zero at pruned positions, masks elsewhere)."""
    state = lit.state_dict()
    if not masks:
        state = {k: v for k, v in state.items() if not k.endswith("_mask")}
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": dict(lit.hparams)}, path)
    return path


@pytest.mark.parametrize("masks", [True, False], ids=["mask-keys", "no-mask-keys"])
def test_a_llama_checkpoint_generates_the_tokens_of_on_wse(tmp_path: Path, masks: bool) -> None:
    torch.manual_seed(0)
    lit = LitCausalLM(**CONFIG).eval()
    lit.model.apply(Static(0.9))
    with torch.no_grad():  # a trained checkpoint holds exact zeros at pruned positions
        for m in lit.model.modules():
            if hasattr(m, "weight_mask"):
                m.weight.mul_(m.weight_mask)
    served = load_on_wse(lit_checkpoint(tmp_path, lit, masks))
    assert isinstance(served.model, Llama) and len(served.layers) == 14
    ids = prompt()
    with torch.no_grad(), on_wse(lit):
        expected = lit.model.generate(ids, 12, temperature=0)
        logits = lit(ids)
    assert torch.equal(served.generate(ids, 12), expected)
    torch.testing.assert_close(served.logits(ids), logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A small byte-level BPE and the directory it is saved in."""
    pytest.importorskip("tokenizers")
    from lightning_sparse.data.tokenized import train_byte_bpe

    tokenizer = train_byte_bpe(["def main():\n    return 1\n" * 20, "import os\n" * 20], 300)
    directory = tmp_path_factory.mktemp("bpe")
    tokenizer.save_pretrained(directory)
    return tokenizer, directory


def test_an_hf_checkpoint_is_built_from_the_run_config(
    tmp_path: Path, bpe: tuple[Any, Path]
) -> None:
    tokenizer, tokenizer_dir = bpe
    torch.manual_seed(0)
    fields = hf_llama_fields(vocab_size=len(tokenizer), max_position_embeddings=64)
    lit = LitCausalLM(model=HFCausalLM(config={"model_type": "llama", **fields})).eval()
    lit.model.apply(Static(0.9))
    state = {k: v for k, v in lit.state_dict().items()}
    for key in [k for k in state if k.endswith("_mask")]:
        state[key[: -len("_mask")]] = state[key[: -len("_mask")]] * state[key]
    torch.save({"state_dict": state, "hyper_parameters": dict(lit.hparams)}, tmp_path / "x.ckpt")
    recipe = {
        "model": {"init_args": {"model": {
            "class_path": "lightning_sparse.models.hf.HFCausalLM",
            "init_args": {"config": {"model_type": "llama", **fields}},
        }}},
        "data": {"init_args": {"save_tokenizer": str(tokenizer_dir)}},
    }  # fmt: skip
    (tmp_path / "config.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    served = load_on_wse(tmp_path / "x.ckpt")
    assert type(served.model).__name__ == "LlamaForCausalLM" and len(served.layers) == 14
    ids = torch.tensor([tokenizer("import os", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(served.logits(ids), lit(ids), rtol=1e-5, atol=1e-5)
    new = served.generate(ids, 5)[0, ids.shape[1] :]
    done = run_cli("--model", str(tmp_path / "x.ckpt"), "--prompt", "import os",
                   "--max_new_tokens", "5")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == tokenizer.decode(new, skip_special_tokens=True) + "\n"


# --------------------------------------------------------------------------------- bad inputs
class Boom:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch PWNED",))


def test_bad_inputs_are_refused_with_one_clear_line(
    tmp_path: Path, exports: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cases = {}
    cases["missing"] = (tmp_path / "nope", "does not exist")
    (tmp_path / "empty").mkdir()
    cases["no config"] = (tmp_path / "empty", "no config.json: it is not an export directory")
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    cases["text file"] = (tmp_path / "notes.ckpt", "not a checkpoint torch.load reads safely")
    with open(tmp_path / "evil.ckpt", "wb") as f:
        pickle.dump({"state_dict": Boom()}, f)
    cases["pickle"] = (tmp_path / "evil.ckpt", "weights_only=True")
    torch.save({"state_dict": {}, "hyper_parameters": {"_class_path": "os.system"}},
               tmp_path / "other.ckpt")  # fmt: skip
    cases["other class"] = (tmp_path / "other.ckpt", "holds a 'os.system'")
    torch.manual_seed(0)
    cases["dense"] = (
        export(Llama(LlamaConfig(**CONFIG)).eval(), tmp_path / "dense"),
        "no weight sparse enough to run in CSR",
    )
    bad_arch = _copy(exports["hf"], tmp_path / "arch")
    _edit_config(bad_arch, architectures=["subprocess.Popen"])
    cases["architecture"] = (bad_arch, "'subprocess.Popen' is not one of transformers' causal")
    quantized = _copy(exports["compressed"], tmp_path / "quantized")
    _edit_config(quantized, quantization_config={"quant_method": "gptq", "bits": 4})
    cases["quantized"] = (quantized, "quant_method 'gptq'.*only unquantized")
    wrong = _copy(exports["compressed"], tmp_path / "wrong")
    _edit_config(wrong, hidden_size=64, head_dim=16)
    cases["mismatch"] = (wrong, r"has shape \[256, 48\] but the model .* needs \[256, 64\]")
    for name, (path, message) in cases.items():
        with pytest.raises((ValueError, FileNotFoundError), match=message) as caught:
            load_on_wse(path)
        assert "\n" not in str(caught.value), name
    assert not (tmp_path / "PWNED").exists()


def test_a_tampered_bitmask_is_refused(tmp_path: Path, exports: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(exports["compressed"], tmp_path / "t")
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.bitmask"
    tensors[key] = tensors[key] ^ 1  # flips the first column of every row
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="different weights|row_offsets"):
        load_on_wse(path)


def _copy(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def _edit_config(path: Path, **fields: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------------------------------- CLI
def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "LIGHTNING_SPARSE_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_sparse.app.cli", "generate", *args],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip


def test_the_generate_command_continues_a_prompt(exports: dict[str, Path]) -> None:
    done = run_cli(
        "--model", str(exports["compressed"]), "--prompt", "def f(", "--max_new_tokens", "6"
    )
    assert done.returncode == 0, done.stderr
    ids = torch.tensor([list(b"def f(")])
    expected = load_on_wse(exports["compressed"]).generate(ids, 6)[0, ids.shape[1] :].tolist()
    assert done.stdout == bytes(expected).decode("utf-8", errors="replace") + "\n"
    assert "14 layers in CSR" in done.stderr and "6 tokens in" in done.stderr
    bad = run_cli("--model", str(exports["compressed"] / "missing"), "--prompt", "x")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "does not exist" in bad.stderr


def test_a_sharded_export_and_its_tokenizer_serve_from_the_command_line(
    tmp_path: Path, bpe: tuple[Any, Path]
) -> None:
    tokenizer, tokenizer_dir = bpe
    torch.manual_seed(0)
    fields = hf_llama_fields(vocab_size=len(tokenizer), max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    model.apply(Static(0.9))
    model.save_pretrained(
        tmp_path / "sharded", state_dict=strip_masks(model), max_shard_size="40KB"
    )
    for file in tokenizer_dir.iterdir():
        (tmp_path / "sharded" / file.name).write_bytes(file.read_bytes())
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    served = load_on_wse(tmp_path / "sharded")
    ids = torch.tensor([tokenizer("def main", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(served.logits(ids), model(ids).logits, rtol=1e-5, atol=1e-5)
    expected = tokenizer.decode(
        served.generate(ids, 5)[0, ids.shape[1] :], skip_special_tokens=True
    )
    done = run_cli(
        "--model", str(tmp_path / "sharded"), "--prompt", "def main", "--max_new_tokens", "5"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    (tmp_path / "byteless").mkdir()  # the same weights without their tokenizer: vocab != 256
    for file in (tmp_path / "sharded").glob("*.json"):
        if not file.name.startswith("tokenizer"):
            (tmp_path / "byteless" / file.name).write_bytes(file.read_bytes())
    for file in (tmp_path / "sharded").glob("*.safetensors"):
        (tmp_path / "byteless" / file.name).write_bytes(file.read_bytes())
    bad = run_cli("--model", str(tmp_path / "byteless"), "--prompt", "x")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    assert f"{len(tokenizer)}-token vocabulary and no tokenizer" in bad.stderr
    assert "--tokenizer DIR" in bad.stderr


def test_a_compressed_shape_that_is_not_a_matrix_is_refused(
    tmp_path: Path, exports: dict[str, Path]
) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(exports["compressed"], tmp_path / "t")
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.shape"
    tensors[key] = torch.tensor([*tensors[key].tolist(), 1])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.shape' is \[.*, 1\], not the \[rows, cols\]"):
        load_on_wse(path)
