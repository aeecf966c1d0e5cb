"""Tests for LitCausalLM: a short CPU fit, the LR schedule, optimizer parameter groups."""

import math

import lightning as L
import pytest
import torch

from lightning_sparse.data import ByteTextDataModule
from lightning_sparse.models import LitCausalLM, Llama, LlamaConfig
from lightning_sparse.models.lit_lm import warmup_cosine

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def test_fit_three_steps_logs_finite_loss_and_perplexity():
    L.seed_everything(0)
    module = LitCausalLM(**TINY, warmup_steps=1)
    data = ByteTextDataModule(seq_len=32, batch_size=4, max_bytes=20_000, val_windows=8)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        val_check_interval=3,
    )
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 3
    assert math.isfinite(metrics["train/loss"].item())
    # Near-uniform predictions over 256 bytes at this point: ppl close to 256, loss ~ ln 256.
    assert 50 < metrics["val/ppl"].item() < 1000
    torch.testing.assert_close(metrics["val/ppl"], metrics["val/loss"].exp())


def test_predict_step_appends_tokens():
    module = LitCausalLM(**TINY, max_new_tokens=5, top_k=3)
    out = module.predict_step(torch.zeros(2, 4, dtype=torch.long), 0)
    assert out.shape == (2, 9)


def test_custom_model_and_weight_decay_groups():
    model = Llama(LlamaConfig(**TINY, tie_embeddings=True))
    module = LitCausalLM(model=model, max_steps=10)
    assert module.model is model and "model" not in module.hparams
    opt = module.configure_optimizers()["optimizer"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # The tied embedding / lm_head tensor and the norms are not decayed; every matrix else is.
    assert any(p is model.embed_tokens.weight for p in no_decay["params"])
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(decay["params"]) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize(
    ("step", "expected"),
    [(0, 0.1), (9, 1.0), (10, 1.0), (55, 0.55), (100, 0.1), (500, 0.1)],
)
def test_warmup_cosine(step: int, expected: float):
    # warmup 10 steps to 1.0, cosine to 0.1 at step 100: halfway (step 55) is 0.1 + 0.9 / 2.
    assert warmup_cosine(step, warmup_steps=10, max_steps=100, min_lr_ratio=0.1) == pytest.approx(
        expected
    )
