"""`SparsityAlgorithm`: the one base of every algorithm; it owns masks, ``step`` and the rule.

An algorithm is one method, ``update_mask(name, p, mask, sparsity) -> mask``, over this base: a
sparsity schedule, an update cadence (Cerebras: ``{"freq", "start", "stop"}``, stop exclusive;
``{"steps": [...]}``; a callable; ``None`` = every step; training starts sparse when step 0 is an
update step), the initial mask, the layer distribution and the structure (shaper). ``step``
counts completed optimizer steps; the update for step ``t`` runs after its gradients are
accumulated, before its optimizer step (Evci et al. 2020, Algorithm 1).

The class reads top to bottom as the algorithm's life: the schedule (which steps update, to what
sparsity), ``apply`` (a model: the initial masks, which its masks' state selects for, checks,
attaches and prunes, all or nothing; an optimizer: its step hooks), the step (``before_step``:
``update``; after it: ``step += 1``), checkpoints (``state_dict`` / ``load_state_dict``) and
``remove``. The class decides; the masks, their state and the mechanics that apply them,
install an update's, follow them on a move, save and restore them and remove them are its
`mask_state` (`mask_state.MaskState`). What else it calls is pure (`saved_state`'s checks and
readers, `masking`) or the per-step path (`per_step`), which keeps pruned entries at exactly 0
between the moments decided here.
"""

from __future__ import annotations

import inspect
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import apply_model, legacy, report, saved_state, validate
from ..apply_checks import check_optimizer, check_shaper
from ..cadences import make_update_schedule
from ..distributions import LayerSparsity
from ..filters import ParamFilter, make_param_filter
from ..init_methods import make_init_method
from ..install import NewMask
from ..mask_state import MaskState
from ..masking import all_finite
from ..observers import Observers, SparsityHook, UpdateHook
from ..rng import generator_for
from ..scaler_steps import SkippedSteps, found_inf
from ..schedules import ScheduleSpec, UpdateSpec, bind, check_schedule, evaluate
from ..selection import Candidate
from ..shapers import Shaper, Unstructured
from .registry import register_algorithm

__all__ = ["DynamicSparsityAlgorithm", "SparsityAlgorithm"]

_counter = itertools.count()
# The rule's signature: (name, p, mask, sparsity) -> new mask (`SparsityAlgorithm.update_mask`).
Rule = Callable[[str, torch.Tensor, torch.Tensor, float], torch.Tensor]


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
        for method in ("update_mask", "grow_score"):  # written before the rule took the name
            adapted = legacy.named_rule(cls, method)
            if adapted is not None:
                setattr(cls, method, adapted)
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
        seed = validate.seed(seed)
        self.shaper = check_shaper(shaper) if shaper is not None else Unstructured()
        self.layers = LayerSparsity(distribution, erk_power_scale)
        self.track_itop = bool(track_itop)
        self.name = f"sparsity_{type(self).__name__.lower()}_{next(_counter)}"
        self._skips = SkippedSteps()  # fused steps under a GradScaler, maybe skipped
        self.step = 0
        self.autoupdate = True  # optimizer steps update the masks (False: call update() yourself)
        # The name of the training loop that calls `before_step` itself, after the last
        # backward: set by a layer above (the Lightning callback: "lightning.Trainer"; the
        # transformers Trainer callback); None: the optimizer's step pre-hook calls it.
        self.step_driver: str | None = None
        self.check_finite = False  # set under AMP: skip updates on steps the scaler will skip
        self.last_update_step = -1
        self.observers = Observers()
        # The masks: the model, its sparse parameters, their state and the mechanics that
        # apply, change and remove them; this class decides, `mask_state` carries it out.
        self.mask_state = MaskState(
            self,
            self.name,
            shaper=self.shaper,
            layers=self.layers,
            param_filter=self.param_filter,
            init_method=self.init_method,
            track_itop=self.track_itop,
            seed=seed,
            observers=self.observers,
        )
        self.check_range(self.horizon())

    # ------------------------------------------------------------------ the rule (subclasses)
    @abstractmethod
    def update_mask(
        self, name: str, p: torch.Tensor, mask: torch.Tensor, sparsity: float
    ) -> torch.Tensor:
        """The rule: the new bool mask of the parameter ``name``.

        Args:
            name: the parameter's full name (for its random stream, `generator`, and messages).
            p: its values, whole and ``[out, in]`` (a shard gathered, a parameter stored
                ``[in, out]`` transposed), ``.grad`` set when the update reads a gradient.
            mask: its current mask, the same view.
            sparsity: its target sparsity after the update (the schedule, spread per layer).

        Returns:
            A bool mask of ``p``'s shape.
        """

    def milestones(self) -> tuple[int, ...]:
        """Steps that are update steps whatever the cadence (none by default)."""
        return ()

    # ------------------------------------------------------------------ the masks' state
    # Held by `mask_state` (`MaskState`'s attributes); read here by Group, the layers above and
    # the device.
    root = property(lambda self: self.mask_state.root)
    sparse_params = property(lambda self: self.mask_state.sparse_params)
    in_out_params = property(lambda self: self.mask_state.in_out_params)
    mask_targets = property(lambda self: self.mask_state.mask_targets)
    last_update = property(lambda self: self.mask_state.last_update)
    unlogged_update = property(
        lambda self: self.mask_state.unlogged_update,
        lambda self, value: setattr(self.mask_state, "unlogged_update", value),
    )
    removed = property(lambda self: self.mask_state.removed)
    seed = property(lambda self: self.mask_state.seed)
    seed_given = property(lambda self: self.mask_state.seed_given)
    hooks = property(lambda self: self.mask_state.hooks)
    ever_active = property(lambda self: self.mask_state.ever_active)

    # ------------------------------------------------------------------ schedule
    @property
    def step(self) -> int:
        """Completed optimizer steps. A fused optimizer's step that a ``GradScaler`` skipped
        (overflow) is taken back when the count is next read (`scaler_steps`)."""
        self._step -= self._skips.settle()
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._skips.clear()
        self._step = value

    def _update_may_be_due(self) -> bool:
        """Whether an update may be due at this step, without waiting for the overflow flags of
        fused steps still on their way (`scaler_steps`): the step is one of a few values then.
        """
        self._step -= self._skips.settle(wait=False)
        return any(
            step != self.last_update_step and self.is_update_step(step)
            for step in range(self._step - self._skips.pending, self._step + 1)
        )

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
        return self.needs_dense_grad and self._update_may_be_due()

    def target_sparsity(self, name: str, step: int) -> float:
        """Sparsity of ``name`` at ``step``: the schedule, checked, spread by ``distribution``."""
        value = evaluate(self.sparsity, step, "sparsity")
        validate.sparsity(value, where=name, step=step, schedule=self.sparsity)
        return self.layers(name, value)

    def initial_target(self, name: str) -> float:
        """Sparsity of the mask ``initial_mask`` builds (0 when training starts dense)."""
        return self.target_sparsity(name, 0) if self.starts_sparse else 0.0

    def horizon(self) -> int:
        """The last step known without the run's length: the cadence's or the ramp's end (the
        Lightning layer checks up to ``max_steps``; each value is checked again when used)."""
        last = self.update_schedule.last()
        return last if last is not None else max((*self.sparsity.milestones(), 0))

    def check_range(self, horizon: int) -> None:
        """Check every scheduled value used in steps ``[0, horizon]``, in range and finite, and
        that no schedule overflows at any later update step (an ``Exp`` with gamma > 0): run when
        built, by the Lightning layer up to ``max_steps``, and on every value when used."""
        extra = (0, *self.milestones())
        check_schedule(
            self.sparsity, "sparsity", self.update_schedule, horizon, extra, validate.sparsity
        )

    # ------------------------------------------------------------------ apply
    def __call__(self, module: nn.Module) -> None:
        """``model.apply(sparsity)``: torch calls this on every submodule, the model last; only
        the model's call acts (`model_apply_visits_child`), so filters see full names."""
        if not apply_model.model_apply_visits_child(module):
            self.apply(module)

    def apply(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        """Sparsify a model (masks, pruning; all or nothing) or an optimizer (its step hooks;
        the optimizer applied last advances ``step``)."""
        if isinstance(obj, nn.Module):
            self.mask_state.apply(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            check_optimizer(self.name, self.root, obj, self.hooks.optimizers)
            self.hooks.attach_optimizer(obj, self._pre_step, self._post_step)
        else:
            raise TypeError(
                f"{type(self).__name__}.apply expects an nn.Module or a torch.optim.Optimizer, got "
                f"{type(obj).__name__}"
            )

    def select(self, root: nn.Module) -> list[Candidate]:
        """The parameters of ``root`` this algorithm's filter picks, in registration order
        (`MaskState.select`: warns of glob patterns that select nothing, frozen weights)."""
        return self.mask_state.select(root)

    def initial_mask(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The mask at ``apply``: ``init_method`` at the step-0 target (checked), or all-ones when
        training starts dense (step 0 is not an update step)."""
        if not self.starts_sparse:
            return torch.ones_like(param, dtype=torch.bool)
        if param.is_meta:  # built sparse: drawn when the weight is made (`materialize`)
            return torch.empty(param.shape, dtype=torch.bool, device="meta")
        generator = generator_for(self.mask_state.applied_seed(), 0, name, param.device)
        target, in_out = self.initial_target(name), name in self.in_out_params
        return apply_model.initial_mask(
            name, param, self.init_method, target, generator, self.shaper, in_out
        )

    def materialize(self, name: str) -> None:
        """``name``'s parameter, applied to on the meta device, now holds its initial values (a
        model built sparse, `core.materialize`): draw its mask as ``apply`` would have (same
        seed, same generator, so the mask a dense build gets), prune the weight and follow it.

        Raises:
            KeyError: ``name`` is not one of this algorithm's parameters.
            ValueError: its parameter is still on the meta device.
        """
        self.mask_state.materialize(name)

    def initial_masks(self, chosen: list[Candidate]) -> list[torch.Tensor]:
        """Initial masks of the chosen ``(name, module, attr, param)`` candidates."""
        return [self.initial_mask(name, param) for name, _, _, param in chosen]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Optimizers this algorithm is applied to; the last one advances ``step``."""
        return self.hooks.optimizers

    def detach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remove this algorithm's hooks from ``optimizer`` (e.g. one a new fit replaced)."""
        self.hooks.detach_optimizer(optimizer)

    # ------------------------------------------------------------------ the step
    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the last backward, before ``optimizer.step()``: follow replaced tensors, update
        the masks on update steps (if ``autoupdate``), prune (`per_step`). Plain PyTorch calls it
        from the optimizer's step pre-hook; a training loop that set itself as `step_driver`
        calls it itself (Lightning from ``on_before_optimizer_step``)."""
        self.hooks.start_step()
        if self.autoupdate:
            self.update(optimizer)
        self.hooks.sync(optimizer)
        if not self.check_finite:  # under AMP a skipped step would leave them held
            self.hooks.hold_denominators(optimizer)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.step_driver is None:  # else the loop above calls before_step itself
            self.before_step(optimizer)

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        optimizers = self.hooks.optimizers
        if optimizers and optimizer is optimizers[-1]:  # the optimizer applied last counts
            self._step += 1
            flag = found_inf(optimizer)
            if flag is not None:  # a GradScaler's fused step: it may have skipped itself
                self._skips.note(flag)
        self.hooks.after_step(optimizer)

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Recompute the masks on update steps (once per step), before the optimizer step. In a
        plain loop that clips gradients, call it before clipping on update steps."""
        if not self.sparse_params or not self._update_may_be_due():
            return  # decided without waiting for a fused step's overflow flag
        if self.last_update_step == self.step or not self.is_update_step():
            return
        if self._overflowed(optimizer):
            return  # the scaler skips this step: the step is not counted, retried at the next
        with torch.no_grad():
            targets = {name: self.target_sparsity(name, self.step) for name in self.sparse_params}
            masks = self.compute_masks(targets)
        self.last_update_step = self.step
        self.mask_state.install(masks, targets, self.step)
        if optimizer is None:  # called by hand: mask the gradients for clipping now
            for opt in self.hooks.optimizers:
                self.hooks.sync(opt)

    def _overflowed(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether a ``GradScaler`` will skip this step: the overflow flag it gave a fused
        ``optimizer`` (`scaler_steps.found_inf`), else, under AMP (``check_finite``), whether a
        gradient holds inf or NaN (one host sync, on update steps only)."""
        flag = found_inf(optimizer) if optimizer is not None else None
        if flag is not None:
            return bool(flag)
        if not self.check_finite:
            return False
        grads = [sp.param.grad for sp in self.sparse_params.values()]
        return not all_finite([g for g in grads if g is not None])

    def compute_masks(self, targets: dict[str, float]) -> dict[str, NewMask]:
        """New masks by ``update_mask``, one parameter at a time (a sharded one gathered with its
        gradient first, so top-k sees the whole tensor; a held one packed, `install.pending`);
        frozen parameters keep theirs."""
        masks = {}
        for name, sp in self.sparse_params.items():
            if sp.param.requires_grad:  # frozen (PEFT base weights): a fixed mask
                masks[name] = self.mask_state.pending(name, self.mask_of(name, targets[name]))
        return masks

    def mask_of(self, name: str, target: float, rule: Rule | None = None) -> torch.Tensor:
        """``name``'s new mask at sparsity ``target`` by ``rule`` (default: `update_mask`),
        which sees the parameter and its mask as `update_mask` does (`MaskState.rule_param`,
        `MaskState.rule_view`: whole, ``[out, in]``)."""
        rule = self.update_mask if rule is None else rule
        state = self.mask_state
        new = rule(name, state.rule_param(name), state.rule_view(name), target)
        return state.stored(name, new)

    def generator(self, name: str, device: torch.device) -> torch.Generator:
        """The random stream of the parameter ``name`` at this step, on ``device``: the same on
        every rank and after a resume (`rng.generator_for`)."""
        return generator_for(self.mask_state.applied_seed(), self.step, name, device)

    # ------------------------------------------------------------------ reports and observers
    def mask_target(self, name: str) -> float:
        """Sparsity the current mask of ``name`` was built for."""
        return self.mask_targets[name]

    def overall_sparsity(self) -> tuple[float, torch.Tensor]:
        """(target, actual) over the sparse parameters, weighted by size (actual: 0-d tensor)."""
        return report.overall_sparsity(self.sparse_params, self.mask_target)

    def itop_rate(self) -> torch.Tensor:
        """Share of the sparse weights ever active (0-d tensor; no host sync)."""
        return report.itop_rate(self.ever_active)

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """``hook(algorithm, step, stats)`` after each mask update (`observers.UpdateHook`)."""
        return Observers.add(self.observers.update, hook)

    def register_target_sparsity_hook(self, hook: SparsityHook) -> RemovableHandle:
        """``hook(algorithm, name, target: float)`` whenever masks are (re)computed."""
        return Observers.add(self.observers.target, hook)

    def register_computed_sparsity_hook(self, hook: SparsityHook) -> RemovableHandle:
        """``hook(algorithm, name, actual: 0-d tensor)`` whenever masks are (re)computed."""
        return Observers.add(self.observers.computed, hook)

    # ------------------------------------------------------------------ checkpoints
    def config(self) -> dict[str, str]:
        """What a checkpoint must agree on to be resumed (reprs stable across processes)."""
        return {
            "sparsity": repr(self.sparsity),
            "update": repr(self.update_schedule),
            "shaper": repr(self.shaper),
            "distribution": self.layers.name,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values and tensors, loadable with ``torch.load(weights_only=True)``
        (`saved_state`). ``"masks"``: ``{name: uint8[ceil(numel / 8)]}`` on the CPU, shapes in
        ``"params"`` (a sharded mask is all-gathered: call it on every rank). The mask buffers
        are non-persistent, so ``model.state_dict()`` holds the pruned weights only."""
        return self.mask_state.pack(
            step=self.step,
            last_update_step=self.last_update_step,
            kind=type(self).__name__.lower(),
            config=self.config(),
        )

    def check_state_dict(self, state: Any, loading: bool = False) -> None:
        """Raise unless ``state`` can be loaded (`saved_state.check_state`); changes nothing, and
        works before ``apply`` (masks are then checked against the shapes the state records)."""
        expected = self.mask_state.expected(type(self).__name__.lower(), self.config())
        saved_state.check_state(state, expected, self.target_sparsity, loading=loading)

    def load_state_dict(self, state: Any) -> None:
        """Check ``state`` completely (another algorithm, other parameters, shapes or
        hyper-parameters, a different explicit seed, a corrupt mask: ``ValueError`` /
        ``KeyError`` / ``TypeError``, nothing changed), then restore it: the counters and seed,
        the masks in place (all ones for a removed algorithm's state, VariableSPDF's dense stage),
        the values a model load just zeroed that these masks keep, then prune; gradients and
        optimizer state are pruned before the next step."""
        self.check_state_dict(state, loading=True)
        targets = saved_state.saved_targets(
            state, list(self.sparse_params), self.target_sparsity, self.name
        )
        masks = saved_state.saved_masks(state, self.name)
        self.step = state["step"]
        self.last_update_step = state.get("last_update_step", -1)
        self.mask_state.restore(state, masks, targets)

    def remove(self) -> None:
        """Remove masks and every hook: the model and optimizers train dense from here on."""
        self.mask_state.remove()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, params={len(self.sparse_params)})"


DynamicSparsityAlgorithm = SparsityAlgorithm
"""The name earlier versions gave the base of dynamic algorithms; one base serves all now (an
alias, `legacy`: removed in 0.3.0)."""
