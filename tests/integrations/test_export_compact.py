"""The compressed export of a checkpoint of a model built sparse is written from the checkpoint
(`export_compact`), never building the model, and holds what the export through the dense model
holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_sparse import RigL
from lightning_sparse.integrations import export as export_module
from lightning_sparse.integrations.export import export
from lightning_sparse.integrations.lit_checkpoint import load_lit_checkpoint
from lightning_sparse.models.lit_lm import LitCausalLM
from tests.helpers import trainer

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
safetensors = pytest.importorskip("safetensors.torch")


@pytest.mark.parametrize("tie", [False, True])
def test_compact_checkpoint_exports_without_the_model(
    tie: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    lit = LitCausalLM(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32, warmup_steps=1,
        tie_embeddings=tie, build_sparse=True,
    )  # fmt: skip
    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    t = trainer(
        tmp_path, accelerator="wse", max_steps=2, enable_checkpointing=True,
        callbacks=[RigL(0.9, update={"freq": 1}, seed=3)], num_sanity_val_steps=0,
    )  # fmt: skip
    t.fit(lit, torch.utils.data.DataLoader(data, batch_size=2))
    (ckpt,) = tmp_path.rglob("*.ckpt")

    # Through the dense model (what export does for any other checkpoint): the reference.
    dense = load_lit_checkpoint(ckpt)
    reference = export(dense, tmp_path / "reference", format="compressed")

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(export_module, "load_lit_checkpoint", no_model)
    out = export(ckpt, tmp_path / "compact", format="compressed")
    got = safetensors.load_file(out / "model.safetensors")
    want = safetensors.load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    assert any(k.endswith(".bitmask") for k in got)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((reference / "config.json").read_text())
    assert config["quantization_config"]["sparsity_config"]["targets"]
    assert (out / "generation_config.json").is_file()
    assert (out / "lightning_sparse_export.json").is_file()
    # Served from the checkpoint (one weight dense at a time) as from the export.
    from lightning_sparse.integrations.serve import load_on_wse

    prompt = data[:1, :8]
    from_ckpt = load_on_wse(ckpt).generate(prompt, 6)
    assert torch.equal(from_ckpt, load_on_wse(out).generate(prompt, 6))
