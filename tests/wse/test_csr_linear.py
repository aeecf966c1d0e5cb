"""`CSRLinear`: a layer held only in CSR equals the dense layer of its nonzeros, on every token
count, from a packed bitmask and from a dense weight, ``[out, in]`` and ``Conv1D``'s ``[in, out]``;
it holds 16-bit columns and no int32 copy; corrupt inputs are refused with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse import Static
from lightning_sparse.wse import csr_linear, native, on_wse
from lightning_sparse.wse.csr_linear import CSRLinear, runs_in_csr, unpack_bitmask
from tests.helpers import one_thread  # noqa: F401  (autouse: one torch thread)

COMPILED = native.compiled_available()


def pack(mask: torch.Tensor) -> torch.Tensor:
    """Little-bit-order packing, written independently of the code under test."""
    rows, cols = mask.shape
    padded = torch.zeros(rows, (cols + 7) // 8 * 8, dtype=torch.uint8)
    padded[:, :cols] = mask.to(torch.uint8)
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)
    return (padded.view(rows, -1, 8) * weights).sum(-1).to(torch.uint8)


def sparse_weight(shape: tuple[int, int], density: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    return (w * (torch.rand(shape, generator=g) < density)).float()


@pytest.mark.parametrize(
    "shape", [(7, 5), (33, 130), (40, 40000), (6, 70001)], ids=["tiny", "odd", "u16-high", "i32"]
)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_bitmask_and_dense_builds_equal_the_dense_layer(
    shape: tuple[int, int], transposed: bool
) -> None:
    weight = sparse_weight(shape, 0.1)  # [out, in]
    bias = torch.randn(shape[0])
    stored = weight.t().contiguous() if transposed else weight  # what a file holds
    kept = stored != 0
    layers = [
        CSRLinear.from_bitmask(
            tuple(stored.shape), pack(kept), stored[kept], bias, transposed=transposed,
            row_offsets=kept.sum(1).cumsum(0) - kept.sum(1),
        ),
        CSRLinear.from_dense(stored, bias, transposed=transposed),
    ]  # fmt: skip
    reference = nn.Linear(shape[1], shape[0]).double()
    with torch.no_grad():
        reference.weight.copy_(weight.double())
        reference.bias.copy_(bias.double())
    for layer in layers:
        assert (layer.out_features, layer.in_features, layer.nnz) == (*shape, int(kept.sum()))
        expected_columns = torch.int16 if shape[1] <= 65536 else torch.int32
        assert layer.col_indices.dtype == expected_columns
        for tokens in (1, 3):
            x = torch.randn(2, tokens, shape[1], generator=torch.Generator().manual_seed(tokens))
            with torch.no_grad():
                y = layer(x)
            # float32 sums of up to 7,000 unit products: rounding grows as sqrt(terms) (1e-4 at
            # 3,000 or fewer kept per row; was exceeded at 7,000 by an unseeded input).
            atol = 1e-4 * max(1.0, (0.1 * shape[1] / 3000) ** 0.5)
            torch.testing.assert_close(y.double(), reference(x.double()), rtol=1e-4, atol=atol)


def test_it_equals_the_executor_bit_for_bit_and_holds_no_int32_column_copy() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 80)
    linear.apply(Static(0.9))
    with torch.no_grad():
        linear.weight.mul_(linear.weight_mask)
    layer = CSRLinear.from_dense(linear.weight, linear.bias)
    for tokens in (1, 5):
        x = torch.randn(tokens, 96)
        with torch.no_grad(), on_wse(linear, path="compiled" if COMPILED else "torch"):
            expected = linear(x)
        with torch.no_grad():
            assert torch.equal(layer(x), expected)
    nnz = layer.nnz
    assert layer.nbytes == nnz * (4 + 2) + 4 * (80 + 1) + 4 * 80
    # What the runner keeps alive is the layer's own buffers: no widened or int32 copy.
    held = {t.data_ptr() for t in layer.buffers()}
    kept = [t for t in _tensors(layer._runner.keep) if t.numel() == nnz]
    assert kept and all(t.data_ptr() in held for t in kept)


def _tensors(obj: object) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("compiled", [pytest.param(True, marks=pytest.mark.skipif(not COMPILED,
    reason="native kernels unavailable")), False], ids=["compiled", "torch"])  # fmt: skip
def test_16_bit_columns_serve_every_dtype_and_path(
    dtype: torch.dtype, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16-bit columns are held for float64 values too and without the native library: every
    compiled kernel reads them, the "torch" path widens them per call."""
    if not compiled:
        monkeypatch.setattr(native, "library", lambda: (None, "disabled in this test"))
    weight = sparse_weight((33, 130), 0.2).to(dtype)
    bias = torch.randn(33, dtype=dtype)
    layer = CSRLinear.from_dense(weight, bias)
    assert layer.col_indices.dtype == torch.int16 and layer.values.dtype == dtype
    for tokens in (1, 4):
        x = torch.randn(tokens, 130, dtype=dtype)
        with torch.no_grad():
            y = layer(x)
        assert y.dtype == dtype
        expected = F.linear(x.double(), weight.double(), bias.double())
        tolerance = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not COMPILED, reason="bf16 storage runs on the compiled kernels")
def test_bfloat16_storage_computes_with_the_rounded_values() -> None:
    weight = sparse_weight((64, 48), 0.1)
    layer = CSRLinear.from_dense(weight, value_dtype=torch.bfloat16)
    assert layer.values.dtype == torch.bfloat16 and layer.compute_dtype == torch.float32
    rounded = weight.to(torch.bfloat16).float()
    for tokens in (1, 4):
        x = torch.randn(tokens, 48)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, rounded), rtol=1e-5, atol=1e-5)


def test_unpack_bitmask_inverts_packing() -> None:
    mask = torch.rand(9, 21) < 0.3
    assert torch.equal(unpack_bitmask(pack(mask), (9, 21)), mask)


def test_corrupt_inputs_are_refused_with_the_reason() -> None:
    weight = sparse_weight((8, 12), 0.3)
    kept = weight != 0
    with pytest.raises(
        ValueError, match=r"bitmask must be uint8 \[8, 2\].*got torch.uint8 \[8, 1\]"
    ):
        CSRLinear.from_bitmask((8, 12), pack(kept)[:, :1], weight[kept])
    with pytest.raises(ValueError, match="different weights"):
        CSRLinear.from_bitmask((8, 12), pack(kept), weight[kept][:-1])
    with pytest.raises(ValueError, match="different weights"):
        CSRLinear.from_bitmask((8, 12), pack(kept), torch.cat([weight[kept], weight[kept]]))
    with pytest.raises(ValueError, match="row_offsets .* disagree"):
        CSRLinear.from_bitmask(
            (8, 12), pack(kept), weight[kept], row_offsets=torch.zeros(8, dtype=torch.int64)
        )
    layer = CSRLinear.from_dense(weight)
    with pytest.raises(
        ValueError, match=r"takes torch.float32 \[..., 12\] inputs, got torch.float64"
    ):
        layer(torch.randn(1, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match="inference-only"):
        layer(torch.randn(1, 12, requires_grad=True))


def test_the_block_size_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = sparse_weight((50, 30), 0.2)
    kept = weight != 0
    whole = CSRLinear.from_bitmask((50, 30), pack(kept), weight[kept])
    monkeypatch.setattr(csr_linear, "BLOCK", 64)  # two rows per block
    blocked = CSRLinear.from_bitmask((50, 30), pack(kept), weight[kept])
    for name in ("crow_indices", "col_indices", "values"):
        assert torch.equal(getattr(whole, name), getattr(blocked, name))


def test_csr_is_chosen_where_decode_pays() -> None:
    numel = 1024 * 1024
    assert runs_in_csr((1024, 1024), int(0.1 * numel), 4)  # 90% sparse
    assert not runs_in_csr((1024, 1024), int(0.5 * numel), 4)  # 50%: dense decodes faster


def test_a_dtype_change_rebuilds_the_runner() -> None:
    weight = sparse_weight((4, 70001), 0.01)  # int32 columns: float64 can run on them
    layer = CSRLinear.from_dense(weight)
    x = torch.randn(2, 70001, dtype=torch.float64)
    with torch.no_grad():
        layer(x.float())
        layer.double()  # replaces the value buffer the first runner pointed into
        torch.testing.assert_close(layer(x), F.linear(x, weight.double()), rtol=1e-9, atol=1e-9)
