"""The mask's lifecycle: when pruning happens and what it touches.

A mask is the bool buffer ``<param>_mask`` (True = kept) on the module that owns the parameter
(`sparse_parameter`). `StepHooks` keeps every pruned weight, its gradient and every optimizer
state tensor of the parameter's shape at exactly 0 (`masking`: NaN/inf included) after every
optimizer step, through official PyTorch hooks only. The moments, one method each:

1. **backward** (`_grad_hook`, a post-accumulate-grad hook per parameter): the gradients are
   masked in one pass when the last of a backward arrives (each in its own hook under
   ``torch.distributed``, which reduces each as it comes), so AMP's finiteness check and a plain
   loop's ``clip_grad_norm_`` see them masked. When this step's update reads the dense gradient
   (RigL, GraNet) only its non-finite pruned entries are zeroed.
2. **before** ``optimizer.step()`` (`sync`): one fused pass over the weights, whatever wrote them
   (``.data``, re-initialisation, a load), so weight decay never carries a pruned weight into the
   state; the gradients the hook did not mask (``p.grad = g``, the dense gradient of an update);
   and, when masks or parameters changed (`version`), or the optimizer's state was loaded or
   grew, since its last step, the same-shape optimizer state.
   Last (`hold_denominators`), for Adam and AdamW on the CPU: the pruned entries of ``exp_avg_sq``
   hold 1.0 during the step. Their update is 0 either way (its numerator, ``exp_avg``, is 0
   there), and ``torch.sqrt`` on the CPU (the for-loop and foreach kernels) is several times
   slower on exact zeros than on other values (benchmarks/README.md, "Figures behind the code").
3. **after** ``optimizer.step()`` (`after_step`): the held denominators are exact zeros again;
   nothing else for optimizers whose update keeps zeros where weight, gradient and state are 0
   (`optimizer_state.state_keeps_zero`); the weights, and the state, of any other.
4. **masks or tensors change** (`changed`; `rebind`: a parameter or mask replaced by
   ``load_state_dict(assign=True)``, ``setattr``, ``to_empty`` or ``.to()``): `version` moves, so
   the next `sync` prunes gradients and state with the masks as they are then. What the hooks
   were installed on is held by weak reference (`_Seen`), so a move frees the tensors from
   before at once, even with no step after it; a gradient hook whose mask was replaced leaves
   the gradient to `sync`. A mask that came to another device is taken as it is; one built on
   the meta device is built again from the weights; one ``to_empty`` replaced on its own device
   holds unknown values, and `rebind` refuses until the algorithm's state is loaded.
5. **a model state dict loads** (`before_model_load`, `after_model_load`): the weights are pruned
   at once; masks the state dict brought (``take_incoming``: an earlier version's ``*_mask``
   entries, `legacy`) become the masks; the values pruning zeroed are kept (``unpruned``) until
   the next step, for a sparsity state loaded next.

Hooks are held by `_Hook` wrappers that pickle and deep-copy as no-ops, so ``torch.save(model)``
and ``copy.deepcopy(model)`` work and the copy carries masks but no live algorithm.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import held
from .masking import (
    PrunedValues,
    fill_pruned_foreach_,
    finite,
    pruned_values,
    zero_pruned_,
    zero_pruned_foreach_,
)
from .optimizer_state import same_shape_state, sqrt_state, state_keeps_zero
from .sharding import local, shard_like
from .sparse_parameter import SparseParameter

__all__ = ["StepHooks", "state_keeps_zero"]

StepHook = Callable[[torch.optim.Optimizer, Any, Any], None]
# (state dict being loaded, prefix, root, sparse parameters) -> {name: mask} it brings, taken out.
TakeIncoming = Callable[
    [dict[str, Any], str, nn.Module, Mapping[str, Any]], dict[str, torch.Tensor]
]


class StepHooks:
    """The per-step path of one algorithm's sparse parameters (module docstring).

    Args:
        sparse_params: the algorithm's ``{name: SparseParameter}`` (shared, not copied).
        dense_grad: whether this step's backward must leave gradients dense (an update that
            reads them is due).
        initial_mask: ``(name, weight) -> mask``, for a mask buffer created on the meta device.
        take_incoming: the masks a model state dict being loaded brings, taken out of it (in
            the model's load pre-hook); none when not given.
    """

    def __init__(
        self,
        sparse_params: Mapping[str, SparseParameter],
        dense_grad: Callable[[], bool],
        initial_mask: Callable[[str, torch.Tensor], torch.Tensor],
        take_incoming: TakeIncoming | None = None,
    ) -> None:
        self.sparse_params = sparse_params
        self.dense_grad = dense_grad
        self.initial_mask = initial_mask
        self.take_incoming = take_incoming
        self.version = 0  # moves whenever masks, parameters or loaded state change
        self._seen: dict[str, _Seen] = {}  # what each hook is on, held weakly
        self._grad_hooks: dict[str, RemovableHandle] = {}
        self._masked: dict[str, tuple[weakref.ref, int]] = {}  # gradients masked: (grad, version)
        self._arrived: dict[str, None] = {}  # gradients of this backward, to mask in one pass
        # optimizer id -> (version, number of parameters with state) when its state was pruned
        self._synced: dict[int, tuple[int, int]] = {}
        self._opted_out: set[int] = set()  # optimizers with same-shape state `requires_dense`
        self._held: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # 1.0 if pruned
        self._optimizers: dict[int, tuple[weakref.ref, list[RemovableHandle]]] = {}
        self._load_hooks: list[RemovableHandle] = []
        self.incoming: dict[str, torch.Tensor] = {}  # masks a loading state dict brought
        # Told the parameter's name when the module lets a mask go (`_mask_dropped`).
        self.on_mask_dropped: list[Callable[[str], None]] = []
        self.unpruned: dict[str, PrunedValues] = {}  # values the last model load zeroed

    # ------------------------------------------------------------------ installation
    def install(self, root: nn.Module, sps: list[SparseParameter]) -> None:
        """Gradient hooks on ``sps`` and model-load hooks on ``root``."""
        for sp in sps:
            self._hook(sp)
        if sps and not self._load_hooks:
            self._load_hooks = [
                root.register_load_state_dict_pre_hook(_Hook(self.before_model_load)),
                root.register_load_state_dict_post_hook(_Hook(self.after_model_load)),
            ]
        self.changed()

    def _hook(self, sp: SparseParameter) -> None:
        old = self._grad_hooks.pop(sp.name, None)
        if old is not None:
            old.remove()
        param = sp.param
        if param.requires_grad:
            hook = _Hook(self._grad_hook(sp.name))
            self._grad_hooks[sp.name] = param.register_post_accumulate_grad_hook(hook)
        self._seen[sp.name] = _Seen.of(param, sp.mask, self._mask_dropped(sp.name))

    def adopt(self, sp: SparseParameter) -> None:
        """``sp``'s parameter and mask, both new (made from the meta device), are the ones the
        hooks are on from now."""
        self._hook(sp)
        self.changed()

    def guards(self, name: str, param: torch.Tensor) -> bool:
        """Whether ``name``'s gradient hook is on this very ``param`` (its gradient is then
        masked in every backward)."""
        return name in self._grad_hooks and self._seen[name].param() is param

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, pre: StepHook, post: StepHook
    ) -> None:
        """``pre``/``post`` as the optimizer's step hooks; its state is pruned now and after it
        loads a state dict."""
        self.rebind()  # Lightning moves the model between `apply(model)` and this call
        key = id(optimizer)
        handles = [
            optimizer.register_step_pre_hook(_Hook(pre)),
            optimizer.register_step_post_hook(_Hook(post)),
            optimizer.register_load_state_dict_post_hook(_Hook(lambda _: self._state_loaded(key))),
            # A state saved mid-step (by a step that raised) shows no held denominators.
            optimizer.register_state_dict_pre_hook(_Hook(lambda _: self._release(key))),
        ]
        # Held weakly: an optimizer the user drops (a swap) is not kept alive with its state.
        self._optimizers[key] = (weakref.ref(optimizer, lambda _: self._forget(key)), handles)
        self.sync(optimizer, force=True)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The attached optimizers still alive, in attach order."""
        return [o for o in (ref() for ref, _ in self._optimizers.values()) if o is not None]

    def detach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remove this path's hooks from ``optimizer``."""
        ref, handles = self._optimizers.get(id(optimizer), (None, []))
        if ref is not None and ref() is optimizer:
            for handle in handles:
                handle.remove()
            self._forget(id(optimizer))

    def _state_loaded(self, key: int) -> None:
        self._release(key)  # the held tensors are no longer its state; prune the loaded state
        self._synced.pop(key, None)

    def _forget(self, key: int) -> None:
        self._release(key)
        self._optimizers.pop(key, None)
        self._synced.pop(key, None)
        self._opted_out.discard(key)

    def remove(self) -> None:
        """Remove every hook (optimizers, parameters, model loads)."""
        for optimizer in self.optimizers:
            self.detach_optimizer(optimizer)
        for key in list(self._held):
            self._release(key)
        for handle in [*self._grad_hooks.values(), *self._load_hooks]:
            handle.remove()
        self._grad_hooks, self._load_hooks, self._seen, self._masked = {}, [], {}, {}
        self._arrived = {}
        self.incoming, self.unpruned = {}, {}

    # ------------------------------------------------------------------ 1. backward
    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def mask_grad(param: torch.Tensor) -> None:
            grad, sp, mask = param.grad, self.sparse_params.get(name), self._seen[name].mask()
            if grad is None or sp is None or mask is None:
                return
            if sp.module._buffers.get(sp.mask_name) is not mask:
                return  # replaced since (``.to()``, ``to_empty``): `sync` masks it, followed
            if self.dense_grad():  # the update reads it: dense, but never NaN/inf where pruned
                zero_pruned_(grad, mask | finite(grad))
                return
            if _distributed():  # DDP / FSDP reduce each gradient as soon as it is produced
                zero_pruned_(grad, mask)
                self._masked[name] = (weakref.ref(grad), grad._version)
                return
            self._arrived[name] = None
            if len(self._arrived) == len(self._grad_hooks):  # the last one: one pass for all
                self._mask_arrived()

        return mask_grad

    def _mask_arrived(self) -> None:
        """Mask the gradients whose hooks fired since the last pass, in one foreach pass."""
        names, self._arrived = self._arrived, {}
        sps = [self.sparse_params[n] for n in names if n in self.sparse_params]
        grads = [(sp, grad) for sp in sps if (grad := sp.param.grad) is not None]
        zero_pruned_foreach_([grad for _, grad in grads], [sp.mask for sp, _ in grads])
        for sp, grad in grads:
            self._masked[sp.name] = (weakref.ref(grad), grad._version)

    # ------------------------------------------------------------------ 2. before the step
    def start_step(self) -> None:
        """A step begins (before any update): follow replaced tensors; values kept from a model
        load are dropped (a sparsity state loads before training goes on, or never)."""
        self.unpruned = {}
        self.rebind()

    def params_of(self, optimizer: torch.optim.Optimizer) -> list[SparseParameter]:
        """The sparse parameters ``optimizer`` steps; a weight whose values are held elsewhere
        (`held`: parked on a device before its optimizer took its values) is not among them."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [
            sp
            for sp in self.sparse_params.values()
            if id(sp.param) in ids and held.holder_of(sp.param) is None
        ]

    def sync(self, optimizer: torch.optim.Optimizer, force: bool = False) -> None:
        """Prune the weights, the gradients the hooks did not mask and, if anything changed
        since ``optimizer``'s last step (or ``force``), its same-shape state. A change: masks or
        parameters (`version`), its state loaded, or state added for another parameter."""
        self._release(id(optimizer))  # a step that began but never finished (an error)
        self._arrived = {}  # a backward that reached only some of them: masked here
        sps = self.params_of(optimizer)
        now = (self.version, len(optimizer.state))
        changed = force or self._synced.get(id(optimizer)) != now
        grads = [
            (sp, grad)
            for sp in sps
            if (grad := sp.param.grad) is not None and (changed or not self._hook_masked(sp, grad))
        ]
        pairs = [(sp, sp.param) for sp in sps] + grads
        zero_pruned_foreach_([t for _, t in pairs], [sp.mask for sp, _ in pairs])
        for sp, grad in grads:
            self._masked[sp.name] = (weakref.ref(grad), grad._version)
        if changed:
            self._prune_state(optimizer, sps)
            self._synced[id(optimizer)] = now

    def prune(self, sps: list[SparseParameter]) -> None:
        """Prune the weights of ``sps`` now (masks changed): one pass, and each weight held
        elsewhere (`held`) has its holder follow its mask."""
        plain = [sp for sp in sps if held.holder_of(sp.param) is None]
        zero_pruned_foreach_([sp.param for sp in plain], [sp.mask for sp in plain])
        for sp in sps:
            if held.holder_of(sp.param) is not None:
                sp.prune_()

    def _hook_masked(self, sp: SparseParameter, grad: torch.Tensor) -> bool:
        seen = self._masked.get(sp.name)
        return seen is not None and seen[0]() is grad and seen[1] == grad._version

    def _prune_state(self, optimizer: torch.optim.Optimizer, sps: list[SparseParameter]) -> None:
        tensors, masks, opted_out = same_shape_state(optimizer, sps)
        zero_pruned_foreach_(tensors, masks)
        if opted_out:  # such state moves pruned weights: `after_step` prunes them again
            self._opted_out.add(id(optimizer))
        else:
            self._opted_out.discard(id(optimizer))

    def hold_denominators(self, optimizer: torch.optim.Optimizer) -> None:
        """Right before ``optimizer.step()``, after `sync`: the pruned entries (exact zeros) of
        the state its update divides by the square root of (`optimizer_state.sqrt_state`) hold
        1.0 until `after_step`. Call it only where the step surely follows (a GradScaler that
        may skip the step runs it after its own check, through the step pre-hook)."""
        if id(optimizer) not in self._held:
            tensors, masks = sqrt_state(optimizer, self.params_of(optimizer))
            fill_pruned_foreach_(tensors, masks, 1.0)
            self._held[id(optimizer)] = (tensors, masks)

    def _release(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            zero_pruned_foreach_(*held)

    # ------------------------------------------------------------------ 3. after the step
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero the held denominators; prune weights and state again where ``optimizer``'s
        update can move a zero."""
        self._release(id(optimizer))
        if state_keeps_zero(optimizer) and id(optimizer) not in self._opted_out:
            return
        sps = self.params_of(optimizer)
        zero_pruned_foreach_([sp.param for sp in sps], [sp.mask for sp in sps])
        self._prune_state(optimizer, sps)

    # ------------------------------------------------------------------ 4. masks, tensors change
    def changed(self) -> None:
        """Masks, parameters or loaded state changed: the next `sync` prunes everything."""
        self.version += 1

    def rebind(self, prune: bool = True) -> bool:
        """Follow parameters and masks replaced since the last step (``setattr``,
        ``load_state_dict(assign=True)``, ``to_empty``, ``.to()``) and prune them (unless
        ``prune`` is False); returns whether any was replaced. A mask that moved with the model
        is taken as it is; one built on the meta device is built again from the weights.

        Raises:
            RuntimeError: a mask was replaced on its own device and the one before is gone
                (``to_empty``: uninitialised memory), so its values are unknown; checked for
                every parameter before any is followed.
        """
        stale = {
            name: sp for name, sp in self.sparse_params.items() if not self._seen[name].still_on(sp)
        }
        for name, sp in stale.items():
            _check_recoverable(name, self._seen[name], sp.module._buffers.get(sp.mask_name))
        for name, sp in stale.items():
            self._restore_mask(sp, self._seen[name], sp.module._buffers.get(sp.mask_name))
            self._hook(sp)
            if prune:
                sp.prune_()
        if stale:
            self.changed()
        return bool(stale)

    def _restore_mask(self, sp: SparseParameter, seen: _Seen, current: torch.Tensor | None) -> None:
        known = seen.mask()
        if current is known:
            return  # only the parameter was replaced
        param = sp.param
        if seen.mask_device.type == "meta" and (current is None or not current.is_meta):
            sp.register_mask(self.initial_mask(sp.name, param.detach()).to(param.device))
        elif known is not None and (current is None or current.is_meta):
            sp.register_mask(known.to(param.device))
        elif known is not None and current is not None and current.device == known.device:
            if not torch.equal(known, current):  # ``to_empty`` while the old mask lives on
                sp.register_mask(known)
        # Otherwise the mask moved with the model (``.to()``): nothing to copy.

    def adopt_masks(self) -> None:
        """The mask buffers as they are now are the masks (their values were just written: a
        model or algorithm state loaded), wherever they came from."""
        for name, sp in self.sparse_params.items():
            mask = sp.mask
            self._seen[name] = replace(
                self._seen[name],
                mask=weakref.ref(mask, self._mask_dropped(name)),
                mask_device=mask.device,
            )

    def _mask_dropped(self, name: str) -> Callable[[Any], None]:
        """Callback of the weak reference to ``name``'s mask: the module let it go (a move, a
        ``to_empty``, a removal), so what this path kept for it goes too, and the listeners
        (`on_mask_dropped`) hear of it. A weak reference's callback must not raise."""

        def dropped(_: Any) -> None:
            self.unpruned.pop(name, None)
            for listener in list(self.on_mask_dropped):
                listener(name)

        return dropped

    # ------------------------------------------------------------------ 5. a model state loads
    def before_model_load(
        self, root: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        """The model's load pre-hook: masks ``state_dict`` brings for these parameters are taken
        out of it to become the masks after the load (``take_incoming``: an earlier version's
        ``*_mask`` entries, checked by `legacy.take_mask_entries`, which raises before anything
        loads)."""
        if self.take_incoming is not None:
            self.incoming = self.take_incoming(state_dict, prefix, root, self.sparse_params)

    def after_model_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        """The model's load post-hook: follow assigned parameters, adopt incoming masks, keep the
        values pruning will zero where none came (`PrunedValues`), prune."""
        self.adopt_masks()  # the masks as they are now are the known
        self.rebind(prune=False)
        incoming, self.incoming = self.incoming, {}
        with torch.no_grad():
            for name, sp in self.sparse_params.items():
                self.unpruned.pop(name, None)
                mask = incoming.get(name)
                if mask is not None:
                    sp.mask.copy_(shard_like(mask.to(sp.mask.device), sp.mask))
                elif held.holder_of(sp.param) is not None:
                    pass  # its values are held elsewhere (they loaded there, pruned)
                elif (kept := pruned_values(local(sp.param.detach()), local(sp.mask))) is not None:
                    self.unpruned[name] = kept
                sp.prune_()
                if name in self.unpruned:
                    self.unpruned[name].seal(sp.param, local(sp.param)._version)
        self.changed()


def _distributed() -> bool:
    """Whether this process trains under ``torch.distributed``: DDP copies each gradient into
    its bucket, and FSDP reduce-scatters a module's, as backward produces them, so each must be
    masked in its own hook, before the copy (one launch per weight), not in one pass after the
    last."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@dataclass
class _Seen:
    """What a parameter's hooks were installed on, held weakly so that a move (``.to()``) frees
    the tensors from before at once: the parameter, its mask and the device the mask was on."""

    param: Callable[[], torch.Tensor | None]
    mask: Callable[[], torch.Tensor | None]
    mask_device: torch.device

    @classmethod
    def of(cls, param: torch.Tensor, mask: torch.Tensor, dropped: Callable[[Any], None]) -> _Seen:
        return cls(weakref.ref(param), weakref.ref(mask, dropped), mask.device)

    def still_on(self, sp: SparseParameter) -> bool:
        """Whether ``sp``'s module still holds the very parameter and mask seen."""
        mask = sp.module._buffers.get(sp.mask_name)
        param = sp.module._parameters.get(sp.param_name)
        return mask is not None and mask is self.mask() and param is self.param()


def _check_recoverable(name: str, seen: _Seen, current: torch.Tensor | None) -> None:
    """Raise unless `StepHooks.rebind` can tell the values of ``name``'s mask (module docstring,
    moment 4): the one seen lives on, or was built on the meta device, or the module holds one
    that moved with the model (another device, or the meta device)."""
    if current is not None and seen.mask() is current:
        return
    if seen.mask() is not None or seen.mask_device.type == "meta":
        return
    if current is not None and (current.is_meta or current.device != seen.mask_device):
        return
    what = "was removed" if current is None else f"was replaced on {seen.mask_device}"
    raise RuntimeError(
        f"the mask buffer of {name!r} {what} and the mask before it is gone, so its values are "
        "unknown (Module.to_empty() gives every buffer uninitialised memory); restore the "
        "masks with the algorithm's state saved before (sparsity.load_state_dict(state)), "
        "or apply a new algorithm to the model"
    )


class _Hook:
    """A hook callable that pickles and deep-copies as `_inert`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return (_make_inert, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert


def _inert(*args: Any, **kwargs: Any) -> None:
    """What a copied or unpickled hook does: nothing (the copy has no live algorithm)."""


def _make_inert() -> Callable[..., None]:
    return _inert
