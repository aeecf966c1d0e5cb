"""Initial masks: ``(p, sparsity, *, generator=None, shaper=None) -> bool mask of p's shape``.

The four methods of Cerebras ``cstorch.sparse.init`` (``random``, ``topk``, ``from_zeros``,
``checkerboard``), each keeping exactly ``shaper.keep_per_row(sparsity, row_len)`` per shaper row
(``int((1 - s) * row_len)`` by default) except ``from_zeros``. ``make_init_method`` turns a name
or a user callable into one of them.

Every method shares one signature:

- ``p``: the parameter, any shape;
- ``sparsity``: the fraction of zeros, in ``[0, 1)``;
- ``generator``: the source of random scores, on ``p.device`` (`rng.generator_for`); ``None``
  uses PyTorch's global generator (only ``random`` draws);
- ``shaper``: the groups competing for the kept slots; ``None`` means ``Unstructured()``;

and returns a bool mask of ``p.shape``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch
from torch import Tensor

from . import validate
from .mask_ops import topk_mask
from .shapers import Blocks, Shaper, Unstructured

InitMethod = Callable[..., Tensor]
"""``(p, sparsity, *, generator=None, shaper=None) -> Tensor[bool]`` of ``p``'s shape."""
Gen = torch.Generator | None
Shp = Shaper | None


def _keep_top(score: Tensor, sparsity: float, shaper: Shaper | None) -> Tensor:
    """Keep the top ``keep_per_row`` of ``score`` (shaped like the parameter) in each row."""
    shaper = shaper or Unstructured()
    rows = shaper.shape(score)
    k = shaper.keep_per_row(validate.sparsity(sparsity, "init sparsity"), rows.shape[-1])
    return shaper.unshape(topk_mask(rows, k), score.shape)


def random(p: Tensor, sparsity: float, *, generator: Gen = None, shaper: Shp = None) -> Tensor:
    """Keep a uniformly random subset of exactly ``int((1 - s) * row_len)`` per shaper row: a
    fixed count (top-k of ``U(0, 1)`` scores from ``generator``), not a Bernoulli draw, as in
    Cerebras. Arguments: the module docstring's."""
    score = torch.rand(p.shape, generator=generator, device=p.device)
    return _keep_top(score, sparsity, shaper)


def topk(p: Tensor, sparsity: float, *, generator: Gen = None, shaper: Shp = None) -> Tensor:
    """Keep the largest ``|p|`` of each shaper row (magnitude pruning); ties to the lower index.
    Arguments: the module docstring's (``generator`` unused)."""
    return _keep_top(p.detach().abs(), sparsity, shaper)


def from_zeros(p: Tensor, sparsity: float, *, generator: Gen = None, shaper: Shp = None) -> Tensor:
    """Keep the nonzero entries: ``p != 0`` (for loading pruned weights). Ignores ``sparsity``,
    ``generator`` and ``shaper``, as Cerebras documents: the mask's sparsity is whatever the
    weights already have."""
    return p.detach() != 0


def checkerboard(
    p: Tensor, sparsity: float, *, generator: Gen = None, shaper: Shp = None
) -> Tensor:
    """Keep an evenly spread deterministic pattern (for stress and performance tests).

    On the ``[rows, cols]`` view of ``p`` (of the block grid for ``Blocks``) with density
    ``d = keep / row_len`` and ``K = floor(d * cols)``, row ``r`` keeps column ``c`` where
    ``floor(i * K / cols)`` increments, ``i = c + r``: spacing ``~1/d`` and each row shifted by one,
    so at ``d = 0.5`` it is a true checkerboard and every column is used equally. Cerebras shifts
    row ``r`` by ``r * floor(1/d)`` instead; the pattern here is ranked with ``topk_mask``, so the
    keep count per shaper row is exact. Arguments: the module docstring's (``generator``
    unused).
    """
    shaper = shaper or Unstructured()
    if p.numel() == 0:
        return torch.zeros_like(p, dtype=torch.bool)
    row_len = shaper.shape(torch.empty(p.shape, device="meta")).shape[-1]
    keep = shaper.keep_per_row(validate.sparsity(sparsity, "init sparsity"), row_len)
    grid: tuple[int, ...]
    if isinstance(shaper, Blocks):
        grid = (p.shape[0] // shaper.h, p.shape[1] // shaper.w)
    else:
        grid = tuple(p.shape)
    rows = grid[0] if len(grid) > 1 else 1
    cols = math.prod(grid) // rows
    per_row = keep * cols // row_len
    r = torch.arange(rows, device=p.device).unsqueeze(1)
    c = torch.arange(cols, device=p.device)
    # Highest score (0) exactly at the kept positions; ranking also orders the rest.
    score = -(((c + r) * per_row) % cols)
    if isinstance(shaper, Blocks):
        score = shaper.unshape(score.reshape(1, -1), p.shape)
    return _keep_top(score.reshape(p.shape), sparsity, shaper)


INIT_METHODS: dict[str, InitMethod] = {
    "random": random,
    "topk": topk,
    "from_zeros": from_zeros,
    "checkerboard": checkerboard,
}


def make_init_method(init_method: str | InitMethod) -> InitMethod:
    """Return the init method named ``init_method``, or adapt a user callable.

    A callable must accept ``(p, sparsity)`` positionally. It receives ``generator`` and
    ``shaper`` as keywords only if its signature names them (or takes ``**kwargs``), so a plain
    ``fn(p, sparsity)`` works.

    Args:
        init_method: A key of ``INIT_METHODS`` or a callable.

    Returns:
        A function ``(p, sparsity, *, generator=None, shaper=None) -> Tensor[bool]``.

    Raises:
        ValueError: For an unknown name, or a callable that cannot take ``(p, sparsity)``.
        TypeError: If ``init_method`` is neither a str nor callable.
    """
    if isinstance(init_method, str):
        if init_method not in INIT_METHODS:
            raise ValueError(
                f"unknown init_method {init_method!r}; valid names are {sorted(INIT_METHODS)} "
                f"or a callable (p, sparsity, *, generator=None, shaper=None) -> bool mask"
            )
        return INIT_METHODS[init_method]
    if not callable(init_method):
        raise TypeError(
            f"init_method must be a name in {sorted(INIT_METHODS)} or a callable, "
            f"got {init_method!r}"
        )
    try:
        signature = inspect.signature(init_method)
        signature.bind(None, None)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"init_method {init_method!r} must accept (p, sparsity) positionally, "
            f"e.g. def my_init(p, sparsity, *, generator=None, shaper=None): ... ({err})"
        ) from err
    params = signature.parameters
    any_keyword = any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values())
    passed = [key for key in ("generator", "shaper") if any_keyword or key in params]
    if len(passed) == 2:
        return init_method

    @functools.wraps(init_method)
    def adapted(p: Tensor, sparsity: float, *, generator: Gen = None, shaper: Shp = None) -> Tensor:
        given = {"generator": generator, "shaper": shaper}
        return init_method(p, sparsity, **{key: given[key] for key in passed})

    return adapted
