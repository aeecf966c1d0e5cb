"""Tests for lightning_sparse.core.shapers: views, round trips, balance and errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse.core.mask_ops import topk_mask
from lightning_sparse.core.shapers import (
    NM,
    Blocks,
    InputGroups,
    OutputGroups,
    Shaper,
    Unstructured,
)

FAST = settings(max_examples=40, deadline=None)


def select(score: torch.Tensor, shaper: Shaper, sparsity: float) -> torch.Tensor:
    rows = shaper.shape(score)
    return shaper.unshape(
        topk_mask(rows, shaper.keep_per_row(sparsity, rows.shape[-1])), score.shape
    )


@st.composite
def shaper_and_shape(draw: st.DrawFn) -> tuple[Shaper, tuple[int, ...]]:
    a, b, c = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["unstructured", "output", "input", "nm", "blocks"]))
    if kind == "unstructured":
        return Unstructured(), draw(st.sampled_from([(a,), (a, b), (a, b, c, c)]))
    if kind == "output":
        return OutputGroups(a), draw(st.sampled_from([(a * b,), (a * b, c), (a, b, c)]))
    if kind == "input":
        return InputGroups(a), (b, a * c)
    if kind == "nm":
        m = draw(st.integers(1, 4))
        return NM(draw(st.integers(1, m)), m), draw(st.sampled_from([(m * a,), (b, m * a, c)]))
    return Blocks(a, b), (a * c, b * 2)


@FAST
@given(shaper_and_shape())
def test_round_trip(case: tuple[Shaper, tuple[int, ...]]) -> None:
    shaper, shape = case
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    if isinstance(shaper, Blocks):
        # Blocks reduce; a block-uniform mask survives the round trip.
        block_mask = torch.arange(shaper.shape(t).numel()).reshape(1, -1) % 3 == 0
        t = shaper.unshape(block_mask, shape)
    rows = shaper.shape(t)
    assert rows.ndim == 2
    assert torch.equal(shaper.unshape(rows, shape), t)


def test_unstructured_and_output_groups_views() -> None:
    t = torch.arange(12).reshape(3, 4)
    assert torch.equal(Unstructured().shape(t), t.reshape(1, 12))
    assert torch.equal(OutputGroups(3).shape(t), t)
    assert torch.equal(OutputGroups(2).shape(t), t.reshape(2, 6))


def test_input_groups_hand_computed() -> None:
    t = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    # Row 0 holds input columns 0-1, row 1 columns 2-3, each read down the column.
    assert torch.equal(InputGroups(2).shape(t), torch.tensor([[0, 4, 1, 5], [2, 6, 3, 7]]))


def test_input_groups_balance_each_column_block() -> None:
    score = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    mask = select(score, InputGroups(4), 0.75)
    per_block = mask.reshape(8, 4, 4).sum((0, 2))
    assert per_block.tolist() == [8, 8, 8, 8]
    # Without the shaper the counts would differ for this score; the test can fail.
    assert select(score, Unstructured(), 0.75).reshape(8, 4, 4).sum((0, 2)).unique().numel() > 1


def test_output_groups_balance_each_row_block() -> None:
    mask = select(
        torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), OutputGroups(3), 0.5
    )
    assert mask.reshape(3, 10).sum(-1).tolist() == [5, 5, 5]


@pytest.mark.parametrize("shape", [(4, 8), (3, 8, 2, 2), (16,)])
def test_nm_two_four_keeps_two_of_every_four_inputs(shape: tuple[int, ...]) -> None:
    score = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    mask = select(score, NM(2, 4), sparsity=0.9)  # N:M ignores the sparsity
    along_inputs = mask.movedim(1, -1) if mask.ndim > 1 else mask
    assert (along_inputs.reshape(-1, 4).sum(-1) == 2).all()
    assert mask.sum().item() == score.numel() // 2


def test_nm_hand_computed() -> None:
    score = torch.tensor([[4.0, 1.0, 3.0, 2.0, 0.0, 0.0, 9.0, 8.0]])
    expected = torch.tensor([[True, False, True, False, False, False, True, True]])
    assert torch.equal(select(score, NM(2, 4), 0.5), expected)


def test_blocks_sum_and_expand() -> None:
    t = torch.arange(16.0).reshape(4, 4)
    assert Blocks(2, 2).shape(t).tolist() == [[10.0, 18.0, 42.0, 50.0]]
    block_mask = torch.tensor([[True, False, False, True]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]).bool()
    assert torch.equal(Blocks(2, 2).unshape(block_mask, (4, 4)), expected)
    mask = select(t, Blocks(2, 2), 0.5)
    assert torch.equal(mask, torch.tensor([[0, 0, 0, 0]] * 2 + [[1, 1, 1, 1]] * 2).bool())


def test_keep_per_row() -> None:
    assert Unstructured().keep_per_row(0.75, 10) == 2
    assert OutputGroups(2).keep_per_row(0.0, 7) == 7
    assert NM(2, 4).keep_per_row(0.1, 4) == 2


def test_repr_equality_and_purity() -> None:
    assert repr(NM(2, 4)) == "NM(n=2, m=4)"
    assert repr(Blocks(1, 4)) == "Blocks(h=1, w=4)"
    assert OutputGroups(3) == OutputGroups(3) != InputGroups(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        OutputGroups(3).groups = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("shaper", "shape", "message"),
    [
        (OutputGroups(5), (3, 4), r"OutputGroups\(groups=5\).*\(3, 4\).*12.*divisible by 5"),
        (InputGroups(5), (3, 4), r"InputGroups\(groups=5\).*\(3, 4\).*divisible by 5"),
        (InputGroups(2), (2, 3, 4), r"2-D.*\(2, 3, 4\)"),
        (NM(2, 4), (4, 6), r"NM\(n=2, m=4\).*\(4, 6\).*dim 1 \(6\).*divisible by 4"),
        (Blocks(2, 3), (4, 4), r"Blocks\(h=2, w=3\).*\(4, 4\).*input dim \(4\).*divisible by 3"),
        (Blocks(2, 2), (4,), r"2-D.*\(4,\)"),
    ],
)
def test_shape_errors_name_shape_groups_and_fix(
    shaper: Shaper, shape: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        shaper.shape(torch.zeros(shape))
    with pytest.raises(ValueError, match="weight.qkv"):
        shaper.check(shape, name="weight.qkv")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: OutputGroups(0), "OutputGroups groups must be >= 1, got 0; pass a positive int"),
        (lambda: NM(5, 4), r"n must be an int in \[1, m=4\], got 5"),
        (lambda: Blocks(2, -1), "Blocks w must be >= 1, got -1"),
    ],
)
def test_constructor_errors(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
    with pytest.raises(TypeError, match=r"InputGroups groups must be an int, got 2.0"):
        InputGroups(2.0)  # type: ignore[arg-type]
