"""`MaskState`: the masks one algorithm owns on one model, and the mechanics that change them.

The algorithm (`algorithms/base.py`) decides which masks (its initial masks and its rule) and
when (its schedule and its step). This object holds the outcome, the model, its sparse
parameters and their masks, what each mask was built for and the per-step hooks that keep the
masks applied (`per_step.StepHooks`), and carries the decisions out:

1. **apply** (`apply`): select the parameters, then the phases of `apply_model.Phases` (check,
   seed, the algorithm's initial masks, attach, commit), which `apply_model.transaction` runs for
   one algorithm, or for a `Group`'s members together; a refused ``apply`` restores the settings.
2. **an update**: the rule sees each parameter and its mask whole and ``[out, in]``
   (`rule_param`, `rule_view`) and its mask goes back to the parameter's layout (`stored`);
   `install` copies the new masks in (`install.install`), records the update's figures
   (``last_update``) and what each mask was built for.
3. **a move** (`follow_mask`): the last update's figures follow a mask to its new device.
4. **checkpoints**: the masks' part of the algorithm's state: packed (`pack`), what a state
   must match (`expected`) and restored in place (`restore`), through `saved_state`.
5. **remove**: masks and hooks gone; the model and optimizers train dense.

It asks its algorithm for decisions only (`Owner`'s methods), never for its attributes: the
settings it needs (shaper, layer distribution, filter, init method, ITOP, seed) it is given when
built.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from . import applied, apply_model, ddp_ignore, held, install, legacy, saved_state
from .apply_checks import already_applied, check_candidates
from .distributions import LayerSparsity
from .filters import ParamFilter, frozen_left_dense, unselected_patterns
from .layouts import as_out_in, is_in_out
from .observers import Observers
from .per_step import StepHooks
from .rng import resolve_seed
from .selection import Candidate, select
from .shapers import Shaper
from .sharding import full, is_sharded, shard_like
from .sparse_parameter import SparseParameter

__all__ = ["MaskState", "Owner"]

log = logging.getLogger("lightning_sparse")


class Owner(Protocol):
    """What the masks ask of their algorithm (`SparsityAlgorithm`'s methods): its decisions."""

    @property
    def dense_grad_needed(self) -> bool: ...
    def initial_mask(self, name: str, param: torch.Tensor) -> torch.Tensor: ...
    def initial_masks(self, chosen: list[Candidate]) -> list[torch.Tensor]: ...
    def initial_target(self, name: str) -> float: ...


class MaskState:
    """The masks of one algorithm (module docstring); the `apply_model.Phases` of its ``apply``.

    Args:
        owner: the algorithm: asked for its decisions (`Owner`); what observers and `applied`
            are told about.
        name: the algorithm's name, for messages and DDP's ignore list.
        shaper: its structure (`shapers`).
        layers: its per-layer distribution, told the shapes of the chosen parameters.
        param_filter: its filter (None: the default selection, `selection.select`).
        init_method: its init method (named in messages).
        track_itop: keep an ever-active mask per parameter (ITOP).
        seed: its seed, checked (None: the experiment's, resolved at ``apply``).
        observers: its observers, told the sparsity of the first masks.

    Attributes:
        root: the model it is applied to (None before ``apply``).
        sparse_params: ``{full name: SparseParameter}``, in the order of ``apply``.
        in_out_params: the parameters stored ``[in, out]`` (HF Conv1D, `layouts`): the init
            method, the shaper and the rule see them ``[out, in]``, like nn.Linear.
        mask_targets: the sparsity each current mask was built for.
        last_update: the last update's figures per parameter (0-d tensors, `install`).
        unlogged_update: an update came since a logger last read ``last_update``.
        removed: `remove` ran (densified): its state prunes nothing when loaded.
        seed: the seed (``apply`` resolves None); ``seed_given``: whether the user chose it.
        hooks: the per-step path of the sparse parameters (`per_step.StepHooks`).
    """

    def __init__(
        self,
        owner: Owner,
        name: str,
        *,
        shaper: Shaper,
        layers: LayerSparsity,
        param_filter: ParamFilter | None,
        init_method: Callable[..., torch.Tensor],
        track_itop: bool,
        seed: int | None,
        observers: Observers,
    ) -> None:
        self.owner, self.name, self.observers = owner, name, observers
        self.shaper, self.layers, self.param_filter = shaper, layers, param_filter
        self.init_method, self.track_itop = init_method, track_itop
        self.seed, self.seed_given = seed, seed is not None
        self.root: nn.Module | None = None
        self.sparse_params: OrderedDict[str, SparseParameter] = OrderedDict()
        self.in_out_params: set[str] = set()
        self.mask_targets: dict[str, float] = {}
        self.last_update: dict[str, dict[str, torch.Tensor]] = {}
        self.unlogged_update = False
        self.removed = False
        self.hooks = StepHooks(
            self.sparse_params,
            functools.partial(getattr, owner, "dense_grad_needed"),  # picklable (ddp_spawn)
            owner.initial_mask,
            legacy.take_mask_entries,  # an earlier version's model state dicts
        )
        self.hooks.on_mask_dropped.append(self.follow_mask)

    @property
    def ever_active(self) -> dict[str, torch.Tensor]:
        """``{name: bool mask}`` of the positions ever kept (ITOP; empty unless ``track_itop``):
        ``<param>_ever_active`` buffers, so they follow the model's device."""
        found = ((name, sp.ever_active) for name, sp in self.sparse_params.items())
        return {name: ever for name, ever in found if ever is not None}

    def mask_target(self, name: str) -> float:
        """Sparsity the current mask of ``name`` was built for."""
        return self.mask_targets[name]

    def applied_seed(self) -> int:
        """The seed ``apply`` resolved (``seed=None``: the experiment's)."""
        if self.seed is None:
            raise RuntimeError(
                f"{self.name} has no seed yet (seed=None is resolved by apply(model)); apply the "
                "algorithm to the model before drawing masks"
            )
        return self.seed

    # ------------------------------------------------------------------ 1. apply
    def apply(self, root: nn.Module) -> None:
        """Select, check, build the masks, then attach; a failure leaves the model and these
        settings as they were."""
        if self.root is not None:
            raise already_applied(self.name, self.root, root)
        chosen = self.select(root)
        if not chosen:
            warnings.warn(
                f"{self.name}: no parameter of {type(root).__name__} matched the parameter "
                "filter, so nothing was sparsified; check param_filter against "
                "model.named_parameters()",
                stacklevel=4,
            )
        apply_model.transaction(root, [self], [chosen])

    def select(self, root: nn.Module) -> list[Candidate]:
        """The parameters of ``root`` the filter picks, in registration order; warns of glob
        patterns that select nothing and of frozen weights left dense."""
        found = select(root, self.param_filter)
        for message in unselected_patterns(self.name, self.param_filter, found.names):
            warnings.warn(message, stacklevel=4)  # a typo in one glob of a list
        if found.frozen:
            log.warning(frozen_left_dense(self.name, found.frozen))
        return found.chosen

    # The phases (`apply_model.Phases`), also run across a `Group`'s members: nothing changes
    # the model before `attach`, and `attach` is undone (`detach`) until `commit` prunes.
    def settings(self) -> tuple[Any, ...]:
        """What checking and seeding set before the masks exist: the seed, the [in, out]
        parameters and the layer shapes (`restore_settings` undoes a refused apply)."""
        return self.seed, self.in_out_params, dict(self.layers.shapes)

    def restore_settings(self, settings: tuple[Any, ...]) -> None:
        """Undo what a refused ``apply`` set (`settings`)."""
        self.seed, self.in_out_params, shapes = settings
        self.layers.set_shapes(shapes)

    def check_candidates(self, chosen: list[Candidate]) -> None:
        """Raise, before anything is modified, unless ``chosen`` can be sparsified (dtype,
        shaper fit, masks of another algorithm, `apply_checks`); records their layouts and
        shapes (undone by `restore_settings`)."""
        if self.root is not None:
            raise already_applied(self.name, self.root, self.root)
        self.in_out_params = {name for name, module, attr, _ in chosen if is_in_out(module, attr)}
        orphans = check_candidates(
            chosen,
            owner=self.name,
            shaper=self.shaper,
            in_out=self.in_out_params,
            filtered=self.param_filter is not None,
            owned=applied.owned_masks(),
        )
        self.layers.set_shapes({name: param.shape for name, _, _, param in chosen})
        apply_model.log_orphans(self.name, orphans, self.init_method)

    def resolve_seed(self) -> None:
        """``seed=None`` becomes the experiment's torch seed (rank 0's under torch.distributed)."""
        self.seed = resolve_seed(self.seed)

    def initial_masks(self, chosen: list[Candidate]) -> list[torch.Tensor]:
        """The algorithm's initial masks of the chosen candidates (`Owner.initial_masks`)."""
        return self.owner.initial_masks(chosen)

    def attach(
        self, root: nn.Module, chosen: list[Candidate], masks: list[torch.Tensor]
    ) -> list[SparseParameter]:
        """Register the masks and the per-step hooks of ``chosen``; on failure undo them and
        raise. Reversible (`detach`) until `commit` prunes."""
        return apply_model.attach(root, chosen, masks, self.hooks)

    def detach(self, sps: list[SparseParameter]) -> None:
        """Undo `attach`."""
        apply_model.detach(sps, self.hooks)

    def commit(self, root: nn.Module, sps: list[SparseParameter]) -> None:
        """Prune the attached parameters: from here the algorithm owns them. Their masks leave
        DDP's buffer broadcast (`ddp_ignore`; under torch.distributed every rank compares)."""
        self.root = root
        self.sparse_params.update((sp.name, sp) for sp in sps)
        apply_model.commit_masks(sps, self.track_itop)
        self.mask_targets = {sp.name: self.owner.initial_target(sp.name) for sp in sps}
        if sps:
            applied.record(root, self.owner)
        ddp_ignore.ignore_masks(root, self.name, sps)
        self.observers.emit_sparsity(self.owner, self.sparse_params, self.mask_target)

    def materialize(self, name: str) -> None:
        """``name``'s parameter was made from the meta device (`SparsityAlgorithm.materialize`):
        its deferred mask drawn now, its ever-active set, the weight pruned, the hooks on it."""
        sp = self.sparse_params[name]
        param = sp.param
        if param.is_meta:
            raise ValueError(
                f"{self.name}: {name!r} is still on the meta device; give it its values "
                "(a device and an initialisation) before drawing its mask"
            )
        sp.register_mask(self.owner.initial_mask(name, param.detach()))
        self.hooks.adopt(sp)
        apply_model.commit_masks([sp], self.track_itop)  # pruned, its ever-active set, as apply

    # ------------------------------------------------------------------ 2. an update
    def rule_param(self, name: str) -> torch.Tensor:
        """The parameter ``name`` as the rule sees it: whole (a shard gathered with its
        gradient; the device's compact weight as a dense copy, `held`), and ``[out, in]`` for a
        parameter stored ``[in, out]`` (its gradient too)."""
        param = self.sparse_params[name].param
        p = held.dense_of(param)  # the device's compact layer: a dense copy, this one only
        if is_sharded(param):
            p = full(param.detach())
            p.grad = full(param.grad) if param.grad is not None else None
        return as_out_in(p) if name in self.in_out_params else p

    def rule_view(self, name: str) -> torch.Tensor:
        """The mask of ``name`` as the rule sees it: whole (a shard gathered), and
        ``[out, in]`` for a parameter stored ``[in, out]``."""
        mask = full(self.sparse_params[name].mask)
        return mask.t() if name in self.in_out_params else mask

    def stored(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        """A mask the rule made for ``name`` (as `rule_view` shows it) in the parameter's own
        layout: ``[in, out]`` again where it is stored so, sharded like the parameter."""
        flip = name in self.in_out_params  # GPT-2 Conv1D [in, out]: the rule sees [out, in]
        return shard_like(mask.t().contiguous() if flip else mask, self.sparse_params[name].param)

    def pending(self, name: str, mask: torch.Tensor) -> install.NewMask:
        """``name``'s new ``mask`` as the update keeps it until `install` (`install.pending`:
        packed bits for a weight held elsewhere)."""
        return install.pending(self.sparse_params[name], mask)

    def install(
        self, masks: dict[str, install.NewMask], targets: dict[str, float], step: int
    ) -> None:
        """Copy the update's ``masks`` into the mask buffers and prune the weights
        (`install.install`), record ``dropped`` / ``grown`` / ``sparsity`` / ``itop`` per
        parameter (0-d tensors: no host sync) and each mask's target, and tell the observers of
        the update at ``step``; gradients and optimizer state are pruned again before the step."""
        stats = install.install(self.sparse_params, masks, self.hooks)
        self.last_update, self.unlogged_update = stats, True
        self.mask_targets.update({n: targets[n] for n in masks})
        self.hooks.changed()
        self.observers.emit_sparsity(self.owner, self.sparse_params, self.mask_target)
        self.observers.emit_update(self.owner, step, stats)

    # ------------------------------------------------------------------ 3. a move
    def follow_mask(self, name: str) -> None:
        """The module let ``name``'s mask go (`StepHooks.on_mask_dropped`): the last update's
        figures of ``name`` follow the mask that replaced it to its device (a move), so nothing
        stays behind on the old one."""
        sp, stats = self.sparse_params.get(name), self.last_update.get(name)
        mask = sp.module._buffers.get(sp.mask_name) if sp is not None else None
        if stats and mask is not None:
            self.last_update[name] = {k: v.to(mask.device) for k, v in stats.items()}

    # ------------------------------------------------------------------ 4. checkpoints
    def pack(
        self, *, step: int, last_update_step: int, kind: str, config: dict[str, str]
    ) -> dict[str, Any]:
        """The algorithm's state (`saved_state.pack_state`): its counters, ``kind`` and
        ``config``, with the seed, the masks (packed 1 bit per element; a sharded one gathered:
        call it on every rank), ``removed`` and the ever-active sets."""
        return saved_state.pack_state(
            step=step,
            last_update_step=last_update_step,
            seed=self.seed,
            kind=kind,
            masks={name: sp.mask for name, sp in self.sparse_params.items()},
            config=config,
            removed=self.removed,
            ever_active=self.ever_active,
        )

    def expected(self, kind: str, config: dict[str, str]) -> saved_state.Expected:
        """What a state must agree with to load here (`saved_state.check_state`): the
        algorithm's ``kind`` and ``config``, the masks' shapes (none before ``apply``), the
        seed and the ever-active sets."""
        return saved_state.Expected(
            owner=self.name,
            kind=kind,
            shapes={name: list(sp.mask.shape) for name, sp in self.sparse_params.items()},
            config=config,
            seed=self.seed,
            seed_given=self.seed_given,
            ever_active={name: tuple(m.shape) for name, m in self.ever_active.items()},
            applied=self.root is not None,
        )

    def restore(
        self, state: Mapping[str, Any], masks: Mapping[str, torch.Tensor], targets: dict[str, float]
    ) -> None:
        """Restore a checked ``state`` (`saved_state`): the seed, the ever-active sets, the
        saved ``masks`` in place (all ones for a removed algorithm's state) after the values a
        model load just zeroed that they keep, then prune; each mask's target from ``targets``.
        Gradients and optimizer state are pruned before the next step."""
        self.seed = state.get("seed", self.seed)
        saved_state.restore_ever_active_(self.ever_active, saved_state.saved_ever_active(state))
        unpruned, self.hooks.unpruned = self.hooks.unpruned, {}
        removed = bool(state.get("removed"))
        saved_state.restore_masks_(self.sparse_params, masks, removed, unpruned)
        self.mask_targets.update(targets)
        self.hooks.adopt_masks()  # written: they are the masks, even after ``to_empty``
        self.hooks.changed()

    # ------------------------------------------------------------------ 5. remove
    def remove(self) -> None:
        """Remove masks and every hook: the model and optimizers train dense from here on."""
        self.hooks.remove()
        for sp in self.sparse_params.values():
            sp.remove_mask()
        applied.forget(self.root, self.owner)
        ddp_ignore.restore_ignored(self.root, self.name)
        self.sparse_params.clear()
        self.removed = True
