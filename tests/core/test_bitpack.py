"""`bitpack`: masks as 1 bit per element, NumPy's ``packbits`` layout, corrupt data refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse.core.bitpack import pack_bits, packed_size, unpack_bits

shapes = st.lists(st.integers(0, 13), min_size=0, max_size=3)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), density=st.floats(0.0, 1.0))
def test_round_trip_and_numpy_layout(shape: list[int], seed: int, density: float) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < density
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (packed_size(mask.numel()),)
    expected = np.packbits(mask.numpy().reshape(-1), bitorder="big")
    assert np.array_equal(packed.numpy(), expected)  # an independent implementation
    back = unpack_bits(packed, shape)
    assert back.dtype == torch.bool and back.shape == mask.shape and torch.equal(back, mask)


def test_hand_computed_bytes() -> None:
    rows = [[1, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0]]
    mask = torch.tensor(rows)
    assert pack_bits(mask.bool()).tolist() == [0b10011110, 0b00000011, 0b10000000]
    assert pack_bits(torch.ones(9, dtype=torch.bool)).tolist() == [255, 128]
    assert packed_size(0) == 0 and packed_size(8) == 1 and packed_size(9) == 2


def test_pack_refuses_a_non_bool_mask() -> None:
    with pytest.raises(TypeError, match="torch.bool mask, got torch.float32"):
        pack_bits(torch.ones(3))


@pytest.mark.parametrize(
    ("packed", "shape", "message"),
    [
        (torch.zeros(2, dtype=torch.uint8), (3, 7), r"has 2 bytes but shape \(3, 7\) \(21 "),
        (torch.zeros(4, dtype=torch.uint8), (3, 7), "has 4 bytes"),
        (torch.zeros(3, dtype=torch.int8), (3, 7), "uint8 tensor of 3 bytes.*torch.int8"),
        (torch.zeros(1, 3, dtype=torch.uint8), (3, 7), r"1-D.*shape \(1, 3\)"),
        (torch.tensor([0, 0, 0b00000100], dtype=torch.uint8), (3, 7), "bits set after its 21"),
        ([0, 0, 0], (3, 7), "got list"),
    ],
)
def test_unpack_refuses_corrupt_data(packed: object, shape: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        unpack_bits(packed, shape)  # type: ignore[arg-type]


def test_a_state_s_masks_are_checked_whole_and_unpacked_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`saved_masks` checks every packed mask (sizes, padding bits: the last byte only) before
    any is used, and unpacks each only when read, so a large model's masks are never all
    unpacked at once (a model built sparse resumes within its memory)."""
    from lightning_sparse.core import saved_state

    masks = {f"w{i}": torch.rand(5, 13) > 0.5 for i in range(3)}
    state = {
        "masks": {n: pack_bits(m) for n, m in masks.items()},
        "params": {n: list(m.shape) for n, m in masks.items()},
    }
    unpacked: list[int] = []
    real = saved_state.unpack_bits
    monkeypatch.setattr(
        saved_state,
        "unpack_bits",
        lambda *a: unpacked.append(1) or real(*a),  # type: ignore[func-returns-value]
    )
    lazy = saved_state.saved_masks(state, "Static")
    assert unpacked == [] and len(lazy) == 3 and set(lazy) == set(masks)
    assert torch.equal(lazy["w1"], masks["w1"]) and len(unpacked) == 1
    corrupt = state["masks"]["w2"].clone()
    corrupt[-1] |= 1  # a padding bit (65 elements: 7 of the last byte's 8 bits are padding)
    with pytest.raises(ValueError, match=r"masks\['w2'\].*bits set after its 65 elements"):
        saved_state.saved_masks({**state, "masks": {**state["masks"], "w2": corrupt}}, "Static")
