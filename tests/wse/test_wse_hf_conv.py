"""Convolutions on the WSE device. Hugging Face's GPT-2 ``Conv1D`` (weight ``[in, out]``) runs
in CSR like an ``nn.Linear``: same outputs and gradients as masked dense (weight gradient
``[in, out]``, zero where pruned), sparse FLOP statistics, the inference fast path, and RigL
training identical to the CPU. A masked ``Conv2d`` runs dense, says so once, and records its
FLOPs as dense (executed = dense equivalent): no saving claimed for it."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse import RigL, Static
from lightning_sparse.wse import install_executor, on_wse
from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.kernels import compiled_available
from lightning_sparse.wse.layer import STATE as _STATE
from tests.helpers import full_state, mask_buffers

PATH = "compiled" if compiled_available() else "torch"


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


def _gpt2(transformers: object) -> nn.Module:
    config = transformers.GPT2Config(  # type: ignore[attr-defined]
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().eval()  # type: ignore[attr-defined]


def _fwd_bwd(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Logits, input gradient and every weight gradient of one weighted-sum loss."""
    x = x.clone().requires_grad_()
    model.zero_grad()
    logits = model(inputs_embeds=x).logits
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    return logits.detach(), x.grad, *(p.grad for p in model.parameters())


@pytest.mark.parametrize("path", sorted({PATH, "torch", "dense"}))
def test_gpt2_conv1d_runs_in_csr_equal_to_masked_dense(path: str) -> None:
    transformers = pytest.importorskip("transformers")
    conv1d_class = transformers.pytorch_utils.Conv1D
    model = _gpt2(transformers)
    model.apply(Static(sparsity=0.8))  # the 8 Conv1D weights; the tied lm_head stays dense
    x = torch.randn(2, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = _fwd_bwd(model, x)  # masked dense: the algorithm zeroes pruned gradients
    convs = [m for m in model.modules() if isinstance(m, conv1d_class)]
    assert len(convs) == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs dense" warning
        with on_wse(model, path=path) as executor:
            assert all(type(m) is not conv1d_class and m in executor.layers for m in convs)
            got = _fwd_bwd(model, x)
            figures = executor.stats.end_step()
            copied = copy.deepcopy(model)
            restored = pickle.loads(pickle.dumps(model))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert a.stride() == b.stride()  # the weight gradient arrives [in, out]
    for m in convs:
        assert type(m) is conv1d_class  # removed with the executor
        pruned = m.weight.grad[~m.weight_mask]
        assert torch.equal(pruned, torch.zeros_like(pruned))
    for other in (copied, restored):  # copies are plain Conv1D layers
        assert {type(m) for m in other.modules() if isinstance(m, conv1d_class)} == {conv1d_class}
    # 16 tokens; the Conv1D layers run their kept weights, the unmasked lm_head (32x64) dense.
    dense = sum(m.weight.numel() for m in convs)
    kept = dense if path == "dense" else sum(int(m.weight_mask.sum()) for m in convs)
    assert path == "dense" or kept < dense // 4  # 80% sparse: the kept weights only
    lm_head = 2 * 16 * 32 * 64
    assert figures["flops_forward"] == 2 * 16 * kept + lm_head
    assert figures["flops_forward_dense"] == 2 * 16 * dense + lm_head
    assert figures["flops_weight_grad"] == 2 * 16 * kept + lm_head


@pytest.mark.parametrize("path", sorted({PATH, "torch", "dense"}))
def test_conv1d_inference_follows_every_change_of_weight_and_mask(path: str) -> None:
    """Without autograd the device caches values and runners keyed on the real ``[in, out]``
    weight and mask buffer (not on their per-call ``.t()`` views); every write must show."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    layer = transformers.pytorch_utils.Conv1D(10, 12)  # nf=out 10, nx=in 12: weight [12, 10]
    layer.apply(Static(0.7, param_filter="weight"))
    mask = layer.weight_mask

    def expected(x: torch.Tensor) -> torch.Tensor:
        return x @ (layer.weight * layer.weight_mask) + layer.bias

    with on_wse(layer, path=path) as executor, torch.no_grad():
        x = torch.randn(3, 12)
        torch.testing.assert_close(layer(x), expected(x))
        one = x[:1]  # one token: the decode kernel on the compiled path
        torch.testing.assert_close(layer(one), expected(one))
        fast = _STATE[layer].fast
        assert fast is not None and fast(layer, one) is not None  # the fast path serves it
        layer.weight.mul_(2.0)
        assert fast(layer, one) is None  # the weight moved: run() rebuilds
        torch.testing.assert_close(layer(one), expected(one))
        torch.testing.assert_close(layer(x), expected(x))
        mask.copy_(torch.rand(12, 10) < 0.5)
        torch.testing.assert_close(layer(x), expected(x))
        layer.load_state_dict({**layer.state_dict(), "weight": torch.randn(12, 10)})
        torch.testing.assert_close(layer(one), expected(one))
        executor.stats.end_step()
        layer(x)
        executed = mask.numel() if path == "dense" else int(mask.sum())  # dense runs them all
        assert executor.stats.end_step()["flops_forward"] == 2 * 3 * executed


def test_unmasked_conv1d_on_the_device_is_bit_identical() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    layer = transformers.pytorch_utils.Conv1D(96, 32)
    x = torch.randn(2, 8, 32, requires_grad=True)
    runs = []
    for on_device in (False, True):
        x.grad = layer.weight.grad = None
        with on_wse(layer) if on_device else warnings.catch_warnings():
            y = layer(x)
            y.square().sum().backward()
        runs.append((y.detach(), x.grad, layer.weight.grad))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("compiled", [True, False] if compiled_available() else [False])
def test_gather_from_a_transposed_view_equals_gather_from_a_copy(compiled: bool) -> None:
    """`CSRWeight` of a ``[in, out]`` weight's ``.t()`` view: values read in place (the native
    gather walks the contiguous weight by columns) equal those read from a contiguous copy."""
    torch.manual_seed(0)
    v = torch.randn(7, 5, dtype=torch.float64)  # a Conv1D weight [in, out]
    mask = torch.rand(7, 5) < 0.4
    csr = CSRWeight.from_dense(v.t(), mask.t(), compiled=compiled)
    w = v.t().contiguous()
    assert torch.equal(csr.gather_values(v.t()), w.reshape(-1)[csr.flat_indices()])


def test_gpt2_generation_on_the_device_equals_masked_dense() -> None:
    transformers = pytest.importorskip("transformers")
    model = _gpt2(transformers).float()
    model.apply(Static(sparsity=0.9))
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True)
    with torch.no_grad():
        expected = model.generate(prompt, **kwargs, return_dict_in_generate=True)
        with on_wse(model, path=PATH) as executor:
            got = model.generate(prompt, **kwargs, return_dict_in_generate=True)
            figures = executor.stats.end_step()
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert figures["flops_forward"] < figures["flops_forward_dense"]


def test_gpt2_rigl_training_on_the_device_equals_the_cpu() -> None:
    """A few AdamW steps with RigL (updates every 2 steps, so dense gradients on update steps):
    same masks bit for bit, same weights to float64 rounding, pruned weights exactly 0."""
    transformers = pytest.importorskip("transformers")
    runs = []
    for on_device in (False, True):
        model = _gpt2(transformers).train()
        model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        rigl = RigL(0.8, update={"freq": 2}, drop_fraction=0.5, seed=1)
        model.apply(rigl)
        initial = mask_buffers(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rigl.apply(optimizer)
        executor = install_executor(model, path=PATH) if on_device else None
        for step in range(5):
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            logits = model(ids).logits
            F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
            optimizer.step()
        if executor is not None:
            assert len(executor.layers) == 9  # 8 Conv1D + lm_head
            executor.remove()
        runs.append(full_state(model))
        assert any(not torch.equal(v, runs[-1][k]) for k, v in initial.items())  # RigL moved
    cpu, wse = runs
    assert cpu.keys() == wse.keys()
    for key, value in cpu.items():
        if key.endswith("_mask"):
            assert torch.equal(wse[key], value), key
            weight = wse[key[: -len("_mask")]]
            assert torch.equal(weight[~value], torch.zeros_like(weight[~value])), key
        else:
            torch.testing.assert_close(wse[key], value, rtol=1e-9, atol=1e-12, msg=key)
