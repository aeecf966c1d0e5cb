"""`SparsityAlgorithm`: the one base of every algorithm; it owns masks, ``step`` and the rule.

An algorithm is one method, ``update_mask(p, mask, sparsity) -> mask``, over this base: a
sparsity schedule, an update cadence (Cerebras: ``{"freq", "start", "stop"}``, stop exclusive;
``{"steps": [...]}``; a callable; ``None`` = every step; training starts sparse when step 0 is an
update step), the initial mask, the layer distribution and the structure (shaper). ``step``
counts completed optimizer steps; the update for step ``t`` runs after its gradients are
accumulated, before its optimizer step (Evci et al. 2020, Algorithm 1). Elsewhere: the per-step
path (`per_step`), apply (`attach`), checkpoints (`checkpoint`), observers (`observers`).
"""

from __future__ import annotations

import inspect
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from .. import report, validate
from ..distributions import LayerSparsity
from ..filters import ParamFilter, make_param_filter
from ..init_methods import make_init_method
from ..layouts import as_out_in
from ..observers import Observers
from ..per_step import StepHooks
from ..rng import generator_for
from ..schedules import (
    HyperParameterSchedule,
    ScheduleSpec,
    UpdateSpec,
    bind,
    evaluate,
    make_update_schedule,
)
from ..selection import Candidate
from ..shapers import Shaper, Unstructured
from ..sharding import full, is_sharded, shard_like
from . import attach, checkpoint, mask_update, ranges
from .registry import register_algorithm

__all__ = ["DynamicSparsityAlgorithm", "SparsityAlgorithm"]

_counter = itertools.count()


class SparsityAlgorithm(ABC):
    """Base class. Subclasses implement ``update_mask`` and cite their paper.

    Args:
        sparsity: target sparsity: a float in [0, 1) or a schedule (``{"type": "cubic", ...}``,
            a list = Cycling, a callable ``step -> float``); checked over the training range.
        update: when masks change (module docstring). ``None``: every step.
        init_method: ``random``, ``topk``, ``from_zeros``, ``checkerboard`` or a callable
            ``(p, sparsity, *, generator, shaper) -> bool mask``.
        param_filter: a glob, a list of globs or ``(name, param) -> bool``. Default: trainable
            weights with ``ndim >= 2`` that are not embeddings, norms or output heads.
        seed: seeds every random choice through ``(seed, step, name)``; ``None``: the
            experiment's torch seed (rank 0's under torch.distributed).
        shaper: structure: ``Unstructured()`` (default), ``OutputGroups``, ``InputGroups``,
            ``NM``, ``Blocks``.
        distribution: ``uniform``, ``er`` or ``erk`` (Evci et al. 2020, arXiv:1911.11134).
        erk_power_scale: exponent on the ER/ERK raw scores (1.0 in the paper).
        track_itop: keep an "ever active" mask per parameter for the ITOP rate (Liu et al.
            2021, arXiv:2102.02887).
    """

    needs_dense_grad: ClassVar[bool] = False  # RigL, GraNet: the grow score reads the gradient

    def __init_subclass__(cls, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if register and not inspect.isabstract(cls):
            register_algorithm(cls)

    def __init__(
        self,
        sparsity: ScheduleSpec,
        update: UpdateSpec = None,
        init_method: str | Callable[..., torch.Tensor] = "random",
        param_filter: str | list[str] | ParamFilter | None = None,
        seed: int | None = None,
        shaper: Shaper | None = None,
        distribution: str = "uniform",
        erk_power_scale: float = 1.0,
        track_itop: bool = True,
    ) -> None:
        self.update_schedule = make_update_schedule(update)
        self.sparsity = bind(sparsity, self.update_schedule, True, check=validate.sparsity)
        self.init_method = make_init_method(init_method)
        self.param_filter = make_param_filter(param_filter)
        self.seed = validate.seed(seed)
        self.seed_given = seed is not None
        self.shaper = attach.check_shaper(shaper) if shaper is not None else Unstructured()
        self.layers = LayerSparsity(distribution, erk_power_scale)
        self.track_itop = bool(track_itop)
        self.name = f"sparsity_{type(self).__name__.lower()}_{next(_counter)}"
        self.step = 0
        self.autoupdate = True  # optimizer steps update the masks (False: call update() yourself)
        self.lightning_driven = False  # set by the Lightning layer: it calls before_step itself
        self.check_finite = False  # set under AMP: skip updates on steps the scaler will skip
        self.root: nn.Module | None = None
        self.sparse_params: OrderedDict[str, Any] = OrderedDict()  # name -> SparseParameter
        self.ever_active: dict[str, torch.Tensor] = {}
        self.last_update: dict[str, dict[str, torch.Tensor]] = {}
        self.unlogged_update = False
        self.last_update_step = -1
        self.mask_targets: dict[str, float] = {}
        self.removed = False  # remove() ran (densify): its state prunes nothing when loaded
        # Parameters stored [in, out] (HF Conv1D, `layouts`); set by `attach.validate`. The
        # init method, shaper and update_mask see them transposed, as [out, in] like nn.Linear.
        self.in_out_params: set[str] = set()
        self._current = ""  # the parameter update_mask works on (name_of)
        self.drop_fraction: HyperParameterSchedule | None = None  # drop-and-grow algorithms
        self.observers = Observers()
        self.hooks = StepHooks(
            self.sparse_params, lambda: self.dense_grad_needed, self.initial_mask
        )
        self.check_range(self.horizon())

    # ------------------------------------------------------------------ the rule (subclasses)
    @abstractmethod
    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """New bool mask for ``p`` (any shape, ``.grad`` set), current ``mask``, at ``sparsity``."""

    def milestones(self) -> tuple[int, ...]:
        """Steps that are update steps whatever the cadence (none by default)."""
        return ()

    # Range checks of the schedules (`ranges.py`): at build, at setup, at every use.
    check_range = ranges.check_range
    drop_fraction_at = ranges.drop_fraction_at
    horizon = ranges.horizon

    # ------------------------------------------------------------------ schedule
    @property
    def starts_sparse(self) -> bool:
        """Whether step 0 is an update step (else masks stay all-ones until the first update)."""
        return bool(self.update_schedule(0))

    def is_update_step(self, step: int | None = None) -> bool:
        """Whether masks change after ``step`` completed steps (default: the current step)."""
        step = self.step if step is None else step
        return step > 0 and (bool(self.update_schedule(step)) or step in self.milestones())

    @property
    def dense_grad_needed(self) -> bool:
        """True while backward must keep the gradient dense for this step's update."""
        return (
            self.needs_dense_grad and self.last_update_step != self.step and self.is_update_step()
        )

    def target_sparsity(self, name: str, step: int) -> float:
        """Sparsity of ``name`` at ``step``: the schedule, checked, spread by ``distribution``."""
        value = evaluate(self.sparsity, step, "sparsity")
        validate.sparsity(value, where=name, step=step, schedule=self.sparsity)
        return self.layers(name, value)

    def initial_target(self, name: str) -> float:
        """Sparsity of the mask ``initial_mask`` builds (0 when training starts dense)."""
        return self.target_sparsity(name, 0) if self.starts_sparse else 0.0

    initial_mask = attach.initial_mask

    def initial_masks(self, chosen: list[Candidate]) -> list[torch.Tensor]:
        """Initial masks of the chosen ``(name, module, attr, param)`` candidates."""
        return [self.initial_mask(name, param) for name, _, _, param in chosen]

    # ------------------------------------------------------------------ apply
    def __call__(self, module: nn.Module) -> None:
        """``model.apply(sparsity)``: torch calls this per submodule, root last; only the root's
        call acts (`attach.is_root_visit`), so filters see full names."""
        if attach.is_root_visit():
            self.apply(module)

    def apply(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        """Sparsify a model (masks, pruning; all or nothing) or an optimizer (its step hooks;
        the optimizer applied last advances ``step``)."""
        if isinstance(obj, nn.Module):
            attach.apply_model(self, obj)
        elif isinstance(obj, torch.optim.Optimizer):
            attach.check_optimizer(self, obj)
            self.hooks.attach_optimizer(obj, self._pre_step, self._post_step)
        else:
            raise TypeError(
                f"{type(self).__name__}.apply expects an nn.Module or a torch.optim.Optimizer, got "
                f"{type(obj).__name__}"
            )

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Optimizers this algorithm is applied to; the last one advances ``step``."""
        return self.hooks.optimizers

    def detach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remove this algorithm's hooks from ``optimizer`` (e.g. one a new fit replaced)."""
        self.hooks.detach_optimizer(optimizer)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the last backward, before ``optimizer.step()``: follow replaced tensors, update
        the masks on update steps (if ``autoupdate``), prune (`per_step`). Lightning calls it
        from ``on_before_optimizer_step``, plain PyTorch from the optimizer's step pre-hook."""
        self.hooks.start_step()
        if self.autoupdate:
            self.update(optimizer)
        self.hooks.sync(optimizer)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.lightning_driven:  # Lightning calls before_step itself, after backward
            self.before_step(optimizer)

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        optimizers = self.hooks.optimizers
        if optimizers and optimizer is optimizers[-1]:  # the optimizer applied last counts
            self.step += 1
        self.hooks.after_step(optimizer)

    # ------------------------------------------------------------------ update
    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Recompute the masks on update steps (once per step), before the optimizer step. In a
        plain loop that clips gradients, call it before clipping on update steps."""
        due = self.sparse_params and self.last_update_step != self.step and self.is_update_step()
        if not due:
            return
        if self.check_finite and not mask_update.grads_finite(self.sparse_params):
            return  # AMP skips this step; the step counter does not advance, retry next time
        with torch.no_grad():
            targets = {name: self.target_sparsity(name, self.step) for name in self.sparse_params}
            masks = self.compute_masks(targets)
        self.last_update_step = self.step
        mask_update.install_masks_(self, masks, targets)
        if optimizer is None:  # called by hand: mask the gradients for clipping now
            for opt in self.hooks.optimizers:
                self.hooks.sync(opt)

    def compute_masks(self, targets: dict[str, float]) -> dict[str, torch.Tensor]:
        """New masks by ``update_mask``, one parameter at a time (a sharded one gathered with its
        gradient first, so top-k sees the whole tensor); frozen parameters keep theirs."""
        masks = {}
        for name, sp in self.sparse_params.items():
            param = p = sp.param
            if not param.requires_grad:  # frozen (PEFT base weights): a fixed mask
                continue
            if is_sharded(param):
                p = full(param.detach())
                p.grad = full(param.grad) if param.grad is not None else None
            self._current = name
            flip = name in self.in_out_params  # GPT-2 Conv1D [in, out]: the rule sees [out, in]
            view, mask = (as_out_in(p), full(sp.mask).t()) if flip else (p, full(sp.mask))
            new = self.update_mask(view, mask, targets[name])
            masks[name] = shard_like(new.t().contiguous() if flip else new, param)
        return masks

    def name_of(self, p: torch.Tensor) -> str:
        """Full name of the parameter ``update_mask`` is working on."""
        return self._current

    def generator(self, p: torch.Tensor) -> torch.Generator:
        """Random stream for ``p`` at this step: the same on every rank and after a resume."""
        return generator_for(self.seed, self.step, self.name_of(p), p.device)

    def mask_target(self, name: str) -> float:
        """Sparsity the current mask of ``name`` was built for."""
        return self.mask_targets[name]

    def itop_rate(self) -> torch.Tensor:
        """Share of the sparse weights ever active (0-d tensor; no host sync)."""
        return report.itop_rate(self.ever_active)

    # Observers (Cerebras' sparsity hooks) and reports: shared with Group, defined once.
    register_update_hook = Observers.register_update_hook
    register_target_sparsity_hook = Observers.register_target_sparsity_hook
    register_computed_sparsity_hook = Observers.register_computed_sparsity_hook
    overall_sparsity = report.overall_sparsity

    # Checkpoints (`checkpoint.py`): step, seed, identity and the masks (packed bits); the
    # mask buffers are non-persistent, so model.state_dict() holds the pruned weights only.
    config = checkpoint.algorithm_config
    state_dict = checkpoint.algorithm_state
    load_state_dict = checkpoint.load_algorithm_state
    check_state_dict = checkpoint.check_algorithm_state  # changes nothing; works before apply

    def remove(self) -> None:
        """Remove masks and every hook: the model and optimizers train dense from here on."""
        self.hooks.remove()
        for sp in self.sparse_params.values():
            sp.remove_mask()
        attach.unregister(self)
        self.sparse_params.clear()
        self.removed = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, params={len(self.sparse_params)})"


DynamicSparsityAlgorithm = SparsityAlgorithm
"""The name earlier versions gave the base of dynamic algorithms; one base serves all now."""
