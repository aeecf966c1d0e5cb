"""`DropAndGrow`: the rule and the constructor SET, RigL and GraNet share.

At each update the smallest-|w| ``drop_fraction`` of the active weights is dropped and as many
are grown back where ``grow_score`` is highest (Mocanu et al. 2018; Evci et al. 2020). An
algorithm is its grow score, a tensor of the weight's shape (`set.py`: uniform random;
`rigl.py`: |dense gradient|) plus, for GraNet (`granet.py`), ``prune_to_target``: its schedule
rises, so the surplus above the new target is dropped first. The counts, per row of the
shaper's ``[groups, n]`` view, are `drop_count`'s: the one rule of how many weights an update
drops, used by the per-weight path (`shaped_drop_and_grow`), the stacked path
(`DropAndGrow.compute_masks`) and the grow count a device asks for (`grow_candidates`).
"""

from __future__ import annotations

import functools
import warnings
from abc import abstractmethod
from typing import Any, ClassVar, overload

import torch

from .. import held, schedules, validate
from ..cadences import make_update_schedule
from ..install import NewMask, by_key
from ..mask_ops import drop_and_grow, host_select, row_counts
from ..schedules import ScheduleSpec, UpdateSpec
from ..shapers import Shaper, Unstructured
from ..sharding import is_sharded
from .base import SparsityAlgorithm

__all__ = ["DropAndGrow", "dense_grad_score", "drop_count", "shaped_drop_and_grow"]


class DropAndGrow(SparsityAlgorithm):
    """Drop the smallest-|w| ``drop_fraction`` of active weights; grow as many by `grow_score`.

    Args:
        sparsity: target sparsity or schedule (see ``SparsityAlgorithm``).
        drop_fraction: share of active weights replaced per update, in [0, 1]; a float or a
            schedule (e.g. ``{"type": "cosine", "init": 0.3, "half_period": 3584}``).
        update: when masks change (see ``SparsityAlgorithm``).
        **kwargs: see ``SparsityAlgorithm`` (``init_method``, ``shaper``, ...).
    """

    prune_to_target: ClassVar[bool] = False  # GraNet: drop the surplus above the target first
    grows_by_grad_magnitude: ClassVar[bool] = False  # RigL, GraNet: grow_score is |dense grad|

    def __init__(
        self,
        sparsity: ScheduleSpec,
        drop_fraction: ScheduleSpec = 0.3,
        update: UpdateSpec = None,
        **kwargs: Any,
    ) -> None:
        cadence = make_update_schedule(update)
        # Bound before the base checks the range (once, when built), the drop fraction with it.
        self.drop_fraction: schedules.HyperParameterSchedule = schedules.bind(
            drop_fraction, cadence, False, check=validate.drop_fraction
        )
        super().__init__(sparsity, cadence, **kwargs)

    @abstractmethod
    def grow_score(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """Where to grow in the parameter ``name``: a score of ``p``'s shape, higher grows first
        (``p`` as `update_mask` sees it)."""

    def drop_fraction_at(self, step: int) -> float:
        """The drop fraction at ``step``, checked to be in [0, 1]."""
        value = schedules.evaluate(self.drop_fraction, step, "drop_fraction")
        return validate.drop_fraction(value, step=step, schedule=self.drop_fraction)

    def check_range(self, horizon: int) -> None:
        """The base's checks, and the drop fraction's: in [0, 1] at every update step in
        ``[0, horizon]``, finite at every later one."""
        super().check_range(horizon)
        extra = (0, *self.milestones())
        schedules.check_schedule(
            self.drop_fraction,
            "drop_fraction",
            self.update_schedule,
            horizon,
            extra,
            validate.drop_fraction,
        )

    def config(self) -> dict[str, str]:
        """The base's, and the drop fraction's repr."""
        return {**super().config(), "drop_fraction": repr(self.drop_fraction)}

    def compute_masks(self, targets: dict[str, float]) -> dict[str, NewMask]:
        """The masks of same-shape weights at one target computed together, over their stack
        (a few kernels per shape, not per weight: top-k and drop-and-grow work row by row, so each
        weight gets the mask it gets alone), the others one by one (`mask_of`). Every mask's
        fewest and most kept per row are read to the host in one transfer first: one host sync
        per update."""
        names = self._with_gradient(
            [n for n, sp in self.sparse_params.items() if sp.param.requires_grad]
        )
        groups = by_key({n: self._batch_key(n, targets[n]) for n in names})
        view = self.mask_state.rule_view  # each mask as the rule sees it (whole, [out, in])
        # A weight alone is a view, not a copy (a model built sparse holds no mask twice).
        stacks = [
            torch.stack([self.shaper.shape(view(n)) for n in g])
            if len(g) > 1
            else self.shaper.shape(view(g[0])).unsqueeze(0)
            for g in groups
        ]
        masks: dict[str, NewMask] = {}
        for group, stack, (lows, highs) in zip(
            groups, stacks, _row_count_ranges(stacks), strict=True
        ):
            # Stacked only where every row keeps one count (top-k then takes an int k per stack)
            # and a row is not one long CPU row (its sampled selection is faster per weight).
            if len(group) > 1 and len({*lows, *highs}) == 1 and not host_select(stack[0]):
                masks.update(self._stacked_masks(group, stack, targets[group[0]], lows[0]))
                continue
            for name, low, high in zip(group, lows, highs, strict=True):
                rule = functools.partial(self.update_mask, count_range=(low, high))
                masks[name] = self.mask_state.pending(name, self.mask_of(name, targets[name], rule))
        return masks

    def _with_gradient(self, names: list[str]) -> list[str]:
        """``names`` without the weights that have no gradient at this update, when the grow
        score is the gradient (RigL, GraNet): a layer this step's forward did not use (a branch
        taken on some steps only) keeps its mask until an update where it has one; warns, naming
        them. When none has one, the update cannot run: `dense_grad_score` says why."""
        if not self.grows_by_grad_magnitude:
            return names
        missing = [
            n
            for n in names
            if held.holder_of(param := self.sparse_params[n].param) is None and param.grad is None
        ]
        if not missing or len(missing) == len(names):
            return names
        warnings.warn(
            f"{self.name}: {len(missing)} weight(s) have no gradient at the update of step "
            f"{self.step} (first {missing[0]!r}): this step's forward did not use them, so they "
            "keep their masks until an update where they have one; leave such layers out with "
            "param_filter if they are never used",
            stacklevel=2,
        )
        skipped = set(missing)
        return [n for n in names if n not in skipped]

    def _batch_key(self, name: str, target: float) -> tuple[Any, ...]:
        """Weights computed together share it: shape, dtype, device and target; a sharded one, a
        held one (`held`) and an ``[in, out]`` one (`layouts`) stand alone."""
        param = self.sparse_params[name].param
        if is_sharded(param) or held.holder_of(param) is not None or name in self.in_out_params:
            return (name,)
        return (tuple(param.shape), param.dtype, param.device, target)

    def _stacked_masks(
        self, names: list[str], masks: torch.Tensor, sparsity: float, active: int
    ) -> dict[str, torch.Tensor]:
        """`shaped_drop_and_grow` of the same-shape weights ``names`` at once. ``masks``: their
        stacked ``[G, groups, n]`` mask views; ``active``: the kept count of every row."""
        params = [self.sparse_params[n].param for n in names]
        n_total = self.shaper.keep_per_row(sparsity, masks.shape[-1])
        drop = self.drop_fraction_at(self.step)
        n_drop = drop_count(active, n_total, drop, self.prune_to_target)
        magnitude = torch.stack([p.detach() for p in params]).abs_()
        scores = [
            self.shaper.shape(self.grow_score(n, p)) for n, p in zip(names, params, strict=True)
        ]
        drop_score = torch.stack([self.shaper.shape(m) for m in magnitude.unbind(0)])
        new = drop_and_grow(drop_score, torch.stack(scores), masks, n_drop, n_total)
        return {
            n: self.shaper.unshape(new[i], p.shape)
            for i, (n, p) in enumerate(zip(names, params, strict=True))
        }

    def grow_candidates(self, name: str) -> int | None:
        """While `dense_grad_needed`: how many positions of ``name`` outside its current mask
        this step's update can grow at most, if it reads the dense gradient there only through
        their rank by ``|grad|`` (ties to the lower index); None when it reads more of it.

        The grow count of `drop_count`, capped at the positions outside the mask, for a
        ``|grad|`` grow score over one row (the `Unstructured` shaper); None otherwise. A weight
        whose gradient is held elsewhere (`held`: the device's compact layers) then keeps only
        the gradient at the kept positions and at these top candidates. One host sync (the
        mask's count).
        """
        sp = self.sparse_params[name]
        if not self.grows_by_grad_magnitude or not isinstance(self.shaper, Unstructured):
            return None
        n = sp.mask.numel()
        active = int(sp.nnz)
        n_total = self.shaper.keep_per_row(self.target_sparsity(name, self.step), n)
        drop = self.drop_fraction_at(self.step)
        kept = active - drop_count(active, n_total, drop, self.prune_to_target)
        return min(max(n_total - kept, 0), n - active)

    def update_mask(
        self,
        name: str,
        p: torch.Tensor,
        mask: torch.Tensor,
        sparsity: float,
        count_range: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Drop by ``|p|``, grow by `grow_score` (`shaped_drop_and_grow`); ``count_range``: the
        fewest and most kept per row of ``mask``, when `compute_masks` read them already."""
        drop = self.drop_fraction_at(self.step)
        score = self.grow_score(name, p)
        return shaped_drop_and_grow(
            self.shaper, p, score, mask, sparsity, drop, self.prune_to_target, count_range
        )


def _row_count_ranges(stacks: list[torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """Per stack of ``[G, groups, n]`` masks, the fewest and the most kept per row of each of
    its ``G`` masks, read to the host together (one sync)."""
    if not stacks:
        return []
    counts = [torch.stack(row_counts(m).flatten(1).aminmax(dim=1)) for m in stacks]
    lows, highs = torch.cat(counts, dim=1).tolist()
    out, start = [], 0
    for m in stacks:
        out.append((lows[start : start + len(m)], highs[start : start + len(m)]))
        start += len(m)
    return out


def shaped_drop_and_grow(
    shaper: Shaper,
    p: torch.Tensor,
    grow_score: torch.Tensor,
    mask: torch.Tensor,
    sparsity: float,
    drop_fraction: float,
    prune_to_target: bool = False,
    count_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Drop ``drop_fraction`` of the active weights by ``|p|``, regrow by ``grow_score``.

    Counts follow Cerebras (``cstorch.sparse`` RigL/SET): of ``a`` active weights in a row,
    ``int((1 - d) * a)`` survive the drop and the row grows back up to its target
    ``int((1 - s) * n)``; a row still denser than its target (a dense start) only shrinks.
    With ``prune_to_target`` (GraNet) the surplus above the target is pruned first and the drop
    fraction applies to the target count.

    Args:
        shaper: maps ``[*shape]`` tensors to ``[groups, n]`` rows that compete independently.
        p: weight, any shape.
        grow_score: same shape, higher = grow first (SET: uniform random, RigL: ``|grad|``).
        mask: current bool mask, same shape.
        sparsity: target sparsity after the update.
        drop_fraction: share of the target's active connections replaced, in [0, 1].
        prune_to_target: GraNet: also drop the surplus above the target count by magnitude.
        count_range: the fewest and most kept per row of ``mask``, if the caller read them
            (`_row_count_ranges`); else they are read here (one host sync).

    Returns:
        bool mask of ``p``'s shape with ``shaper.keep_per_row(sparsity, n)`` kept per row (or
        fewer removed while a row is still denser than its target and ``prune_to_target`` is off).
    """
    w2d, m2d = shaper.shape(p.abs()), shaper.shape(mask)
    n_total = shaper.keep_per_row(sparsity, m2d.shape[-1])
    counts = row_counts(m2d)
    if count_range is None:
        count_range = (int(counts.amin()), int(counts.amax()))
    low, high = count_range
    # One count for every row (an int keeps top-k on its fast path), or one per row.
    n_drop: int | torch.Tensor
    if low == high:
        n_drop = drop_count(low, n_total, drop_fraction, prune_to_target)
    else:
        n_drop = drop_count(counts, n_total, drop_fraction, prune_to_target)
    new = drop_and_grow(w2d, shaper.shape(grow_score), m2d, n_drop, n_total)
    return shaper.unshape(new, p.shape)


def dense_grad_score(p: torch.Tensor, name: str) -> torch.Tensor:
    """RigL's grow score ``|grad|`` of the dense accumulated gradient of ``p``."""
    if p.grad is None:
        raise RuntimeError(
            f"RigL needs the dense gradient of {name!r} at an update step, but it is None; run "
            "backward before the optimizer step (and don't zero_grad in between)"
        )
    return p.grad.abs()


@overload
def drop_count(active: int, n_total: int, drop_fraction: float, prune_to_target: bool) -> int: ...
@overload
def drop_count(
    active: torch.Tensor, n_total: int, drop_fraction: float, prune_to_target: bool
) -> torch.Tensor: ...
def drop_count(
    active: int | torch.Tensor, n_total: int, drop_fraction: float, prune_to_target: bool
) -> int | torch.Tensor:
    """Connections a row with ``active`` kept drops at an update (Cerebras' counts,
    ``cstorch.sparse`` RigL/SET): ``active - floor((1 - d) * base)``, ``base`` the active
    count, or with ``prune_to_target`` (GraNet) that count capped at the target ``n_total``;
    ``d`` clamped to [0, 1].

    Args:
        active: the row's kept count: an int (every row alike), or an integer tensor of one
            count per row (``[groups]``).
        n_total: the row's target count after the update.
        drop_fraction: the share of the active (or target) count replaced.
        prune_to_target: GraNet: the surplus above ``n_total`` is dropped on top.

    Returns:
        An int for an int ``active``; else an int64 tensor of ``active``'s shape.
    """
    keep_share = 1.0 - min(max(drop_fraction, 0.0), 1.0)
    if isinstance(active, torch.Tensor):
        base = active.clamp(max=n_total) if prune_to_target else active
        return active - torch.floor(base.double() * keep_share).long()
    base_count = min(active, n_total) if prune_to_target else active
    return active - int(keep_share * base_count)
