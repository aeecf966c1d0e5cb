"""Tests for lightning_sparse.core.init_methods and lightning_sparse.core.rng."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse.core.init_methods import (
    INIT_METHODS,
    checkerboard,
    from_zeros,
    make_init_method,
    random,
    topk,
)
from lightning_sparse.core.rng import generator_for, stable_seed
from lightning_sparse.core.shapers import NM, Blocks, InputGroups, OutputGroups, Unstructured

FAST = settings(max_examples=40, deadline=None)
SHAPERS = [None, OutputGroups(2), InputGroups(2), NM(1, 2), Blocks(2, 2)]


def test_stable_seed_is_pinned_and_63_bit() -> None:
    # Pinned: a change would silently alter every resumed run's random choices.
    assert stable_seed(0, 0, "w") == 1634474940241666786
    assert stable_seed(1234, 5, "layers.0.weight") == 682256056066882928
    seeds = {stable_seed(s, t, n) for s in (0, 1) for t in (0, 1) for n in ("a", "b")}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(TypeError, match="'3'"):
        stable_seed("3", 0, "w")  # type: ignore[arg-type]


def test_generator_for_reproduces_the_stream() -> None:
    a = torch.rand(5, generator=generator_for(7, 3, "fc.weight"))
    b = torch.rand(5, generator=generator_for(7, 3, "fc.weight"))
    c = torch.rand(5, generator=generator_for(7, 4, "fc.weight"))
    assert torch.equal(a, b) and not torch.equal(a, c)


@FAST
@given(
    st.integers(1, 6),
    st.integers(1, 6),
    st.floats(0, 0.999),
    st.sampled_from(["random", "topk", "checkerboard"]),
    st.sampled_from(SHAPERS),
)
def test_exact_keep_count_per_shaper_row(
    a: int, b: int, sparsity: float, name: str, shaper: object
) -> None:
    p = torch.randn(2 * a, 2 * b, generator=torch.Generator().manual_seed(a * 7 + b))
    mask = INIT_METHODS[name](p, sparsity, generator=generator_for(0, 0, "p"), shaper=shaper)
    assert mask.dtype == torch.bool and mask.shape == p.shape
    shaper = shaper or Unstructured()
    rows = shaper.shape(mask.to(torch.int64) if not isinstance(shaper, Blocks) else mask)
    expected = shaper.keep_per_row(sparsity, rows.shape[-1])
    assert (rows.sum(-1) == expected).all()
    if isinstance(shaper, Blocks):  # whole blocks only
        assert torch.equal(shaper.unshape(rows, p.shape), mask)


def test_random_is_reproducible_and_keyed_by_name() -> None:
    p = torch.empty(40, 25)
    first = random(p, 0.9, generator=generator_for(1, 0, "a"))
    assert torch.equal(first, random(p, 0.9, generator=generator_for(1, 0, "a")))
    assert not torch.equal(first, random(p, 0.9, generator=generator_for(1, 0, "b")))
    # Keep counts truncate: int((1 - 0.9) * 1000) is 99 in floating point, as in Cerebras.
    assert first.sum().item() == int((1 - 0.9) * 1000) == 99


def test_topk_hand_computed() -> None:
    p = torch.tensor([[0.1, -3.0, 2.0, 0.5], [1.0, -1.0, 1.0, -1.0]])
    expected = torch.tensor([[False, True, True, False], [True, True, False, False]])
    assert torch.equal(topk(p, 0.5, shaper=OutputGroups(2)), expected)
    assert topk(p, 0.375).tolist() == [[False, True, True, False], [True, True, True, False]]


def test_from_zeros_ignores_sparsity() -> None:
    p = torch.tensor([[0.0, 1.0], [-2.0, 0.0]])
    assert torch.equal(from_zeros(p, 0.99), p != 0)


def test_checkerboard_hand_computed() -> None:
    board = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1]]).bool()
    assert torch.equal(checkerboard(torch.empty(4, 4), 0.5), board)
    diagonal = checkerboard(torch.empty(4, 8), 0.75)
    assert diagonal[0].nonzero().flatten().tolist() == [0, 4]
    assert diagonal.sum(0).tolist() == [1] * 8  # every column used once
    assert torch.equal(checkerboard(torch.empty(4, 8), 0.75), diagonal)


def test_make_init_method_names_and_errors() -> None:
    for name, fn in INIT_METHODS.items():
        assert make_init_method(name) is fn
    with pytest.raises(ValueError, match=r"'magnitude'.*\['checkerboard', 'from_zeros'"):
        make_init_method("magnitude")
    with pytest.raises(ValueError, match="must accept \\(p, sparsity\\)"):
        make_init_method(lambda p: p != 0)
    with pytest.raises(TypeError, match="got 3"):
        make_init_method(3)  # type: ignore[arg-type]


def test_make_init_method_adapts_user_callables() -> None:
    p = torch.tensor([0.0, 2.0, 3.0])

    def plain(p: torch.Tensor, sparsity: float) -> torch.Tensor:
        return p > sparsity

    def cerebras_style(p: torch.Tensor, sparsity: float, score_shaper=None, device=None):  # noqa: ANN001, ANN202
        return p > 2

    def full(p, sparsity, *, generator=None, shaper=None):  # noqa: ANN001, ANN202
        return p >= 0

    assert make_init_method(full) is full
    assert make_init_method(plain)(p, 1.0, generator=None, shaper=None).tolist() == [0, 1, 1]
    assert make_init_method(cerebras_style)(p, 0.5, shaper=Unstructured()).tolist() == [0, 0, 1]


@pytest.mark.parametrize("name", ["random", "topk", "checkerboard"])
def test_init_rejects_bad_sparsity(name: str) -> None:
    with pytest.raises(ValueError, match=r"init sparsity=1.5 must be in \[0, 1\)"):
        INIT_METHODS[name](torch.empty(4, 4), 1.5)
