"""Tests for lightning_sparse.core.distributions: uniform, ER, ERK and global magnitude."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse.core.distributions import (
    DISTRIBUTIONS,
    er,
    erk,
    global_magnitude,
    make_distribution,
    uniform,
)

FAST = settings(max_examples=50, deadline=None)
CNN = {
    "conv1.weight": torch.Size([16, 3, 3, 3]),
    "conv2.weight": torch.Size([32, 16, 3, 3]),
    "fc1.weight": torch.Size([128, 512]),
    "fc2.weight": torch.Size([10, 128]),
}


def reference_erk(shapes: dict[str, torch.Size], sparsity: float, power: float = 1.0) -> dict:
    """Water-filling by bisection: density_l = min(1, eps * raw_l), kept total = target."""
    raw = {k: (sum(s) / math.prod(s)) ** power for k, s in shapes.items()}
    numel = {k: math.prod(s) for k, s in shapes.items()}
    target = (1 - sparsity) * sum(numel.values())
    lo, hi = 0.0, 1.0 / min(raw.values())
    for _ in range(200):
        eps = (lo + hi) / 2
        kept = sum(min(1.0, eps * raw[k]) * numel[k] for k in shapes)
        lo, hi = (eps, hi) if kept < target else (lo, eps)
    return {k: 1.0 - min(1.0, lo * raw[k]) for k in shapes}


def weighted_sparsity(shapes: dict[str, torch.Size], sparsities: dict[str, float]) -> float:
    total = sum(math.prod(s) for s in shapes.values())
    return sum(sparsities[k] * math.prod(s) for k, s in shapes.items()) / total


def test_uniform() -> None:
    assert uniform(CNN, 0.8) == dict.fromkeys(CNN, 0.8)


def test_erk_hand_computed() -> None:
    # raw = 30/200 and 60/800; eps = 100 / (0.15 * 200 + 0.075 * 800) = 10/9.
    result = erk({"a": torch.Size([10, 20]), "b": torch.Size([20, 40])}, 0.9)
    assert result == pytest.approx({"a": 1 - 1 / 6, "b": 1 - 1 / 12})


def test_erk_dense_fallback() -> None:
    shapes = {"tiny": torch.Size([4, 4]), "big": torch.Size([1000, 1000])}
    result = erk(shapes, 0.5)
    assert result["tiny"] == 0.0
    assert weighted_sparsity(shapes, result) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("power", [0.5, 1.0])
def test_erk_matches_reference(sparsity: float, power: float) -> None:
    result = erk(CNN, sparsity, power_scale=power)
    assert result == pytest.approx(reference_erk(CNN, sparsity, power), abs=1e-9)
    assert weighted_sparsity(CNN, result) == pytest.approx(sparsity, abs=1e-12)


@FAST
@given(
    st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=4), min_size=1, max_size=6),
    st.floats(0, 0.999),
    st.sampled_from([er, erk]),
)
def test_weighted_sparsity_equals_target(dims: list, sparsity: float, fn: object) -> None:
    shapes = {f"l{i}": torch.Size(d) for i, d in enumerate(dims)}
    result = fn(shapes, sparsity)  # type: ignore[operator]
    assert set(result) == set(shapes)
    assert all(0.0 <= s < 1.0 for s in result.values())
    assert weighted_sparsity(shapes, result) == pytest.approx(sparsity, abs=1e-9)
    if fn is erk:
        assert result == pytest.approx(reference_erk(shapes, sparsity), abs=1e-7)


def test_er_ignores_kernel_dims() -> None:
    linear_only = {k: v for k, v in CNN.items() if k.startswith("fc")}
    assert er(linear_only, 0.9) == pytest.approx(erk(linear_only, 0.9))
    shapes = {"conv": torch.Size([64, 64, 3, 3]), "fc": torch.Size([64, 576])}
    # ER sees the conv as [64, 64]: raw 1/32 vs 640/36864 for fc, equal numel 36864, so
    # eps = 0.1 * 2 * 36864 / (1152 + 640) and densities are 0.9/7 and 0.5/7.
    assert er(shapes, 0.9) == pytest.approx({"conv": 1 - 0.9 / 7, "fc": 1 - 0.5 / 7})
    # ERK's kernel dims make the conv the sparser one.
    assert erk(shapes, 0.9)["conv"] > erk(shapes, 0.9)["fc"]


def test_power_scale_zero_is_uniform() -> None:
    assert erk(CNN, 0.7, power_scale=0.0) == pytest.approx(dict.fromkeys(CNN, 0.7))


def test_global_magnitude_hand_computed() -> None:
    weights = {"a": torch.tensor([[1.0, -5.0], [2.0, 0.0]]), "b": torch.tensor([2.0, -3.0, 2.0])}
    masks = global_magnitude(weights, 0.5)  # keep int(0.5 * 7) = 3: 5, 3, then the first 2
    assert masks["a"].tolist() == [[False, True], [True, False]]
    assert masks["b"].tolist() == [False, True, False]


@FAST
@given(st.lists(st.integers(1, 30), min_size=1, max_size=5), st.floats(0, 0.999))
def test_global_magnitude_exact_count(sizes: list[int], sparsity: float) -> None:
    gen = torch.Generator().manual_seed(sum(sizes))
    weights = {
        f"l{i}": torch.randint(-2, 3, (n,), generator=gen).float() for i, n in enumerate(sizes)
    }
    weights["l0"][0] = float("nan")
    masks = global_magnitude(weights, sparsity)
    assert sum(int(m.sum()) for m in masks.values()) == int((1 - sparsity) * sum(sizes))
    assert all(m.shape == weights[k].shape for k, m in masks.items())
    assert all(torch.equal(masks[k], m) for k, m in global_magnitude(weights, sparsity).items())


def test_registry_and_errors() -> None:
    assert make_distribution("erk") is erk
    assert set(DISTRIBUTIONS) == {"uniform", "er", "erk"}
    with pytest.raises(ValueError, match=r"'ERK2'.*\['er', 'erk', 'uniform'\]"):
        make_distribution("ERK2")
    with pytest.raises(ValueError, match=r"erk sparsity=1.0 must be in \[0, 1\)"):
        erk(CNN, 1.0)
    with pytest.raises(ValueError, match="power_scale.*got -1"):
        erk(CNN, 0.5, power_scale=-1)
    with pytest.raises(ValueError, match=r"uniform sparsity=-0.1 must be in \[0, 1\)"):
        uniform(CNN, -0.1)
