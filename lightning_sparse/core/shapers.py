"""Score shapers: which elements of a parameter compete with each other for the kept slots.

A shaper views a tensor of the parameter's shape as ``[groups, candidates]``; every row then
keeps its own top ``keep_per_row(sparsity, candidates)`` (``mask_ops.topk_mask``), and
``unshape`` maps the row mask back to the parameter's shape. Structure (unstructured, balanced
groups, N:M, blocks) is thus orthogonal to the algorithm that produces the scores. Shapers are
frozen dataclasses: pure, comparable, with a readable ``repr``, holding only their arguments.

``Unstructured``, ``OutputGroups`` and ``InputGroups`` mirror Cerebras ``cstorch.sparse``'s
``ScoreFlattener``, ``OutputGroupScoreShaper`` and ``InputGroupScoreShaper``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from . import validate


def _positive(shaper: Shaper, *names: str) -> None:
    """Check each named field of a (frozen) shaper is an int >= 1; store it as a Python int."""
    for name in names:
        value = validate.integer(getattr(shaper, name), name, 1, owner=type(shaper).__name__)
        object.__setattr__(shaper, name, value)


class Shaper(ABC):
    """Maps a tensor of the parameter's shape to ``[groups, candidates]`` and back."""

    @abstractmethod
    def check(self, param_shape: torch.Size | tuple[int, ...], name: str = "tensor") -> None:
        """Raise ``ValueError`` (naming ``name``, the shape and the fix) unless the shape fits."""

    @abstractmethod
    def shape(self, t: Tensor) -> Tensor:
        """Return the ``[groups, candidates]`` view (or reduction, for ``Blocks``) of ``t``."""

    @abstractmethod
    def unshape(self, t2d: Tensor, like_shape: torch.Size | tuple[int, ...]) -> Tensor:
        """Invert ``shape``: map ``[groups, candidates]`` back to a tensor of ``like_shape``."""

    def keep_per_row(self, sparsity: float, row_len: int) -> int:
        """Return how many of a row's ``row_len`` candidates to keep: ``int((1 - s) * row_len)``."""
        return int((1.0 - sparsity) * row_len)


def _two_d(
    owner: Shaper, param_shape: torch.Size | tuple[int, ...], name: str, instead: str
) -> tuple[int, ...]:
    """``param_shape`` as a tuple, if it is 2-D ``[out, in]``; else a ``ValueError`` naming the
    shapers to use ``instead``."""
    shape = tuple(param_shape)
    if len(shape) != 2:
        raise ValueError(
            f"{owner!r} needs a 2-D [out, in] weight but {name} has shape {shape}; use "
            f"{instead} for other shapes"
        )
    return shape


def _check_divides(
    owner: Shaper, name: str, shape: tuple[int, ...], size: int, what: str, n: int
) -> None:
    if size % n:
        raise ValueError(
            f"{owner!r} cannot split {name} of shape {shape}: its {what} ({size}) is not "
            f"divisible by {n}; choose a value that divides {size}"
        )


@dataclass(frozen=True)
class Unstructured(Shaper):
    """The whole tensor is one row: plain per-tensor top-k (Cerebras ``ScoreFlattener``)."""

    def check(self, param_shape: torch.Size | tuple[int, ...], name: str = "tensor") -> None:
        """Any shape fits."""

    def shape(self, t: Tensor) -> Tensor:
        """``[*shape] -> [1, numel]``."""
        return t.reshape(1, -1)

    def unshape(self, t2d: Tensor, like_shape: torch.Size | tuple[int, ...]) -> Tensor:
        """``[1, numel] -> like_shape``."""
        return t2d.reshape(like_shape)


@dataclass(frozen=True)
class OutputGroups(Shaper):
    """``groups`` rows of consecutive elements: balances blocks of output rows.

    ``t.reshape(groups, -1)`` (Cerebras ``OutputGroupScoreShaper``). Each row is a whole block of
    output rows when ``shape[0]`` is divisible by ``groups``; only ``numel`` must be.
    """

    groups: int

    def __post_init__(self) -> None:
        _positive(self, "groups")

    def check(self, param_shape: torch.Size | tuple[int, ...], name: str = "tensor") -> None:
        """Require ``numel`` divisible by ``groups``."""
        shape = tuple(param_shape)
        _check_divides(self, name, shape, math.prod(shape), "element count", self.groups)

    def shape(self, t: Tensor) -> Tensor:
        """``[O, ...] -> [groups, numel / groups]``."""
        self.check(t.shape)
        return t.reshape(self.groups, -1)

    def unshape(self, t2d: Tensor, like_shape: torch.Size | tuple[int, ...]) -> Tensor:
        """``[groups, numel / groups] -> like_shape``."""
        return t2d.reshape(like_shape)


@dataclass(frozen=True)
class InputGroups(Shaper):
    """``groups`` rows of whole input columns of a 2-D ``[O, I]`` weight.

    Transpose, then ``reshape(groups, -1)`` (Cerebras ``InputGroupScoreShaper``): when ``I`` is
    divisible by ``groups``, row ``g`` holds input columns ``[g * I / groups, (g + 1) * I /
    groups)``, so every block of input columns keeps the same count. As in Cerebras only
    ``numel`` must be divisible; otherwise rows straddle column boundaries.
    """

    groups: int

    def __post_init__(self) -> None:
        _positive(self, "groups")

    def check(self, param_shape: torch.Size | tuple[int, ...], name: str = "tensor") -> None:
        """Require a 2-D shape with ``numel`` divisible by ``groups``."""
        shape = _two_d(self, param_shape, name, "OutputGroups or Unstructured")
        _check_divides(self, name, shape, math.prod(shape), "element count", self.groups)

    def shape(self, t: Tensor) -> Tensor:
        """``[O, I] -> [groups, O * I / groups]``."""
        self.check(t.shape)
        return t.t().reshape(self.groups, -1)

    def unshape(self, t2d: Tensor, like_shape: torch.Size | tuple[int, ...]) -> Tensor:
        """``[groups, O * I / groups] -> [O, I]`` (contiguous)."""
        out_dim, in_dim = like_shape
        return t2d.reshape(in_dim, out_dim).t().contiguous()


@dataclass(frozen=True)
class NM(Shaper):
    """N:M sparsity: each run of ``m`` consecutive inputs keeps exactly ``n`` (e.g. 2:4).

    Runs go along dim 1 (the input dim: ``I`` of a ``[O, I]`` linear weight, input channels of a
    ``[O, I, kh, kw]`` conv weight, as NVIDIA's 2:4 sparse tensor cores require); a 1-D tensor
    uses dim 0. The keep count is ``n`` per row whatever the requested sparsity, i.e. the
    sparsity is ``1 - n / m``. Pool, J. et al. 2021, "Accelerating Sparse Deep Neural Networks",
    arXiv:2104.08378.
    """

    n: int
    m: int

    def __post_init__(self) -> None:
        _positive(self, "m", "n")
        if self.n > self.m:
            raise ValueError(f"NM n must be an int in [1, m={self.m}], got {self.n!r}")

    def check(self, param_shape: torch.Size | tuple[int, ...], name: str = "tensor") -> None:
        """Require a non-scalar shape whose input dim is divisible by ``m``."""
        shape = tuple(param_shape)
        if not shape:
            raise ValueError(f"{self!r} cannot shape the 0-d {name}; leave scalars dense")
        dim = 1 if len(shape) > 1 else 0
        _check_divides(self, name, shape, shape[dim], f"dim {dim}", self.m)

    def shape(self, t: Tensor) -> Tensor:
        """``[O, I, *k] -> [O * I * prod(k) / m, m]`` with each row ``m`` consecutive inputs."""
        self.check(t.shape)
        return (t.movedim(1, -1) if t.ndim > 1 else t).reshape(-1, self.m)

    def unshape(self, t2d: Tensor, like_shape: torch.Size | tuple[int, ...]) -> Tensor:
        """``[numel / m, m] -> like_shape``."""
        like_shape = tuple(like_shape)
        if len(like_shape) == 1:
            return t2d.reshape(like_shape)
        moved = (like_shape[0], *like_shape[2:], like_shape[1])
        return t2d.reshape(moved).movedim(-1, 1).contiguous()

    def keep_per_row(self, sparsity: float, row_len: int) -> int:
        """Return ``n``: N:M fixes the count, so ``sparsity`` is ignored."""
        return self.n


@dataclass(frozen=True)
class Blocks(Shaper):
    """Block sparsity on a 2-D weight: ``h x w`` blocks are kept or pruned whole.

    ``shape`` reduces each block to one candidate (the sum of its scores, or for a bool mask
    whether any element is set), giving one row of ``(O / h) * (I / w)`` blocks; ``unshape``
    expands a block mask back to elements, so ``keep_per_row`` counts blocks.
    """

    h: int
    w: int

    def __post_init__(self) -> None:
        _positive(self, "h", "w")

    def check(self, param_shape: torch.Size | tuple[int, ...], name: str = "tensor") -> None:
        """Require a 2-D shape divisible by ``(h, w)``."""
        shape = _two_d(self, param_shape, name, "Unstructured")
        _check_divides(self, name, shape, shape[0], "output dim", self.h)
        _check_divides(self, name, shape, shape[1], "input dim", self.w)

    def shape(self, t: Tensor) -> Tensor:
        """``[O, I] -> [1, (O / h) * (I / w)]``: block sums (bool: block any)."""
        self.check(t.shape)
        out_dim, in_dim = t.shape
        blocks = t.reshape(out_dim // self.h, self.h, in_dim // self.w, self.w)
        if t.dtype == torch.bool:
            return blocks.any(3).any(1).reshape(1, -1)
        return blocks.sum((1, 3)).reshape(1, -1)

    def unshape(self, t2d: Tensor, like_shape: torch.Size | tuple[int, ...]) -> Tensor:
        """``[1, (O / h) * (I / w)] -> [O, I]``, every element taking its block's value."""
        out_dim, in_dim = like_shape
        grid = t2d.reshape(out_dim // self.h, in_dim // self.w)
        return grid.repeat_interleave(self.h, 0).repeat_interleave(self.w, 1)
