"""The per-step path: keeps pruned weights, gradients and optimizer state at exactly 0.

One `StepHooks` per algorithm installs official PyTorch hooks only:

- a post-accumulate-grad hook per sparse parameter zeroes its gradient at pruned positions as
  backward produces it (NaN/inf too, so AMP never skips a step for a pruned entry; plain-PyTorch
  gradient clipping sees masked gradients), and the weight with it, while both are in cache (a
  weight written by anything since the last step, ``.data`` included, is 0 before weight decay
  can carry it into the state). On steps whose update reads the dense gradient (RigL, GraNet)
  it leaves the gradient dense;
- ``before_step`` (the optimizer's step pre-hook in plain PyTorch; ``on_before_optimizer_step``
  under Lightning, which runs after the last backward) follows replaced parameters and masks,
  updates the masks, then zeroes every gradient and weight the hook did not (a gradient
  assigned with ``p.grad = g``; a tensor written in place since, by its version counter; the
  dense gradient of an update) and, when something changed, the same-shape optimizer state;
- the step post-hook advances the algorithm's ``step`` (for the optimizer applied last). For
  optimizers whose update can be nonzero at a pruned position (Adamax's ``exp_inf``, Rprop's
  step sizes, any unknown optimizer) it re-prunes weights and state; the others keep exact
  zeros where weight, gradient and state are 0 (weights are re-pruned after them too while a
  same-shape state tensor is opted out with ``requires_dense``).

Gradient clipping in a plain loop: on update steps call ``sparsity.update()`` after backward and
before ``clip_grad_norm_`` (it installs the new masks and masks the gradients, which RigL and
GraNet leave dense for their grow score); on other steps the hooks have already masked them. The
norm clipping measures is then the norm of the gradient the step applies.

Hooks are held by `_Hook` wrappers that pickle and deep-copy as no-ops, so ``torch.save(model)``
and ``copy.deepcopy(model)`` work and the copy carries masks but no live algorithm.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .masking import zero_pruned_foreach_
from .sparse_parameter import SparseParameter

if TYPE_CHECKING:
    from .algorithms.base import SparsityAlgorithm

__all__ = ["StepHooks", "state_keeps_zero"]

# Optimizers whose same-shape state stays exactly 0 where gradient and state are 0 (every term
# is a multiple of the gradient or of the state): their state is re-pruned only when masks or
# state change. Exact types only; everything else is re-pruned after every step.
_STATE_KEEPS_ZERO = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "NAdam", "RAdam", "Adagrad", "Adadelta", "ASGD", "RMSprop")
    if hasattr(torch.optim, name)
)


def state_keeps_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` keeps same-shape state, and a zero weight, at 0 where the
    gradient and the state are 0: a type of the table, with ``eps > 0`` (``eps == 0`` makes 0 / 0
    = NaN at pruned positions; a tensor ``eps`` is not inspected, to avoid a host sync)."""
    if type(optimizer) not in _STATE_KEEPS_ZERO:
        return False
    for group in optimizer.param_groups:
        eps = group.get("eps", 1.0)
        if not isinstance(eps, int | float) or eps <= 0:
            return False
    return True


def _inert(*args: Any, **kwargs: Any) -> None:
    """What a copied or unpickled hook does: nothing (the copy has no live algorithm)."""


class _Hook:
    """A hook callable that pickles and deep-copies as `_inert`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[..., None], tuple[()]]:
        return (_make_inert, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert


def _make_inert() -> Callable[..., None]:
    return _inert


class StepHooks:
    """Installs and runs the per-step path of one algorithm (see the module docstring)."""

    def __init__(self, algorithm: SparsityAlgorithm) -> None:
        self.algorithm = algorithm
        # Held weakly: an optimizer the user drops (a swap) is not kept alive with its state.
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._handles: dict[str, RemovableHandle] = {}  # grad hooks by parameter name
        self._root_handles: list[RemovableHandle] = []
        self._optimizer_handles: dict[int, list[RemovableHandle]] = {}
        self._hooked: dict[str, nn.Parameter] = {}  # the parameter object each hook is on
        self._masks: dict[str, torch.Tensor] = {}  # the mask tensor object each name had
        self._masked_grad: dict[str, tuple[weakref.ref, int]] = {}  # (grad, its _version)
        self._pruned_weight: dict[str, int] = {}  # the weight's _version when the hook pruned it
        self._synced: dict[int, int] = {}  # optimizer id -> mask version its state was pruned at
        self._state_len: dict[int, int] = {}
        self._dense_state: set[int] = set()  # optimizers with requires_dense same-shape state
        self.version = 0  # bumped whenever masks, parameters or loaded state change
        # Between a model load and the next step (`checkpoint`): masks an earlier version's
        # state dict brought, and weight values the load's pruning zeroed.
        self.incoming_masks: dict[str, torch.Tensor] = {}
        self.unpruned: dict[str, Any] = {}

    # ------------------------------------------------------------------ installation
    def install(self, root: nn.Module, sps: list[SparseParameter]) -> None:
        """Gradient hooks on ``sps`` and load hooks on ``root``."""
        for sp in sps:
            self._hook_param(sp)
        if sps:
            alg = self.algorithm
            self._root_handles = [
                root.register_load_state_dict_pre_hook(_Hook(alg.check_incoming_state)),
                root.register_load_state_dict_post_hook(_Hook(self._after_load)),
            ]
        self.version += 1

    def _hook_param(self, sp: SparseParameter) -> None:
        old = self._handles.pop(sp.name, None)
        if old is not None:
            old.remove()
        param = sp.param
        if param.requires_grad:
            self._handles[sp.name] = param.register_post_accumulate_grad_hook(
                _Hook(self._grad_hook(sp))
            )
        self._hooked[sp.name] = param
        self._masks[sp.name] = sp.mask

    def _grad_hook(self, sp: SparseParameter) -> Callable[[torch.Tensor], None]:
        def mask_grad(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            mask = sp.mask
            if mask is not self._masks.get(sp.name):  # replaced since the last step (to_empty,
                mask = self._masks.get(sp.name)  # .to()): the values are the known mask's
                if mask is None or mask.device != grad.device:
                    return  # before_step restores the mask, then masks this gradient
            # The weight too, while it is in cache: every backward node that read it has run.
            # Through ``.data``, so a graph kept with retain_graph=True stays usable.
            weight = param.data
            if self.algorithm.dense_grad_needed:  # keep it dense, minus non-finite pruned entries
                zero_pruned_foreach_([grad, weight], [mask | grad.isfinite(), mask])
            else:
                zero_pruned_foreach_([grad, weight], [mask, mask])
                self._masked_grad[sp.name] = (weakref.ref(grad), grad._version)
            self._pruned_weight[sp.name] = param._version

        return mask_grad

    def guards(self, name: str, param: torch.Tensor) -> bool:
        """Whether the gradient hook of ``name`` is installed on this very ``param``: its pruned
        weight entries and gradient are then exactly 0 after every backward."""
        return self._hooked.get(name) is param and name in self._handles

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The attached optimizers still alive, in attach order; the last one advances ``step``."""
        return [o for o in (ref() for ref in self._optimizers) if o is not None]

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step pre/post hooks and a load-state hook on ``optimizer``; it now drives ``step``."""
        self._optimizers.append(weakref.ref(optimizer, self._forget(id(optimizer))))
        self._optimizer_handles[id(optimizer)] = [
            optimizer.register_step_pre_hook(_Hook(self._pre_step)),
            optimizer.register_step_post_hook(_Hook(self._post_step)),
            optimizer.register_load_state_dict_post_hook(_Hook(self._state_loaded)),
        ]
        self.sync(optimizer, force=True)

    def detach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remove this algorithm's hooks from ``optimizer``."""
        for handle in self._optimizer_handles.pop(id(optimizer), []):
            handle.remove()
        self._optimizers = [ref for ref in self._optimizers if ref() is not optimizer]
        self._drop_records(id(optimizer))

    def _forget(self, key: int) -> Callable[[weakref.ref], None]:
        """Weakref callback: an attached optimizer was garbage-collected (its hooks went with
        it); drop what was recorded under its id, which a new object may reuse."""

        def forget(ref: weakref.ref) -> None:
            self._optimizers = [r for r in self._optimizers if r is not ref]
            self._optimizer_handles.pop(key, None)
            self._drop_records(key)

        return forget

    def _drop_records(self, key: int) -> None:
        self._synced.pop(key, None)
        self._state_len.pop(key, None)
        self._dense_state.discard(key)

    def remove(self) -> None:
        """Remove every hook (optimizers, parameters, root)."""
        for optimizer in list(self.optimizers):
            self.detach_optimizer(optimizer)
        for handle in [*self._handles.values(), *self._root_handles]:
            handle.remove()
        self._handles, self._root_handles = {}, []
        self._hooked, self._masks, self._masked_grad, self._pruned_weight = {}, {}, {}, {}
        self.incoming_masks, self.unpruned = {}, {}

    # ------------------------------------------------------------------ the step
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.algorithm.lightning_driven:  # Lightning calls before_step itself, later
            self.before_step(optimizer)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the last backward, before ``optimizer.step()``: follow replaced tensors, update
        masks (if ``autoupdate``), then prune gradients and, if needed, weights and state."""
        self.unpruned = {}  # a sparsity state loads before training goes on, or never
        self.rebind()
        if self.algorithm.autoupdate:
            self.algorithm.update(optimizer)
        self.sync(optimizer)

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.optimizers and optimizer is self.optimizers[-1]:
            self.algorithm.step += 1
        sps = self.params_of(optimizer)
        if not sps:
            return
        if not state_keeps_zero(optimizer):  # its update can be nonzero at a pruned position
            zero_pruned_foreach_([sp.param for sp in sps], [sp.mask for sp in sps])
            self._prune_state(optimizer, sps)
            return
        if id(optimizer) in self._dense_state:  # opted-out (requires_dense) state moves weights
            zero_pruned_foreach_([sp.param for sp in sps], [sp.mask for sp in sps])
        if len(optimizer.state) != self._state_len.get(id(optimizer)):
            self._prune_state(optimizer, sps)

    def params_of(self, optimizer: torch.optim.Optimizer) -> list[SparseParameter]:
        """This algorithm's sparse parameters that ``optimizer`` steps."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return [sp for sp in self.algorithm.sparse_params.values() if id(sp.param) in ids]

    def sync(self, optimizer: torch.optim.Optimizer, force: bool = False) -> None:
        """Zero every gradient and weight the hooks did not (assigned ``p.grad = g``, written
        since, dense for an update); everything, state too, when masks or tensors changed."""
        sps = self.params_of(optimizer)
        changed = force or self._synced.get(id(optimizer)) != self.version
        pending = [
            (sp, grad)
            for sp in sps
            if (grad := sp.param.grad) is not None and (changed or not self._masked(sp.name, grad))
        ]
        if pending:
            zero_pruned_foreach_([grad for _, grad in pending], [sp.mask for sp, _ in pending])
            for sp, grad in pending:
                self._masked_grad[sp.name] = (weakref.ref(grad), grad._version)
        # Weights: the hook pruned them in backward; prune here those it did not, or that were
        # written in place since (version counters; weight decay would carry them into state).
        stale = [
            sp for sp in sps if changed or self._pruned_weight.get(sp.name) != sp.param._version
        ]
        if stale:
            zero_pruned_foreach_([sp.param for sp in stale], [sp.mask for sp in stale])
            for sp in stale:
                self._pruned_weight[sp.name] = sp.param._version
        if changed or len(optimizer.state) != self._state_len.get(id(optimizer)):
            self._prune_state(optimizer, sps)
            self._synced[id(optimizer)] = self.version

    def _masked(self, name: str, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is the gradient the hook masked, unchanged since."""
        seen = self._masked_grad.get(name)
        return seen is not None and seen[0]() is grad and seen[1] == grad._version

    def _prune_state(self, optimizer: torch.optim.Optimizer, sps: list[SparseParameter]) -> None:
        tensors, masks, opted_out = [], [], False
        for sp in sps:
            for value in optimizer.state.get(sp.param, {}).values():
                if torch.is_tensor(value) and value.shape == sp.param.shape:
                    if getattr(value, "requires_dense", False):
                        opted_out = True
                    else:
                        tensors.append(value)
                        masks.append(sp.mask)
        zero_pruned_foreach_(tensors, masks)
        self._state_len[id(optimizer)] = len(optimizer.state)
        if opted_out:
            self._dense_state.add(id(optimizer))
        else:
            self._dense_state.discard(id(optimizer))

    def _state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self._state_len.pop(id(optimizer), None)  # pruned again before the next step

    # ------------------------------------------------------------------ replaced tensors
    def rebind(self, prune: bool = True) -> bool:
        """Follow parameters and masks replaced since the last step (``setattr`` of a new
        Parameter, ``load_state_dict(assign=True)``, ``to_empty``, ``.to()``) and prune them
        (unless ``prune`` is False); returns whether anything was replaced. A mask buffer whose
        values were lost (``to_empty``) gets its values back; one created on the meta device is
        built from the materialized weights."""
        changed = False
        for name, sp in self.algorithm.sparse_params.items():
            param = sp.module._parameters.get(sp.param_name)
            mask = sp.module._buffers.get(sp.mask_name)
            if param is self._hooked.get(name) and mask is self._masks.get(name):
                continue
            changed = True
            if mask is not self._masks.get(name):
                self._restore_mask(sp, self._masks.get(name), mask)
            self._hook_param(sp)
            if prune:
                sp.prune_()
        if changed:
            self.version += 1
        return changed

    def _restore_mask(
        self, sp: SparseParameter, old: torch.Tensor | None, new: torch.Tensor | None
    ) -> None:
        param = sp.param
        if old is None or old.is_meta:
            built = self.algorithm.initial_mask(sp.name, param.detach())
            sp.register_mask(built.to(param.device))
        elif new is None or new.is_meta or not torch.equal(old.to(new.device), new):
            sp.register_mask(old.to(param.device))

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        for name, sp in self.algorithm.sparse_params.items():
            self._masks[name] = sp.mask
        self.rebind(prune=False)  # parameters assigned by the load get their hooks
        self.algorithm.model_loaded()  # incoming masks adopted, weights pruned
        self.version += 1
