"""Tests for lightning_sparse.core.mask_ops: top-k with deterministic ties, drop-and-grow."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse.core import mask_ops
from lightning_sparse.core.mask_ops import drop_and_grow, topk_mask

NAN, INF = float("nan"), float("inf")
FAST = settings(max_examples=60, deadline=None)


def _order(row: list[float]) -> list[int]:
    """Reference ranking: highest first, NaN as -inf, ties to the lower index."""
    return sorted(range(len(row)), key=lambda i: (-(-INF if math.isnan(row[i]) else row[i]), i))


def reference_topk(score: torch.Tensor, ks: list[int]) -> torch.Tensor:
    out = torch.zeros(score.shape, dtype=torch.bool)
    for g, (row, k) in enumerate(zip(score.tolist(), ks, strict=True)):
        out[g, _order(row)[:k]] = True
    return out


@st.composite
def scores_and_ks(draw: st.DrawFn) -> tuple[torch.Tensor, list[int]]:
    groups, n = draw(st.integers(1, 5)), draw(st.integers(1, 30))
    # Few distinct values force ties; NaN and infinities are in the mix.
    values = st.sampled_from([0.0, 1.0, 2.0, -1.0, NAN, INF, -INF])
    rows = [[draw(values) for _ in range(n)] for _ in range(groups)]
    ks = [draw(st.integers(0, n)) for _ in range(groups)]
    return torch.tensor(rows), ks


def test_topk_mask_hand_computed_ties_go_to_lower_index() -> None:
    score = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    expected = torch.tensor([[False, True, True, False], [True, True, False, False]])
    assert torch.equal(topk_mask(score, 2), expected)
    per_row = topk_mask(score, torch.tensor([1, 3]))
    assert torch.equal(
        per_row, torch.tensor([[False, True, False, False], [True, True, True, False]])
    )


def test_topk_mask_k_zero_and_k_n() -> None:
    score = torch.randn(3, 5)
    assert not topk_mask(score, 0).any()
    assert topk_mask(score, 5).all()
    assert torch.equal(topk_mask(score, torch.tensor([0, 5, 2])).sum(-1), torch.tensor([0, 5, 2]))


def test_topk_mask_nan_ranks_as_minus_inf() -> None:
    score = torch.tensor([[NAN, 0.0, -INF, 1.0]])
    assert torch.equal(topk_mask(score, 2), torch.tensor([[False, True, False, True]]))
    # NaN ties with -inf; the lower index wins.
    assert torch.equal(topk_mask(score, 3), torch.tensor([[True, True, False, True]]))
    assert torch.equal(topk_mask(torch.full((1, 3), NAN), 1), torch.tensor([[True, False, False]]))


@FAST
@given(scores_and_ks())
def test_topk_mask_matches_reference(case: tuple[torch.Tensor, list[int]]) -> None:
    score, ks = case
    expected = reference_topk(score, ks)
    assert torch.equal(topk_mask(score, torch.tensor(ks)), expected)
    for k in set(ks):
        assert torch.equal(topk_mask(score, k), reference_topk(score, [k] * len(ks)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.int32, torch.bool])
def test_topk_mask_dtypes(dtype: torch.dtype) -> None:
    score = torch.tensor([[0, 1, 1, 0, 1]]).to(dtype)
    assert torch.equal(topk_mask(score, 2), torch.tensor([[False, True, True, False, False]]))


def test_topk_mask_same_under_any_thread_count() -> None:
    gen = torch.Generator().manual_seed(0)
    score = torch.randint(0, 4, (3, 50_000), generator=gen).float()  # massive ties
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = topk_mask(score, 20_000), topk_mask(score, torch.tensor([1, 25_000, 49_999]))
        torch.set_num_threads(max(2, threads))
        multi = topk_mask(score, 20_000), topk_mask(score, torch.tensor([1, 25_000, 49_999]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single[0], multi[0]) and torch.equal(single[1], multi[1])
    assert torch.equal(single[0], topk_mask(score.clone(), 20_000))


def test_no_host_sync_works_on_meta_tensors() -> None:
    # Meta tensors hold no data, so any .item()/bool() sync would raise.
    score = torch.empty(4, 16, device="meta")
    mask = torch.empty(4, 16, device="meta", dtype=torch.bool)
    assert topk_mask(score, 5).device.type == "meta"
    assert topk_mask(score, 12).shape == (4, 16)
    assert drop_and_grow(score, score, mask, 2, 6).device.type == "meta"


def test_topk_mask_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="got 5"):
        topk_mask(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="got -1"):
        topk_mask(torch.zeros(2, 4), -1)
    with pytest.raises(TypeError, match="2.5"):
        topk_mask(torch.zeros(2, 4), 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0-d"):
        topk_mask(torch.tensor(1.0), 1)


def reference_drop_and_grow(
    drop: torch.Tensor, grow: torch.Tensor, mask: torch.Tensor, n_drop: int, n_total: int
) -> torch.Tensor:
    out = torch.zeros_like(mask)
    for g in range(mask.shape[0]):
        active = [i for i in _order(drop[g].tolist()) if mask[g, i]]
        kept = active[: max(len(active) - n_drop, 0)]
        candidates = [i for i in _order(grow[g].tolist()) if i not in kept]
        out[g, kept + candidates[: max(n_total - len(kept), 0)]] = True
    return out


def test_drop_and_grow_hand_computed() -> None:
    mask = torch.tensor([[True, True, False, False, True, False]])
    drop = torch.tensor([[3.0, 1.0, 0.0, 0.0, 2.0, 0.0]])
    grow = torch.tensor([[0.0, 0.0, 5.0, 1.0, 0.0, 4.0]])
    # Drop index 1 (weakest active); grow index 2 (strongest not kept).
    expected = torch.tensor([[True, False, True, False, True, False]])
    assert torch.equal(drop_and_grow(drop, grow, mask, 1, 3), expected)


def test_drop_and_grow_may_regrow_a_just_dropped_connection() -> None:
    mask = torch.tensor([[True, True, False, False]])
    drop = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    grow = torch.tensor([[0.0, 9.0, 1.0, 1.0]])  # index 1 is dropped, then grown back
    assert torch.equal(drop_and_grow(drop, grow, mask, 1, 2), mask)


def test_drop_and_grow_only_shrinks_while_denser_than_target() -> None:
    mask = torch.ones(1, 8, dtype=torch.bool)
    out = drop_and_grow(torch.arange(8.0).unsqueeze(0), torch.ones(1, 8), mask, 2, 4)
    assert torch.equal(out, torch.tensor([[False] * 2 + [True] * 6]))


def test_drop_and_grow_nan_never_crosses_the_mask() -> None:
    mask = torch.tensor([[True, True, False, False, False, False]])
    drop = torch.tensor([[NAN, NAN, 9.0, 9.0, 9.0, 9.0]])  # big scores only where inactive
    grow = torch.tensor([[9.0, NAN, NAN, NAN, NAN, NAN]])  # big score only where kept
    # Keep 0 (NaN ties, lower index); grow 2 of the NaN-scored rest, lower index first.
    out = drop_and_grow(drop, grow, mask, 1, 3)
    assert torch.equal(out, torch.tensor([[True, True, True, False, False, False]]))


# A seed, then the mask's density, the drop fraction and the target density, each in [0, 1].
SEED_AND_FRACTIONS = (st.integers(0, 2**31 - 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))


@FAST
@given(st.integers(1, 4), st.integers(1, 25), *SEED_AND_FRACTIONS)
def test_drop_and_grow_matches_reference(
    groups: int, n: int, seed: int, density: float, drop_frac: float, target: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(groups, n, generator=gen) < density
    drop = torch.randint(0, 3, (groups, n), generator=gen).float()  # ties
    grow = torch.randint(0, 3, (groups, n), generator=gen).float()
    n_drop, n_total = int(drop_frac * n), int(target * n)
    out = drop_and_grow(drop, grow, mask, n_drop, n_total)
    assert torch.equal(out, reference_drop_and_grow(drop, grow, mask, n_drop, n_total))
    active = mask.sum(-1)
    assert torch.equal(out.sum(-1), torch.clamp(active - n_drop, min=0).clamp(min=n_total))
    per_row = drop_and_grow(
        drop, grow, mask, torch.full((groups,), n_drop), torch.full((groups,), n_total)
    )
    assert torch.equal(per_row, out)


def test_drop_and_grow_errors() -> None:
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        drop_and_grow(torch.zeros(2, 4), torch.zeros(2, 3), mask, 1, 2)
    with pytest.raises(ValueError, match="float32"):
        drop_and_grow(torch.zeros(2, 4), torch.zeros(2, 4), mask.float(), 1, 2)
    with pytest.raises(ValueError, match="n_total.*got 5"):
        drop_and_grow(torch.zeros(2, 4), torch.zeros(2, 4), mask, 1, 5)


# ---------------------------------------------------------------- host (sampled) selection path
@contextlib.contextmanager
def host_select_min(n: int):
    """Route rows of at least ``n`` through the CPU sampled-selection path (default 2**14)."""
    saved = mask_ops.HOST_SELECT_MIN
    mask_ops.HOST_SELECT_MIN = n
    try:
        yield
    finally:
        mask_ops.HOST_SELECT_MIN = saved


@FAST
@given(scores_and_ks())
def test_host_path_topk_mask_matches_reference(case: tuple[torch.Tensor, list[int]]) -> None:
    score, ks = case
    row = score[:1]
    with host_select_min(1):
        for k in set(ks):
            assert torch.equal(topk_mask(row, k), reference_topk(row, [k]))


@FAST
@given(st.integers(1, 40), *SEED_AND_FRACTIONS)
def test_host_path_drop_and_grow_matches_reference(
    n: int, seed: int, density: float, drop_frac: float, target: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, n, generator=gen) < density
    values = torch.tensor([0.0, 1.0, 2.0, NAN, INF, -INF])
    drop = values[torch.randint(0, 6, (1, n), generator=gen)]  # ties, NaN and infinities
    grow = values[torch.randint(0, 6, (1, n), generator=gen)]
    n_drop, n_total = int(drop_frac * n), int(target * n)
    with host_select_min(1):
        out = drop_and_grow(drop, grow, mask, n_drop, n_total)
    assert torch.equal(out, reference_drop_and_grow(drop, grow, mask, n_drop, n_total))


def _long_rows(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Scores of one long row that stress the sample: ties, zeros, NaN/inf, order, columns."""
    special = torch.randn(1, n, generator=gen)
    r = torch.rand(1, n, generator=gen)
    special[r < 0.05] = NAN
    special[(r >= 0.05) & (r < 0.08)] = INF
    special[(r >= 0.08) & (r < 0.1)] = -INF
    zeros = torch.randn(1, n, generator=gen) * (torch.rand(1, n, generator=gen) < 0.1)
    columns = torch.randn(n // 256, 256, generator=gen) * torch.logspace(-3, 3, 256)
    return {
        "randn": torch.randn(1, n, generator=gen),
        "ties": torch.randint(0, 4, (1, n), generator=gen).float(),
        "special": special,
        "mostly zero": zeros,
        "ascending": torch.arange(n, dtype=torch.float32).unsqueeze(0),
        "constant": torch.ones(1, n),
        "column scales": columns.reshape(1, n),
    }


@pytest.mark.parametrize("density", [0.02, 0.2, 0.9])
def test_host_path_equals_sync_free_path_on_long_rows(density: float) -> None:
    gen = torch.Generator().manual_seed(7)
    n = 65 * 256  # a multiple of 256, just above the default HOST_SELECT_MIN
    rows = _long_rows(n, gen)
    mask = torch.rand(1, n, generator=gen) < density
    active = int(mask.sum())
    names = list(rows)
    for i, drop_name in enumerate(names):
        drop = rows[drop_name]
        for grow_name in (names[i], names[(i + 3) % len(names)]):
            grow = rows[grow_name]
            for n_drop, n_total in ((active - int(0.7 * active), int(0.2 * n)), (active, n // 2)):
                with host_select_min(n + 1):  # the sync-free torch.topk path
                    expected = drop_and_grow(drop, grow, mask, n_drop, n_total)
                got = drop_and_grow(drop, grow, mask, n_drop, n_total)
                assert torch.equal(got, expected), (drop_name, grow_name, n_drop, n_total)
        for k in (1, int(0.06 * n), n // 2, n - 1):
            with host_select_min(n + 1):
                expected = topk_mask(drop, k)
            assert torch.equal(topk_mask(drop, k), expected), (drop_name, k)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.bool, torch.bfloat16, torch.float16, torch.float64]
)
def test_host_path_topk_mask_dtypes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    score = torch.randint(0, 1000, (1, 20_000), generator=gen)
    score = (score + 2**60 if dtype == torch.int64 else score).to(dtype)  # beyond double's 2**53
    for k in (1, 777, 10_000, 19_999):
        with host_select_min(20_001):
            expected = topk_mask(score, k)
        with host_select_min(1):
            assert torch.equal(topk_mask(score, k), expected), (dtype, k)


def test_the_sampled_selection_takes_one_row_only() -> None:
    """`host_select` is for one CPU row: two long rows (of different scales, so a selection over
    both at once would take every kept score from one) each keep exactly ``k``."""
    n, k = mask_ops.HOST_SELECT_MIN, 100
    g = torch.Generator().manual_seed(0)
    one = torch.rand(1, n, generator=g)
    two = torch.cat([torch.rand(1, n, generator=g), torch.rand(1, n, generator=g) + 10])
    assert mask_ops.host_select(one) and not mask_ops.host_select(two)
    assert mask_ops.row_counts(topk_mask(two, k)).tolist() == [k, k]
    assert torch.equal(topk_mask(two, k), torch.cat([topk_mask(row, k) for row in two.split(1)]))
    scores = torch.cat([torch.rand(1, n, generator=g), torch.rand(1, n, generator=g) * 0.1])
    mask = torch.rand(2, n, generator=g) < 0.004  # about 65 kept per row, fewer than k
    kept = mask_ops.row_counts(drop_and_grow(scores, scores, mask, 10, k))
    assert kept.tolist() == [k, k]
