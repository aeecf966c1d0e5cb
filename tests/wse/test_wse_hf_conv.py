"""The WSE device runs masked Conv2d and Hugging Face Conv1D layers dense, says so once, and
records their FLOPs as dense (executed = dense equivalent): no saving claimed for them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_sparse import Static
from lightning_sparse.wse import install_executor, on_wse


def test_masked_conv2d_runs_dense_and_counts_dense_flops() -> None:
    """Conv2d 2 -> 3 channels, 3x3 (54 weights), 2 examples of 5x5 with padding 1: 50 output
    positions, so each matmul is 2 * 50 * 54 = 5400 FLOPs executed and dense."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, bias=False).double()
    conv.apply(Static(sparsity=0.5, param_filter="weight"))
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    expected = conv(x).detach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        executor = install_executor(conv)
    assert any("runs dense" in str(w.message) and "no saving" in str(w.message) for w in caught)
    y = conv(x)
    y.sum().backward()
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    figures = executor.stats.end_step()
    for kind in ("forward", "input_grad", "weight_grad"):
        assert (figures[f"flops_{kind}"], figures[f"flops_{kind}_dense"]) == (5400, 5400), kind
    executor.remove()
    conv(x).sum().backward()  # the hook left with the executor
    assert executor.stats.end_step()["flops_forward"] == 0


def test_gpt2_conv1d_runs_dense_on_the_device_with_dense_statistics() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()  # no dropout: outputs comparable
    model.apply(Static(sparsity=0.8))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with on_wse(model) as executor, torch.no_grad():
            logits = model(ids).logits
    warned = [str(w.message) for w in caught if "lightning_sparse.wse" in str(w.message)]
    assert len(warned) == 4 and all("(Conv1D)" in w and "no saving" in w for w in warned)
    torch.testing.assert_close(logits, expected)
    figures = executor.stats.end_step()
    # 16 tokens through c_attn (32x96), attn c_proj (32x32), c_fc (32x128), mlp c_proj (128x32)
    conv1d = 2 * 16 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32)
    lm_head = 2 * 16 * 32 * 128  # an unmasked nn.Linear: dense too
    assert figures["flops_forward"] == figures["flops_forward_dense"] == conv1d + lm_head
