"""Masks as packed bits: 1 bit per element, 8 per ``uint8``, for checkpoints.

A bool mask costs one byte per element in memory; a checkpoint needs one bit. The layout is
NumPy's ``packbits`` with ``bitorder="big"``: element ``i`` of the flattened mask is bit
``7 - i % 8`` of byte ``i // 8``, and the unused low bits of the last byte are 0. Both directions
are a handful of vectorised tensor ops (no Python loop over elements) on the mask's device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_packed", "pack_bits", "packed_size", "unpack_bits"]


def _weights(device: torch.device) -> torch.Tensor:
    """``uint8[8]``: the bit value of positions 0..7 in a byte (128 ... 1), made on ``device``
    (a ``torch.tensor`` of Python numbers would be a blocking host-to-device copy per call)."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
    return torch.ones(8, dtype=torch.uint8, device=device).bitwise_left_shift_(shifts)


def packed_size(numel: int) -> int:
    """Bytes that hold ``numel`` bits: ``ceil(numel / 8)``."""
    return (numel + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (bool, any shape) as ``uint8[ceil(numel / 8)]``, row-major, high bit first.

    Raises:
        TypeError: ``mask`` is not a bool tensor.
    """
    if not torch.is_tensor(mask) or mask.dtype != torch.bool:
        kind = mask.dtype if torch.is_tensor(mask) else type(mask).__name__
        raise TypeError(f"pack_bits needs a torch.bool mask, got {kind}")
    flat = mask.reshape(-1)
    pad = packed_size(flat.numel()) * 8 - flat.numel()
    bits = torch.cat([flat, flat.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    return (bits * _weights(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The bool mask of ``shape`` that `pack_bits` packed into ``packed`` (same device).

    Raises:
        ValueError: ``packed`` is not one (`check_packed`).
    """
    shape, numel = check_packed(packed, shape)
    bits = (packed.unsqueeze(1) & _weights(packed.device)).ne(0).reshape(-1)
    return bits[:numel].reshape(shape)


def check_packed(packed: torch.Tensor, shape: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """``(shape, numel)`` if ``packed`` is what `pack_bits` makes of a mask of ``shape``, reading
    only its last byte (one host sync): what `unpack_bits` checks first, for checking every
    mask of a state before unpacking any.

    Raises:
        ValueError: ``packed`` is not a 1-D ``uint8`` tensor of ``ceil(numel / 8)`` bytes, or
            its padding bits (after the last element) are not 0: the data is corrupt or belongs
            to another shape.
    """
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    expected = packed_size(numel)
    if not torch.is_tensor(packed) or packed.dtype != torch.uint8 or packed.ndim != 1:
        kind = (
            f"{packed.dtype} of shape {tuple(packed.shape)}"
            if torch.is_tensor(packed)
            else type(packed).__name__
        )
        raise ValueError(
            f"packed mask must be a 1-D torch.uint8 tensor of {expected} bytes for shape "
            f"{shape}, got {kind}"
        )
    if packed.numel() != expected:
        raise ValueError(
            f"packed mask has {packed.numel()} bytes but shape {shape} ({numel} elements) needs "
            f"{expected}"
        )
    pad = expected * 8 - numel
    if pad and int(packed[-1]) & ((1 << pad) - 1):
        raise ValueError(
            f"packed mask for shape {shape} has bits set after its {numel} elements; it is "
            "corrupt or belongs to another shape"
        )
    return shape, numel
