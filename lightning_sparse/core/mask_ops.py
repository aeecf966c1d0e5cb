"""Masks from scores: top-k with deterministic ties, and the drop-and-grow step of SET/RigL.

Every function works row by row on a ``[groups, n]`` score (a shaper from ``shapers.py`` makes
that view), so each row competes independently. Ties always go to the lower index within the row,
which makes masks identical on every run and thread count; ``torch.topk`` alone gives no
such guarantee. NaN scores count as ``-inf``.

Only the threshold (the k-th largest score) comes from a selection algorithm; the tie rule then
fixes the mask. On a single long row on the CPU (``Unstructured``, the default) ``torch.topk`` is
one single-threaded pass over every element, so there the threshold is selected from a small
candidate set instead: a strided sample bounds it, one vectorised comparison keeps the few
percent of scores past the bound, and ``torch.topk`` runs on those (``_kth_largest``). The
threshold, hence the mask, is the same; this path reads counts on the host, which costs nothing
on the CPU. Other devices and short or many rows keep the sync-free ``torch.topk`` path.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import masking

_INF = float("inf")
# Rows at least this long, on the CPU, take the sampled selection (tests lower it to 1).
HOST_SELECT_MIN = 1 << 14
# Masks of at least this many entries in such rows are counted row by row on the CPU (`row_counts`).
COUNT_BY_ROW_MIN = 1 << 20
_SAMPLE = 4096  # about this many sampled scores bound the threshold


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}] (the row length), got {value}")


def _without_nan(score: Tensor) -> Tensor:
    """Return ``score`` in a dtype ``torch.topk`` accepts, with NaN replaced by ``-inf``."""
    if score.dtype == torch.bool:
        return score.to(torch.uint8)
    if score.is_floating_point():
        return score.nan_to_num(nan=-_INF, posinf=_INF, neginf=-_INF)
    return score


def topk_mask(score: Tensor, k: int | Tensor) -> Tensor:
    """Keep the ``k`` largest scores of each row; ties go to the lower index.

    The k-th largest value of each row is a threshold: every score above it is kept, and among
    the scores equal to it the first ``k - (number above)`` by index are kept. The threshold value
    is unique even where ``torch.topk``'s indices are not, so the mask is deterministic. An int
    ``k`` costs one ``torch.topk`` over ``min(k, n - k + 1)`` elements and never syncs the host,
    except for one CPU row of ``HOST_SELECT_MIN`` or more, where the threshold comes from a
    sample-narrowed candidate set (host-side counts, free on the CPU; same mask).

    Args:
        score: ``[groups, n]`` (any ``[..., n]`` works; rows are the last dimension). Floating
            point NaN counts as ``-inf``: kept only when ``k`` exceeds the number of other scores.
        k: Number to keep per row: an int in ``[0, n]`` for every row, or an int64 tensor of shape
            ``[groups]`` (``score.shape[:-1]``, or broadcastable to it) with one count per row,
            clamped to ``[0, n]``. The tensor path uses a full sort.

    Returns:
        Bool mask shaped like ``score`` with exactly ``k`` True per row.

    Raises:
        ValueError: If ``score`` is 0-d or an int ``k`` is outside ``[0, n]``.
        TypeError: If ``k`` is neither an int nor a tensor.
    """
    if score.ndim == 0:
        raise ValueError("topk_mask needs a score of shape [groups, n], got a 0-d tensor")
    n = score.shape[-1]
    if isinstance(k, Tensor):
        return _topk_mask_per_row(_without_nan(score), k)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"topk_mask k must be an int or an int64 tensor, got {k!r}")
    _check_int("topk_mask k", k, 0, n)
    if k == 0 or k == n:
        return torch.full_like(score, k == n, dtype=torch.bool)
    score = _without_nan(score)
    if host_select(score):
        return _top_mask(score.reshape(-1), k, None, n).reshape(score.shape)
    # The k-th largest equals the (n - k + 1)-th smallest: select whichever side is shorter.
    if k <= n - k + 1:
        threshold = torch.topk(score, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    else:
        smallest = torch.topk(score, n - k + 1, dim=-1, largest=False, sorted=False).values
        threshold = smallest.amax(-1, keepdim=True)
    return _keep_threshold(score, threshold, k)


def _topk_mask_per_row(score: Tensor, k: Tensor) -> Tensor:
    n = score.shape[-1]
    if n == 0:
        return torch.zeros_like(score, dtype=torch.bool)
    k = torch.broadcast_to(k.to(score.device, torch.int64), score.shape[:-1]).unsqueeze(-1)
    k = k.clamp(0, n)
    descending = torch.sort(score, dim=-1, descending=True).values
    # For k == 0 this picks the row maximum; nothing exceeds it and zero ties are taken.
    threshold = descending.gather(-1, (k - 1).clamp(min=0))
    return _keep_threshold(score, threshold, k)


def row_counts(masks: Tensor, keepdim: bool = False) -> Tensor:
    """True entries per row of bool ``masks [..., n]``, int32 ``[...]`` (``n < 2**31``).

    The one row count of the package (top-k's ties, drop-and-grow's kept counts, an update's
    figures). One reduction: the bytes summed into int32, without the int64 copy of every entry
    a sum of bools makes. Where each op is not a kernel launch (the CPU,
    `masking.FUSED_FOREACH_DEVICES`), rows of ``HOST_SELECT_MIN`` or more in masks of
    ``COUNT_BY_ROW_MIN`` entries or more (an update's stacked masks) are counted one by one
    with ``count_nonzero`` instead: a row-wise byte sum of that size is a type-converting loop
    there, several times slower (benchmarks/README.md, "Row counts on the CPU").
    """
    n = masks.shape[-1]
    if (
        masks.device.type not in masking.FUSED_FOREACH_DEVICES
        and n >= HOST_SELECT_MIN
        and masks.numel() >= COUNT_BY_ROW_MIN
    ):
        rows = masks.reshape(-1, n).unbind(0)
        counts = torch.stack([row.count_nonzero() for row in rows]).to(torch.int32)
        counts = counts.reshape(masks.shape[:-1])
        return counts.unsqueeze(-1) if keepdim else counts
    return masks.view(torch.uint8).sum(-1, keepdim=keepdim, dtype=torch.int32)


def _keep_threshold(
    score: Tensor, threshold: Tensor | float, k: int | Tensor, valid: Tensor | None = None
) -> Tensor:
    """Keep ``score > threshold`` plus the lowest-index ties so each row has ``k`` (counting
    only ``valid`` positions, if given)."""
    above = score > threshold
    ties = score == threshold
    if valid is not None:
        above &= valid
        ties &= valid
    needed = k - row_counts(above, keepdim=True)
    return above | (ties & (ties.cumsum(-1, dtype=torch.int32) <= needed))


def host_select(t: Tensor) -> bool:
    """Whether top-k over ``t`` (``[..., n]``) takes the sampled selection: one CPU row (a
    single row, not a batch of them: each row keeps its own ``k``) of ``HOST_SELECT_MIN`` or
    more."""
    return t.device.type == "cpu" and t.shape[-1] >= HOST_SELECT_MIN and t.numel() == t.shape[-1]


def _top_mask(x: Tensor, k: int, valid: Tensor | None, n_valid: int) -> Tensor:
    """``topk_mask`` of one row ``x`` ([n], no NaN) over its ``valid`` positions (host path)."""
    if k == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    if k == n_valid:
        return torch.ones_like(x, dtype=torch.bool) if valid is None else valid.clone()
    threshold = _kth_largest(x, k, valid, n_valid)
    keep = x >= threshold  # a Python scalar: compares much faster than a 0-d tensor
    if valid is not None:
        keep &= valid
    if int(keep.count_nonzero()) == k:  # no surplus ties at the threshold: the usual case
        return keep
    return _keep_threshold(x, threshold, k, valid)


def _kth_largest(x: Tensor, k: int, valid: Tensor | None, n_valid: int) -> float | int:
    """The k-th largest of ``x[valid]``, exactly, without a top-k over all of ``x``.

    Works from the nearer end (the ``j = min(k, n_valid - k + 1)``-th from the top or bottom).
    A strided sample of the valid scores gives a bound that at least ``j`` of them reach with
    near certainty (4 standard deviations past the expected sample rank); the scores reaching
    it hold the answer, so ``torch.topk`` runs on those few. If fewer than ``j`` reach it (a
    misleading sample, heavy ties), it runs on every valid score: slower, same answer.

    Args:
        x: ``[n]`` float scores without NaN. valid: ``[n]`` bool or None (all valid).
        k: rank from the top, in ``[1, n_valid]``. n_valid: number of valid scores.
    """
    largest = k <= n_valid - k + 1
    j = k if largest else n_valid - k + 1
    stride = max(x.numel() // _SAMPLE, 1) | 1  # odd, so it walks across the columns of a matrix
    sample = x[::stride] if valid is None else x[::stride][valid[::stride]]
    m, p = sample.numel(), j / n_valid
    rank = math.ceil(p * m + 4.0 * math.sqrt(m * p * (1.0 - p)) + 2.0)
    if rank < m:
        bound = _nth(sample, rank, largest)  # both are Python scalars here (see _nth)
        near = x >= bound if largest else x <= bound
        if valid is not None:
            near &= valid
        candidates = x[near]
        if candidates.numel() >= j:
            return _nth(candidates, j, largest)
    return _nth(x if valid is None else x[valid], j, largest)


def _nth(values: Tensor, j: int, largest: bool) -> float | int:
    """The j-th largest (or smallest) of 1-D ``values``, by a top-k over the shorter side.

    Returned as a Python number (exact: ``item()`` gives an int for integer dtypes and a
    double, which holds every float dtype's values, otherwise), since comparing a tensor with a
    scalar is several times faster on the CPU than with a 0-d tensor.
    """
    c = values.numel()
    if j <= c - j + 1:
        picked = torch.topk(values, j, largest=largest, sorted=False).values
        return (picked.amin() if largest else picked.amax()).item()
    picked = torch.topk(values, c - j + 1, largest=not largest, sorted=False).values
    return (picked.amax() if largest else picked.amin()).item()


def _finite(score: Tensor) -> Tensor:
    """Float copy with NaN/-inf at the lowest finite value and +inf at the highest.

    Frees ``±inf`` to mark positions that must rank below or above every real score.
    """
    if not score.is_floating_point():
        score = score.double()
    info = torch.finfo(score.dtype)
    return score.nan_to_num(nan=info.min, posinf=info.max, neginf=info.min)


def drop_and_grow(
    drop_score: Tensor,
    grow_score: Tensor,
    mask: Tensor,
    n_drop: int | Tensor,
    n_total: int | Tensor,
) -> Tensor:
    """Drop the weakest active connections, then grow the strongest inactive ones.

    The update of SET (Mocanu et al. 2018, "Scalable training of artificial neural networks with
    adaptive sparse connectivity ...", arXiv:1707.04780) and RigL (Evci et al. 2020, "Rigging the
    Lottery: Making All Tickets Winners", arXiv:1911.11134, Algorithm 1), which differ only in
    ``grow_score`` (random for SET, ``|dense gradient|`` for RigL):

    1. drop: of the ``active`` connections of a row keep the ``active - n_drop`` with the highest
       ``drop_score`` (``|W|`` in both papers);
    2. grow: ``n_grow = max(n_total - (active - n_drop), 0)``, chosen by ``grow_score`` among all
       positions *not kept in step 1*. As in the paper (``ArgTopK`` over ``i ∉ θ \\ I_drop``) and
       its official code, a connection dropped in step 1 may be grown straight back.

    Cerebras' RigL/SET (``cstorch.sparse`` 2.x) compute the same ``n_grow``, so while a row is
    still denser than ``n_total`` (a delayed start) nothing is grown and it only shrinks.

    Args:
        drop_score: ``[groups, n]`` float score of the active connections; higher = keep.
        grow_score: ``[groups, n]`` float score of the candidates; higher = grow first.
        mask: ``[groups, n]`` bool, the current mask.
        n_drop: Connections to drop per row: an int >= 0, or an int64 tensor ``[groups]``.
            Clamped to the row's active count.
        n_total: Target active count per row after growing: an int in ``[0, n]``, or an int64
            tensor ``[groups]``. ``n_total=0`` only drops (gradual pruning); ``n_drop=0`` only
            grows.

    Returns:
        ``[groups, n]`` bool mask with exactly ``max(n_total, active - n_drop)`` True per row
        (so exactly ``n_total`` in the usual case). NaN and ``±inf`` scores rank as the lowest
        and highest finite values, so a drop never keeps an inactive position and a grow never
        picks a kept one. With int ``n_drop`` and ``n_total`` it costs two ``torch.topk`` calls
        and never syncs the host (one long CPU row: two sampled selections instead, restricted
        to the active / not-kept positions by a mask, with host-side counts; same result);
        tensor counts use a full sort.

    Raises:
        ValueError: If the shapes differ, ``mask`` is not bool, or an int count is out of range.
    """
    if not drop_score.shape == grow_score.shape == mask.shape:
        raise ValueError(
            f"drop_and_grow needs drop_score, grow_score and mask of one shape [groups, n], got "
            f"{tuple(drop_score.shape)}, {tuple(grow_score.shape)} and {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool or mask.ndim == 0:
        raise ValueError(
            f"drop_and_grow mask must be a bool tensor [groups, n], got {mask.dtype} "
            f"of shape {tuple(mask.shape)}"
        )
    n = mask.shape[-1]
    if not isinstance(n_drop, Tensor):
        _check_int("drop_and_grow n_drop", n_drop, 0, n)
    if not isinstance(n_total, Tensor):
        _check_int("drop_and_grow n_total", n_total, 0, n)
    if isinstance(n_drop, int) and isinstance(n_total, int) and host_select(mask):
        return _drop_and_grow_host(drop_score, grow_score, mask, n_drop, n_total)
    # 1. Drop the n_drop weakest active positions. Flipped so that among equal scores the
    #    higher index is dropped first, i.e. the survivors are the top scores, ties to the lower
    #    index. Inactive positions rank last; if n_drop exceeds the active count, `mask &` drops
    #    them all.
    weakest = torch.where(mask, -_finite(drop_score), -_INF).flip(-1)
    kept = mask & ~topk_mask(weakest, n_drop).flip(-1)
    # 2. Grow: the top n_total of a score on which every kept position outranks all others, so
    #    all of them are chosen first. A row still denser than n_total keeps them all via `kept |`.
    ranked = torch.where(kept, _INF, _finite(grow_score))
    return kept | topk_mask(ranked, n_total)


def _drop_and_grow_host(
    drop_score: Tensor, grow_score: Tensor, mask: Tensor, n_drop: int, n_total: int
) -> Tensor:
    """``drop_and_grow`` of one long CPU row: the same two selections, each restricted to its
    candidates by a ``valid`` mask rather than by ``±inf`` scores (no full-size ``where``)."""
    kept, n_kept = _drop_host(drop_score, mask, n_drop)
    # 2. Grow the strongest of the positions not kept, up to n_total.
    n_grow = max(n_total - n_kept, 0)
    free = ~kept
    grown = _top_mask(_finite(grow_score).reshape(-1), n_grow, free, free.numel() - n_kept)
    return (kept | grown).reshape(mask.shape)


def _drop_host(drop_score: Tensor, mask: Tensor, n_drop: int) -> tuple[Tensor, int]:
    """Step 1 of ``drop_and_grow`` on one long CPU row: ``([n] kept mask, kept count)``."""
    active = mask.reshape(-1)
    n_active = int(active.count_nonzero())
    n_kept = n_active - min(n_drop, n_active)
    # Keep the n_kept strongest active positions (ties to the lower index).
    return _top_mask(_finite(drop_score).reshape(-1), n_kept, active, n_active), n_kept
