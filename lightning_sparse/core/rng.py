"""Reproducible randomness keyed by ``(seed, step, name)``.

Every random choice in the package (random mask init, SET regrowth) draws from a generator seeded
by a stable hash of the run seed, the step and the parameter name. Every rank, and every run
resumed from a checkpoint, therefore makes the same choice without communicating, and the choice
does not depend on how many random numbers were drawn before it or on ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib

import torch

_MASK_63 = (1 << 63) - 1


def stable_seed(seed: int, step: int, name: str) -> int:
    """Hash ``(seed, step, name)`` to a seed that is the same in every process.

    Args:
        seed: The run's base seed.
        step: Completed optimizer steps (0 at initialization).
        name: The parameter's fully qualified name, e.g. ``"layers.0.attn.wq.weight"``.

    Returns:
        A non-negative int below ``2**63`` (valid for ``torch.Generator.manual_seed``), from
        BLAKE2b, so unlike ``hash()`` it does not change with ``PYTHONHASHSEED``.

    Raises:
        TypeError: If ``seed`` or ``step`` is not an int or ``name`` is not a str.
    """
    for arg, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"stable_seed {arg} must be an int, got {value!r}")
    if not isinstance(name, str):
        raise TypeError(f"stable_seed name must be a str, got {name!r}")
    # seed and step are ints, so the first two ':' separate the fields unambiguously.
    digest = hashlib.blake2b(f"{seed}:{step}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK_63


def generator_for(
    seed: int, step: int, name: str, device: torch.device | str = "cpu"
) -> torch.Generator:
    """Return a new ``torch.Generator`` on ``device`` seeded by ``stable_seed(seed, step, name)``.

    Args:
        seed: The run's base seed.
        step: Completed optimizer steps.
        name: The parameter's fully qualified name.
        device: Device of the tensors the generator will fill (a CUDA generator is needed for
            ``torch.rand(..., device="cuda", generator=g)``).

    Returns:
        A generator whose stream depends only on the three keys (and the device type, as PyTorch's
        CPU and CUDA generators produce different streams from the same seed).
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(stable_seed(seed, step, name))
    return generator


def resolve_seed(seed: int | None) -> int:
    """The seed an algorithm uses: ``seed`` if given, else the experiment's torch seed.

    ``torch.initial_seed()`` is what ``torch.manual_seed`` / Lightning's ``seed_everything`` set,
    so different experiment seeds give different masks without an explicit ``seed=``. Under
    ``torch.distributed`` rank 0's value is broadcast (one collective, at ``apply`` time), so
    every rank still builds the same masks even when the ranks were seeded differently.

    Args:
        seed: an explicit seed, or ``None`` for the experiment's.

    Returns:
        A non-negative int below 2**63.
    """
    if seed is not None:
        return seed
    value = [torch.initial_seed() % 2**63]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(value, src=0)
    return int(value[0])
