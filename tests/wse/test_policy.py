"""`wse/policy.py`'s rules at their boundaries, hand-computed: 16-bit columns (`narrow_columns`)
and the bytes rule of decode (`decode_forces_dense`), which asks `narrow_columns` for the width of
its column indices rather than writing the limit again."""

from __future__ import annotations

import pytest

from lightning_sparse.wse import policy


def test_sixteen_bit_columns_up_to_65536() -> None:
    assert policy.narrow_columns(1) and policy.narrow_columns(65536)
    assert not policy.narrow_columns(65537)


@pytest.mark.parametrize(("columns", "index_bytes"), [(65535, 2), (65536, 2), (65537, 4)])
def test_decode_counts_the_column_indices_narrow_columns_gives(
    columns: int, index_bytes: int
) -> None:
    """One row of ``columns`` fp32 weights: dense once values plus indices pass the ratio of the
    dense bytes, with 2-byte indices up to 65536 columns (both sides of the limit)."""
    ratio = policy.TUNED["decode_bytes_ratio"].value
    limit = ratio * columns * 4  # the dense row's bytes times the ratio
    most = int(limit // (4 + index_bytes))  # the most kept weights still served in CSR
    assert not policy.decode_forces_dense((1, columns), most, 4, 1, False)
    assert policy.decode_forces_dense((1, columns), most + 1, 4, 1, False)
    # A count between the 2-byte and 4-byte limits tells the widths apart at 65536.
    between = int(ratio * 65536 * 4 // 6)
    assert policy.decode_forces_dense((1, columns), between, 4, 1, False) is (index_bytes == 4)


def test_decode_rule_is_for_few_token_inference_only() -> None:
    few = policy.TUNED["few_tokens"].value
    assert not policy.decode_forces_dense((1, 64), 64, 4, few + 1, False)
    assert not policy.decode_forces_dense((1, 64), 64, 4, 1, True)
    assert policy.decode_forces_dense((1, 64), 64, 4, few, False)


@pytest.mark.parametrize(("l1d", "l2", "expected"), [
    (48 << 10, 2 << 20, (1 << 20, 1 << 20, 40 << 10)),    # the Intel Xeon (Sapphire Rapids)
    (32 << 10, 1 << 20, (512 << 10, 512 << 10, 27306)),   # the AMD EPYC (Zen 4): the old constants
    (None, None, (512 << 10, 512 << 10, 27306)),          # sysfs absent: the same defaults
    (64 << 10, None, (512 << 10, 512 << 10, 54613)),      # one size known, the other defaulted
])  # fmt: skip
def test_tile_budgets_follow_the_cache_sizes(
    l1d: int | None, l2: int | None, expected: tuple[int, int, int]
) -> None:
    """Half of L2 for the transposed input tiles, five sixths of L1d for an accumulator block."""
    budgets = policy.tile_budgets(l1d, l2)
    assert (budgets.spmm, budgets.sddmm, budgets.scatter_block) == expected


def test_variant_key_buckets_density_and_tokens_as_autotune() -> None:
    import torch

    key = policy.variant_key("spmm_t", torch.float32, (64, 96), 600, 500)
    assert key == policy.variant_key("spmm_t", torch.float32, (64, 96), 610, 512)
    assert key != policy.variant_key("spmm_t", torch.float32, (64, 96), 600, 513)
    assert key != policy.variant_key("spmm_t", torch.float64, (64, 96), 600, 500)
    assert key[4] == 512
