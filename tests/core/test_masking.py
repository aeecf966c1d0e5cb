"""Zeroing and filling pruned positions (`lightning_sparse.core.masking`, `core.fused_mask`),
each rule checked for every float dtype and for lists that mix what the bit views allow with
what they do not, on the CPU's path and the GPU's (the fused kernel, compiled here for the CPU).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from benchmarks.step_ops import OpCounter, as_on_a_gpu
from lightning_sparse.core.masking import fill_pruned_foreach_, zero_pruned_, zero_pruned_foreach_
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
PATHS = ["cpu-path", "gpu-path"]
SPECIAL = [float("nan"), float("inf"), float("-inf"), -0.0, 3.5]


class Tagged(torch.Tensor):
    """A tensor subclass: no bit view is taken of it (`masking._bits`)."""


def path(name: str) -> contextlib.AbstractContextManager[None]:
    return as_on_a_gpu() if name == "gpu-path" else contextlib.nullcontext()


def case(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor holding NaN, inf, -inf, -0.0 and ordinary values, and a random mask."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype)
    flat = t.view(-1)
    for i, value in enumerate(SPECIAL):
        flat[i] = value
        flat[-1 - i] = value
    mask = torch.rand(shape, generator=g) > 0.5
    mask.view(-1)[: len(SPECIAL)] = False  # the specials pruned at the front, kept at the back
    mask.view(-1)[-len(SPECIAL) :] = True
    return t, mask


def assert_zeroed(t: torch.Tensor, before: torch.Tensor, mask: torch.Tensor) -> None:
    """+0.0 (bit pattern 0) where pruned; bit for bit unchanged where kept."""
    plain = t.as_subclass(torch.Tensor)
    if plain.is_complex():
        plain, before = torch.view_as_real(plain), torch.view_as_real(before)
        mask = mask.unsqueeze(-1).expand_as(plain)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[plain.element_size()]
    assert bool((plain.view(bits)[~mask] == 0).all()), "a pruned entry is not +0.0"
    assert torch.equal(plain.view(bits)[mask], before.view(bits)[mask]), "a kept entry changed"


@pytest.mark.parametrize("where", PATHS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_zero_pruned_foreach_gives_plus_zero_at_pruned_nan_inf_included(
    dtype: torch.dtype, where: str
) -> None:
    pairs = [case(dtype, shape, seed) for seed, shape in enumerate([(6, 5), (4, 9), (6, 5)])]
    befores = [t.clone() for t, _ in pairs]
    with path(where):
        zero_pruned_foreach_([t for t, _ in pairs], [m for _, m in pairs])
    for (t, mask), before in zip(pairs, befores, strict=True):
        assert_zeroed(t, before, mask)


@pytest.mark.parametrize("where", PATHS)
@pytest.mark.parametrize("other", ["complex64", "subclass", "float64"])
def test_zero_pruned_foreach_on_a_mixed_list_zeroes_each_tensor_by_its_own_mask(
    other: str, where: str
) -> None:
    """A list where some tensors have no bit view (complex, a subclass) or another dtype: each
    is zeroed by its own mask, whatever its place in the list."""
    first, first_mask = case(torch.float32, (5, 7), 0)
    if other == "complex64":
        real, _ = case(torch.float32, (5, 7), 1)
        odd = torch.complex(real, real.flip(0))
    elif other == "subclass":
        odd = case(torch.float32, (5, 7), 1)[0].as_subclass(Tagged)
    else:
        odd = case(torch.float64, (5, 7), 1)[0]
    odd_mask = ~first_mask  # a different mask: a mix-up shows
    last, last_mask = case(torch.float32, (5, 7), 2)
    tensors, masks = [first, odd, last], [first_mask, odd_mask, last_mask]
    befores = [t.as_subclass(torch.Tensor).clone() for t in tensors]
    with path(where):
        zero_pruned_foreach_(tensors, masks)
    for t, mask, before in zip(tensors, masks, befores, strict=True):
        assert_zeroed(t, before, mask)
    assert type(odd) is (Tagged if other == "subclass" else torch.Tensor)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_zero_pruned_single_tensor(dtype: torch.dtype) -> None:
    t, mask = case(dtype, (3, 11), 4)
    before = t.clone()
    zero_pruned_(t, mask)
    assert_zeroed(t, before, mask)


@pytest.mark.parametrize("value", [1.0, 0.25])
def test_fill_pruned_foreach_writes_the_value_in_every_dtype(value: float) -> None:
    """Pruned entries (exact +0.0) become exactly ``value`` in each dtype of one call: the bit
    pattern added is that dtype's own (float32's pattern would give fp16/bf16 0 and float64
    a denormal)."""
    tensors, masks, befores = [], [], []
    for seed, dtype in enumerate(FLOATS):
        t = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)).to(dtype)
        mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(10 + seed)) > 0.5
        zero_pruned_(t, mask)
        tensors.append(t)
        masks.append(mask)
        befores.append(t.clone())
    tensors.append(torch.zeros(2, 3, dtype=torch.complex64))  # no bit view: masked_fill_
    masks.append(torch.tensor([[True, False, False], [False, True, False]]))
    befores.append(tensors[-1].clone())
    fill_pruned_foreach_(tensors, masks, value)
    for t, mask, before in zip(tensors, masks, befores, strict=True):
        assert bool((t[~mask] == value).all()), t.dtype
        assert torch.equal(t[mask], before[mask]), t.dtype


def test_the_gpu_path_prunes_a_list_in_one_op_with_no_copy_of_a_mask() -> None:
    """On a GPU the product over all tensors is one kernel (`fused_mask.mul_by_masks_`), the bool
    masks cast inside it: no integer copy of a mask is made (``_to_copy``), kept or not."""
    pairs = [case(torch.float32, (8, 8), seed) for seed in range(5)]
    pairs += [case(torch.bfloat16, (4, 8), seed) for seed in range(5, 8)]
    with as_on_a_gpu(), OpCounter() as counter:
        zero_pruned_foreach_([t for t, _ in pairs], [m for _, m in pairs])
    assert dict(counter.counts.kernels) == {"mul_by_masks_": 1}


def test_the_compiled_product_covers_every_chunk_of_a_long_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A list longer than `fused_mask.CHUNK` is compiled in chunks: every tensor of every chunk
    and of the remainder is pruned, the bits of each kept entry unchanged."""
    from lightning_sparse.core import fused_mask

    monkeypatch.setattr(fused_mask, "CHUNK", 3)
    pairs = [case(torch.float32, (4 + seed, 6), seed) for seed in range(8)]  # 3 + 3 + 2
    befores = [t.clone() for t, _ in pairs]
    fused_mask.mul_by_masks_([t.view(torch.int32) for t, _ in pairs], [m for _, m in pairs])
    assert not fused_mask._broken
    for (t, mask), before in zip(pairs, befores, strict=True):
        assert_zeroed(t, before, mask)


def test_the_compiled_product_does_not_compile_again_for_other_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sizes are symbols, none assumed equal to another because it was on the first call
    (``use_duck_shape=False``): lists of the same chunk lengths and dtypes, square weights
    or not, sizes equal or not, reuse the kernels compiled for the first."""
    from torch._dynamo.utils import counters

    from lightning_sparse.core import fused_mask

    monkeypatch.setattr(fused_mask, "CHUNK", 4)

    def prune(shapes: list[tuple[int, int]], seed: int) -> None:
        pairs = [case(torch.float32, shape, seed + i) for i, shape in enumerate(shapes)]
        views = [t.view(torch.int32) for t, _ in pairs]
        fused_mask.mul_by_masks_(views, [m for _, m in pairs])

    prune([(8, 8), (8, 8), (16, 8), (8, 16), (6, 6), (8, 8)], seed=0)  # chunks of 4 and 2
    before = counters["stats"]["unique_graphs"]
    prune([(8, 12), (10, 8), (12, 12), (7, 9), (9, 9), (14, 10)], seed=10)
    prune([(20, 20), (20, 20), (20, 20), (20, 20), (5, 7), (7, 5)], seed=20)
    assert counters["stats"]["unique_graphs"] == before


def test_a_compilation_failure_falls_back_to_the_exact_product_per_tensor(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend failure on the second chunk, after the first was pruned: every tensor is still
    pruned exactly (the first chunk again, by the same 0/1 masks), one warning says so, and the
    process prunes per tensor from then on."""
    from lightning_sparse.core import fused_mask

    calls: list[int] = []

    def second_fails(views: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        calls.append(len(views))
        if len(calls) == 2:
            raise RuntimeError("no C++ compiler\nmore detail")
        fused_mask._product(views, masks)

    monkeypatch.setattr(fused_mask, "CHUNK", 2)
    monkeypatch.setattr(fused_mask, "_compiled", second_fails)
    monkeypatch.setattr(fused_mask, "_broken", False)
    pairs = [case(torch.float32, (5, 6), seed) for seed in range(5)]
    befores = [t.clone() for t, _ in pairs]
    with caplog.at_level("WARNING", logger="lightning_sparse"):
        fused_mask.mul_by_masks_([t.view(torch.int32) for t, _ in pairs], [m for _, m in pairs])
    assert calls == [2, 2] and fused_mask._broken
    for (t, mask), before in zip(pairs, befores, strict=True):
        assert_zeroed(t, before, mask)
    assert [r.getMessage() for r in caplog.records] == [
        "lightning_sparse: the fused pruning kernel could not be compiled (RuntimeError: no C++ "
        "compiler); pruning runs one kernel per tensor instead (correct, slower on a GPU)"
    ]
    again = [case(torch.float32, (3, 3), 9)]
    fused_mask.mul_by_masks_([t.view(torch.int32) for t, _ in again], [m for _, m in again])
    assert calls == [2, 2]  # not compiled again
