"""The ``apply(model)`` transaction: the initial masks, attached reversibly, then committed.

`SparsityAlgorithm.apply` (one algorithm) and `Group.apply` (its members) select the parameters
(`selection`) and run the phases of `Phases` (each algorithm's `mask_state.MaskState`) as one
`transaction`: check them (`apply_checks`), resolve the seed, build the initial masks
(`initial_mask`), `attach` them with the per-step hooks, and commit (`commit_masks` prunes).
Nothing changes the model before `attach`, and every `attach` is undone (`detach`) on any failure
before the commits: a refused ``apply`` leaves the model and the algorithms' settings as they were.

``model.apply(sparsity)`` calls the algorithm on every submodule, the model last; only the
model's call acts (`model_apply_visits_child`), so parameter filters see full names.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .apply_checks import check_mask
from .per_step import StepHooks
from .selection import Candidate
from .shapers import Shaper
from .sharding import full, shard_like
from .sparse_parameter import SparseParameter

__all__ = [
    "Phases",
    "attach",
    "commit_masks",
    "detach",
    "initial_mask",
    "log_orphans",
    "model_apply_visits_child",
    "transaction",
]

log = logging.getLogger("lightning_sparse")


class Phases(Protocol):
    """The phases of ``apply(model)`` an algorithm runs (its masks' `mask_state.MaskState`)."""

    def settings(self) -> tuple[Any, ...]: ...
    def restore_settings(self, settings: tuple[Any, ...]) -> None: ...
    def check_candidates(self, chosen: list[Candidate]) -> None: ...
    def resolve_seed(self) -> None: ...
    def initial_masks(self, chosen: list[Candidate]) -> list[torch.Tensor]: ...
    def attach(
        self, root: nn.Module, chosen: list[Candidate], masks: list[torch.Tensor]
    ) -> list[SparseParameter]: ...
    def detach(self, sps: list[SparseParameter]) -> None: ...
    def commit(self, root: nn.Module, sps: list[SparseParameter]) -> None: ...


def transaction(
    root: nn.Module, members: Sequence[Phases], routed: Sequence[list[Candidate]]
) -> None:
    """Apply each of ``members`` to its candidates in ``routed``, all or nothing: each phase
    across every member before the next (all checks before any seed, mask or buffer); on any
    failure every attach is undone and every member's settings restored, then it re-raises."""
    before = [member.settings() for member in members]
    done: list[tuple[Phases, list[SparseParameter]]] = []
    try:
        for member, chosen in zip(members, routed, strict=True):
            member.check_candidates(chosen)
        for member in members:
            member.resolve_seed()
        masks = [m.initial_masks(chosen) for m, chosen in zip(members, routed, strict=True)]
        for member, chosen, built in zip(members, routed, masks, strict=True):
            done.append((member, member.attach(root, chosen, built)))
    except BaseException:
        for member, sps in done:
            member.detach(sps)
        for member, settings in zip(members, before, strict=True):
            member.restore_settings(settings)
        raise
    for member, sps in done:
        member.commit(root, sps)


def initial_mask(
    name: str,
    param: torch.Tensor,
    init_method: Callable[..., torch.Tensor],
    target: float,
    generator: torch.Generator,
    shaper: Shaper,
    in_out: bool,
) -> torch.Tensor:
    """The mask ``init_method`` builds for ``param`` at sparsity ``target``, checked; a
    parameter stored ``[in, out]`` (``in_out``: GPT-2's Conv1D) is seen ``[out, in]`` by the init
    method and the shaper; a sharded one whole."""
    dense = full(param.detach())
    view = dense.t() if in_out else dense
    mask = init_method(view, target, generator=generator, shaper=shaper)
    mask = check_mask(mask, view, name, init_method)
    if mask.numel() and not mask.is_meta and not bool(mask.any()):
        warnings.warn(
            f"sparsity={target} keeps none of the {mask.numel()} weights of {name!r} (each row's "
            "keep count is rounded down): the layer passes nothing; give it a lower sparsity "
            "(a Group, or distribution='erk') or leave it out with param_filter",
            stacklevel=2,
        )
    return shard_like(mask.t().contiguous() if in_out else mask, param)


def attach(
    root: nn.Module, chosen: list[Candidate], masks: list[torch.Tensor], hooks: StepHooks
) -> list[SparseParameter]:
    """Register the masks and the per-step hooks of ``chosen``; on failure undo them and
    raise. Reversible (`detach`) until `commit_masks` prunes."""
    sps = [SparseParameter(module, name, attr) for name, module, attr, _ in chosen]
    # Masks no algorithm owns, and whether each was in the module's state_dict (persistent).
    replaced = {
        sp.name: (sp.mask, sp.mask_name not in sp.module._non_persistent_buffers_set)
        for sp in sps
        if sp.has_mask
    }
    try:
        for sp, mask in zip(sps, masks, strict=True):
            sp.register_mask(mask)
        hooks.install(root, sps)
    except BaseException:
        detach(sps, hooks)
        for sp in sps:
            if sp.name in replaced:
                mask, persistent = replaced[sp.name]
                sp.module.register_buffer(sp.mask_name, mask, persistent=persistent)
        raise
    return sps


def detach(sps: list[SparseParameter], hooks: StepHooks) -> None:
    """Undo `attach`."""
    hooks.remove()
    for sp in sps:
        sp.remove_mask()


def commit_masks(sps: list[SparseParameter], track_itop: bool) -> None:
    """Prune the attached parameters by their masks; with ``track_itop`` each gets its
    ever-active set (ITOP), the mask itself to begin with."""
    with torch.no_grad():
        for sp in sps:
            sp.prune_()
            if track_itop:
                sp.register_ever_active(sp.mask.clone())


def log_orphans(owner: str, orphans: list[str], init_method: object) -> None:
    """Say (at INFO) that ``orphans``, masks no algorithm owns, are replaced by ``owner``'s."""
    if orphans:
        log.info(
            "%s: %d parameter(s) carry masks no algorithm owns (first: %s; restored from "
            "a checkpoint or copied): replaced by this algorithm's initial masks (%s)",
            owner,
            len(orphans),
            orphans[0],
            getattr(init_method, "__name__", init_method),
        )


def model_apply_visits_child(module: nn.Module) -> bool:
    """Whether the caller (an algorithm's ``__call__`` on ``module``) runs inside ``model.apply``
    for a module below the one ``model.apply`` was called on.

    ``model.apply(fn)`` calls ``fn`` on every submodule, children first and the model last, and
    gives ``fn`` no other sign of which call is the model's. No rule over the calls seen so far can
    tell: after the calls for ``Sequential(Linear)``'s walk, the walk of
    ``Sequential(Sequential(Linear))`` has made the same calls and one is still to come, and
    acting early would prune under names (``"0.weight"`` for ``"0.0.weight"``) whose masks differ,
    which only a copy of the weights could undo. The interpreter's stack does tell: the call is a
    child's when ``Module.apply`` called it for ``module`` and was itself called, through
    ``apply`` frames only (a subclass's ``apply`` that calls ``super().apply(fn)``), by the
    ``apply`` of a module that holds ``module`` as a child. Any other call acts: ``sparsity(m)``
    from any function, the algorithm wrapped (``model.apply(lambda m: sparsity(m))`` is that call
    on every module), or ``model.apply(sparsity)`` from a function another walk is visiting.
    """
    caller = sys._getframe(2)  # 0: here, 1: __call__, 2: who called __call__
    if caller.f_code is not nn.Module.apply.__code__ or caller.f_locals.get("self") is not module:
        return False  # called directly: sparsity(model)
    outer = caller.f_back
    while outer is not None and outer.f_code.co_name == "apply":
        parent = outer.f_locals.get("self")
        if not isinstance(parent, nn.Module):
            return False
        if parent is not module:
            return any(child is module for child in parent.children())
        outer = outer.f_back  # ``module``'s own ``apply``, overridden: look further out
    return False
