"""`SparsityAlgorithm`: the base of every algorithm, usable as a Lightning callback or by hand.

Plain PyTorch, as in Cerebras' ``cstorch.sparse``::

    sparsity = Static(sparsity=0.8)
    model.apply(sparsity)          # same as sparsity.apply(model)
    sparsity.apply(optimizer)      # official torch.optim step hooks; any optimizer

Lightning: ``Trainer(callbacks=[Static(sparsity=0.8)])``. The callback hooks call the same methods.

Per-step path (see docs/design.md): a post-accumulate-grad hook zeroes each sparse gradient at
pruned positions in place; ``update()`` runs after gradient accumulation and before the optimizer
step; the step pre-hook prunes gradients and same-shape optimizer state when a mask changed; the
step post-hook advances ``step`` and re-prunes the weights in place. A step that AMP skips never
calls the optimizer, so it neither advances ``step`` nor changes a mask.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_sparse.algorithms._checkpoint import check_incoming_masks
from lightning_sparse.distributions import make_distribution
from lightning_sparse.filters import (
    ParamFilter,
    default_sparse_param_filter,
    is_dense_by_module,
    make_param_filter,
)
from lightning_sparse.init_methods import make_init_method
from lightning_sparse.masking import zero_pruned_, zero_pruned_foreach_
from lightning_sparse.rng import generator_for
from lightning_sparse.selection import Candidate, candidates, tied_parameter_ids
from lightning_sparse.shapers import Shaper, Unstructured
from lightning_sparse.sharding import full, shard_like
from lightning_sparse.sparse_parameter import SparseParameter, mask_buffer_name

__all__ = ["SparsityAlgorithm", "Candidate", "validate_sparsity"]

SparsityHook = Callable[["SparsityAlgorithm", str, Any], None]


def validate_sparsity(value: object, where: str = "") -> float:
    """Check one sparsity level: a real number in [0, 1).

    Raises:
        TypeError / ValueError: naming the value, the rule and the fix.
    """
    suffix = f" for {where!r}" if where else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"sparsity={value!r}{suffix} must be a float in [0, 1), e.g. 0.8")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(
            f"sparsity={value!r}{suffix} must be in [0, 1): it is the fraction of zeros, so 0.8 "
            "keeps 20% of the weights"
        )
    return float(value)


# Optimizers whose update leaves a weight that is exactly 0 at exactly 0 when its gradient and
# every same-shape state entry are 0 there (what the gradient hooks and state pruning ensure):
# SGD (momentum, nesterov, dampening, weight decay: all terms are multiples of 0) and Adam /
# AdamW with eps > 0 (exp_avg / (sqrt(exp_avg_sq) + eps) = 0 / eps; decoupled decay scales 0;
# amsgrad's max of zeros is 0), in their for-loop, foreach and fused forms. Exact types only: a
# subclass may change the update. Other optimizers get the weights re-pruned after every step.
_ZERO_KEEPING_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def keeps_pruned_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` provably keeps pruned (zero, zero-gradient, zero-state)
    weights at exactly 0, so the per-step re-prune of the weights can be skipped."""
    if type(optimizer) not in _ZERO_KEEPING_OPTIMIZERS:
        return False
    return all(
        isinstance(group.get("eps", 1.0), float | int) and group.get("eps", 1.0) > 0
        for group in optimizer.param_groups
    )


class SparsityAlgorithm(pl.Callback, ABC):
    """Base class: owns the masks of the parameters it sparsifies, its step counter and hooks.

    Subclasses define ``update()`` (how masks change) and may override ``initial_mask``.

    Args:
        init_method: mask initialiser name (``random``, ``topk``, ``from_zeros``,
            ``checkerboard``) or a callable ``(p, sparsity, *, generator, shaper) -> mask``.
        param_filter: which parameters to sparsify when applied directly: a glob, a list of globs,
            or ``(name, param) -> bool``. Default: weights with ``ndim >= 2`` that are not
            embeddings, normalisation or the output head. Inside a ``Group`` the group's filter
            decides instead.
        seed: seeds every random choice through ``(seed, step, parameter name)``.
        distribution: how a global sparsity target is spread over layers: ``uniform`` (every
            layer at the target), ``er`` or ``erk`` (Evci et al. 2020, arXiv:1911.11134:
            density proportional to the layer's dimension sum over its size, layers that would
            exceed density 1 kept dense); the parameter-weighted sparsity equals the target.
        erk_power_scale: exponent on the ER/ERK raw scores (1.0 in the paper).
        track_itop: keep a bool "ever active" tensor per parameter for the ITOP rate (Liu et al.
            2021, "Do we actually need dense over-parameterization?", arXiv:2102.02887).
        shaper: sparsity structure, orthogonal to the algorithm: ``Unstructured()`` (default),
            ``OutputGroups(n)`` / ``InputGroups(n)`` (balanced blocks), ``NM(n, m)`` (e.g. 2:4),
            ``Blocks(h, w)``.
    """

    _instance_counts: dict[str, int] = {}

    def __init__(
        self,
        init_method: str | Callable[..., torch.Tensor] = "random",
        param_filter: str | list[str] | ParamFilter | None = None,
        seed: int = 0,
        distribution: str = "uniform",
        erk_power_scale: float = 1.0,
        track_itop: bool = True,
        shaper: Shaper | None = None,
    ) -> None:
        self.init_method = make_init_method(init_method)
        self.shaper = shaper if shaper is not None else Unstructured()
        self.distribution = make_distribution(distribution)
        self.distribution_name = distribution
        self.erk_power_scale = float(erk_power_scale)
        self.track_itop = track_itop
        self.param_filter = make_param_filter(param_filter)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r} must be an int")
        self.seed = seed
        cls = type(self).__name__.lower()
        count = SparsityAlgorithm._instance_counts.get(cls, 0)
        SparsityAlgorithm._instance_counts[cls] = count + 1
        self.name = f"sparsity_{cls}_{count}"
        self.sparse_params: OrderedDict[str, SparseParameter] = OrderedDict()
        self.step = 0
        self.autoupdate = True
        self.check_finite = False
        self.lightning_driven = False
        self._root: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._param_handles: list[RemovableHandle] = []
        self._optimizer_handles: dict[int, list[RemovableHandle]] = {}
        self._mask_version = 0
        self._mask_targets: dict[str, float] = {}
        self._optimizer_version: dict[int, int] = {}
        self._optimizer_state_len: dict[int, int] = {}
        # Per optimizer: whether its step provably keeps pruned weights at 0 (no re-prune).
        self._keeps_zeros: dict[int, bool] = {}
        self._dense_grad_needed = False
        self._shapes: dict[str, torch.Size] = {}
        self._layer_cache: dict[float, dict[str, float]] = {}
        self.ever_active: dict[str, torch.Tensor] = {}
        self.last_update: dict[str, dict[str, torch.Tensor]] = {}
        self._unlogged_update = False
        self._update_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._target_hooks: OrderedDict[int, SparsityHook] = OrderedDict()
        self._computed_hooks: OrderedDict[int, SparsityHook] = OrderedDict()

    # ------------------------------------------------------------------ policy (subclasses)
    @abstractmethod
    def target_sparsity(self, name: str, step: int) -> float:
        """Target sparsity of parameter ``name`` at ``step`` (a Python float; no host sync)."""

    @abstractmethod
    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Update the masks for the current step (a no-op on steps that are not update steps)."""

    def layer_sparsity(self, name: str, sparsity: float) -> float:
        """Sparsity of parameter ``name`` when the global target is ``sparsity``."""
        if self.distribution_name == "uniform" or name not in self._shapes:
            return sparsity
        if sparsity not in self._layer_cache:
            kwargs = (
                {} if self.distribution_name == "uniform" else {"power_scale": self.erk_power_scale}
            )
            self._layer_cache = {sparsity: self.distribution(self._shapes, sparsity, **kwargs)}
        return self._layer_cache[sparsity][name]

    @property
    def dense_grad_needed(self) -> bool:
        """True during the backward of a step whose mask update reads the dense gradient
        (RigL, GraNet): executors that skip pruned positions must compute it in full then."""
        return self._dense_grad_needed

    def mask_target(self, name: str) -> float:
        """Sparsity the current mask of ``name`` was computed for."""
        return self._mask_targets[name]

    def initial_target(self, name: str) -> float:
        """Sparsity of the mask ``initial_mask`` builds for ``name``."""
        return self.target_sparsity(name, 0)

    def initial_mask(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """Mask at ``apply`` time: ``init_method`` at the step-0 target sparsity."""
        generator = generator_for(self.seed, 0, name, param.device)
        dense = full(param.detach())
        target = self.target_sparsity(name, 0)
        mask = self.init_method(dense, target, generator=generator, shaper=self.shaper)
        return shard_like(mask, param)

    def validate_param(self, name: str, param: torch.Tensor) -> None:
        """Raise before anything is modified if ``param`` cannot be sparsified by this algorithm."""
        self.shaper.check(param.shape, name)
        validate_sparsity(self.target_sparsity(name, 0), name)

    # ------------------------------------------------------------------ apply
    def __call__(self, module: nn.Module) -> None:
        """Support ``model.apply(sparsity)``: torch calls this on every submodule, root last.

        Only the outermost call (the root of ``Module.apply``) acts, so filters see full names.
        """
        caller = sys._getframe(1)
        if caller.f_code is nn.Module.apply.__code__:
            outer = caller.f_back
            if outer is not None and outer.f_code is nn.Module.apply.__code__:
                return  # a child visit inside model.apply(...): wait for the root
        self.apply(module)

    def apply(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        """Sparsify a model (create masks, prune) or an optimizer (install step hooks)."""
        if isinstance(obj, nn.Module):
            self._apply_model(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self._apply_optimizer(obj)
        else:
            raise TypeError(
                f"{type(self).__name__}.apply expects an nn.Module or a torch.optim.Optimizer, got "
                f"{type(obj).__name__}"
            )

    def select(self, root: nn.Module) -> list[Candidate]:
        """Parameters of ``root`` this algorithm would sparsify, in registration order."""
        tied = tied_parameter_ids(root)
        return [c for c in candidates(root) if self.selects(c, tied)]

    def selects(self, candidate: Candidate, tied: set[int]) -> bool:
        """Whether this algorithm's filter picks ``candidate`` (``tied``: ids of tied params)."""
        name, module, _, param = candidate
        if self.param_filter is not None:
            return bool(self.param_filter(name, param))
        if not default_sparse_param_filter(name, param):
            return False
        module_name = name.rsplit(".", 1)[0] if "." in name else ""
        return not is_dense_by_module(module, module_name, tied, param)

    def _apply_model(self, root: nn.Module) -> None:
        if self._root is not None:
            raise RuntimeError(
                f"{self.name} is already applied to a model; create a new algorithm object per "
                "model (applying twice would stack masks)"
            )
        chosen = self.select(root)
        if not chosen:
            import warnings

            warnings.warn(
                f"{self.name}: no parameter of {type(root).__name__} matched the parameter filter, "
                "so nothing was sparsified; check param_filter against model.named_parameters()",
                stacklevel=3,
            )
        self.attach(root, chosen)

    def prepare(self, chosen: list[Candidate]) -> None:
        """Record the shapes of the parameters about to be sparsified (layer distributions)."""
        self._shapes = {name: param.shape for name, _, _, param in chosen}
        self._layer_cache = {}

    def check_attachable(self, chosen: list[Candidate]) -> None:
        """Raise, before anything is modified, if ``chosen`` cannot be sparsified by this object."""
        if self._root is not None:
            raise RuntimeError(
                f"{self.name} is already applied to a model; create a new algorithm object per "
                "model (applying twice would stack masks)"
            )
        self.prepare(chosen)
        for name, module, attr, param in chosen:
            if mask_buffer_name(attr) in module._buffers:
                raise RuntimeError(
                    f"{name!r} already has a mask ({mask_buffer_name(attr)}): it is sparsified by "
                    "another algorithm; use one Group to give parameters different algorithms"
                )
            if getattr(param, "requires_dense", False):
                raise RuntimeError(f"{name!r} has requires_dense=True and cannot be sparsified")
            self.validate_param(name, param)

    def initial_masks(self, chosen: list[Candidate]) -> list[torch.Tensor]:
        """Masks at ``apply`` time, one per chosen parameter."""
        return [self.initial_mask(name, param) for name, _, _, param in chosen]

    def attach(self, root: nn.Module, chosen: list[Candidate]) -> None:
        """Create masks for ``chosen`` parameters of ``root``: validate all, then modify."""
        self.check_attachable(chosen)
        masks = self.initial_masks(chosen)
        self._root = root
        for (name, module, attr, param), mask in zip(chosen, masks, strict=True):
            sp = SparseParameter(module, name, attr)
            sp.register_mask(mask)
            sp.prune_()
            self.sparse_params[name] = sp
            self._param_handles.append(
                param.register_post_accumulate_grad_hook(self._grad_hook(sp))
            )
            if self.track_itop:
                self.ever_active[name] = sp.mask.clone()
        if chosen:
            self._param_handles.append(root.register_load_state_dict_pre_hook(self._load_pre_hook))
            self._param_handles.append(
                root.register_load_state_dict_post_hook(self._load_post_hook)
            )
            registry = root.__dict__.setdefault("_lightning_sparse_algorithms", [])
            registry.append(self)
        self._mask_targets = {name: self.initial_target(name) for name, _, _, _ in chosen}
        self._mask_version += 1
        self._emit_sparsity_hooks()

    def _grad_hook(self, sp: SparseParameter) -> Callable[[torch.Tensor], None]:
        def mask_grad(param: torch.Tensor) -> None:
            # NaN/inf at pruned positions are zeroed too, so they never make AMP skip a step.
            grad = param.grad
            if grad is None:
                return
            if not self._dense_grad_needed:
                zero_pruned_(grad, sp.mask)
            else:  # keep the dense gradient for the update, minus non-finite pruned entries
                zero_pruned_(grad, sp.mask | grad.isfinite())

        return mask_grad

    def _apply_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._root is None:
            raise RuntimeError(
                f"apply the sparsity to the model first (model.apply({self.name})), then to the "
                "optimizer"
            )
        if any(o is optimizer for o in self._optimizers):
            raise RuntimeError(f"{self.name} is already applied to this optimizer")
        own = {id(p) for p in self._root.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} parameter(s) (first shape "
                f"{tuple(foreign[0].shape)}) that the sparsified model does not own; build the "
                "optimizer from that model's parameters()"
            )
        self._optimizers.append(optimizer)
        self._optimizer_handles[id(optimizer)] = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]
        self.sync_optimizer(optimizer, force=True)

    def detach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remove this algorithm's hooks from ``optimizer`` (e.g. one a new fit replaced)."""
        for handle in self._optimizer_handles.pop(id(optimizer), []):
            handle.remove()
        self._optimizers = [o for o in self._optimizers if o is not optimizer]
        for table in (self._optimizer_version, self._optimizer_state_len, self._keeps_zeros):
            table.pop(id(optimizer), None)

    # ------------------------------------------------------------------ per-step path
    def _params_of(self, optimizer: torch.optim.Optimizer) -> list[SparseParameter]:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return [sp for sp in self.sparse_params.values() if id(sp.param) in ids]

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.lightning_driven:
            # Lightning passes its closure (forward + backward) to optimizer.step, so this hook
            # runs before the last backward; on_before_optimizer_step does this work instead.
            return
        if self.autoupdate:
            self.update(optimizer)
        self.sync_optimizer(optimizer)

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is self._optimizers[0]:
            self.step += 1
        sps = self._params_of(optimizer)
        if sps and not self._keeps_zeros.get(id(optimizer), False):
            zero_pruned_foreach_([sp.param for sp in sps], [sp.mask for sp in sps])
        if len(optimizer.state) != self._optimizer_state_len.get(id(optimizer)):
            self._prune_optimizer_state(optimizer, sps)  # states created lazily by this step

    def sync_optimizer(self, optimizer: torch.optim.Optimizer, force: bool = False) -> None:
        """Prune gradients and optimizer state if masks changed (or state was loaded) since last."""
        key = id(optimizer)
        stale_state = len(optimizer.state) != self._optimizer_state_len.get(key)
        fresh = self._optimizer_version.get(key) == self._mask_version
        # After a dense-gradient backward the gradients must be masked here, update or not.
        if not force and not stale_state and fresh and not self._dense_grad_needed:
            return
        sps = self._params_of(optimizer)
        with torch.no_grad():
            for sp in sps:
                sp.prune_()
                if sp.param.grad is not None:
                    zero_pruned_(sp.param.grad, sp.mask)
        self._prune_optimizer_state(optimizer, sps)
        self._optimizer_version[key] = self._mask_version

    def _prune_optimizer_state(
        self, optimizer: torch.optim.Optimizer, sps: list[SparseParameter]
    ) -> None:
        dense_state = False
        with torch.no_grad():
            for sp in sps:
                for value in optimizer.state.get(sp.param, {}).values():
                    if torch.is_tensor(value) and value.shape == sp.param.shape:
                        if getattr(value, "requires_dense", False):
                            dense_state = True
                        else:
                            zero_pruned_(value, sp.mask)
        self._optimizer_state_len[id(optimizer)] = len(optimizer.state)
        self._keeps_zeros[id(optimizer)] = not dense_state and keeps_pruned_zero(optimizer)

    def set_masks_(self, masks: dict[str, torch.Tensor], targets: dict[str, float]) -> None:
        """Install new masks (name -> bool mask) computed for ``targets`` (name -> sparsity),
        prune weights, and mark optimizers for pruning."""
        stats: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for name, mask in masks.items():
                sp = self.sparse_params[name]
                old = sp.mask
                stats[name] = {
                    "dropped": full((old & ~mask).count_nonzero()),
                    "grown": full((mask & ~old).count_nonzero()),
                }
                old.copy_(mask)
                sp.prune_()
                if name in self.ever_active:
                    self.ever_active[name] |= mask
                    ever = full(self.ever_active[name].count_nonzero())
                    stats[name]["itop"] = ever / mask.numel()
                stats[name]["sparsity"] = 1.0 - sp.nnz / mask.numel()
        self.last_update = stats
        self._unlogged_update = True
        self._mask_version += 1
        self._mask_targets.update(targets)
        self._emit_sparsity_hooks()
        for hook in self._update_hooks.values():
            hook(self, self.step, stats)

    def itop_rate(self) -> torch.Tensor:
        """Share of the sparse weights that were ever active (0-d tensor; no host sync)."""
        if not self.ever_active:
            return torch.zeros(())
        ever = torch.stack([full(m.count_nonzero()) for m in self.ever_active.values()]).sum()
        return ever / sum(m.numel() for m in self.ever_active.values())

    def register_update_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """``hook(algorithm, step, stats)`` after each mask update; ``stats[name]`` holds 0-d
        tensors ``dropped``, ``grown``, ``sparsity`` and ``itop`` (if tracked)."""
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    def grads_finite(self) -> bool:
        """Whether every sparse gradient is finite. One host sync; call only on update steps."""
        grads = [sp.param.grad for sp in self.sparse_params.values() if sp.param.grad is not None]
        if not grads:
            return True
        return bool(torch.stack([full(g.isfinite().all()) for g in grads]).all())

    # ------------------------------------------------------------------ hooks and reporting
    def register_target_sparsity_hook(self, hook: SparsityHook) -> RemovableHandle:
        """``hook(algorithm, name, target: float)`` runs whenever masks are (re)computed."""
        handle = RemovableHandle(self._target_hooks)
        self._target_hooks[handle.id] = hook
        return handle

    def register_computed_sparsity_hook(self, hook: SparsityHook) -> RemovableHandle:
        """``hook(algorithm, name, actual: 0-d tensor)`` runs whenever masks are (re)computed."""
        handle = RemovableHandle(self._computed_hooks)
        self._computed_hooks[handle.id] = hook
        return handle

    def _emit_sparsity_hooks(self) -> None:
        if not (self._target_hooks or self._computed_hooks):
            return
        for name, sp in self.sparse_params.items():
            for hook in self._target_hooks.values():
                hook(self, name, self.mask_target(name))
            if self._computed_hooks:
                actual = 1.0 - sp.nnz / sp.mask.numel()
                for hook in self._computed_hooks.values():
                    hook(self, name, actual)

    def sparsity_levels(self) -> dict[str, torch.Tensor]:
        """Actual sparsity per parameter as 0-d tensors (no host sync)."""
        return {n: 1.0 - sp.nnz / sp.mask.numel() for n, sp in self.sparse_params.items()}

    def overall_sparsity(self) -> tuple[float, torch.Tensor]:
        """(target, actual) over all parameters of this algorithm, weighted by size."""
        if not self.sparse_params:
            return 0.0, torch.zeros(())
        sizes = {n: sp.mask.numel() for n, sp in self.sparse_params.items()}
        total = sum(sizes.values())
        target = sum(self.mask_target(n) * s for n, s in sizes.items()) / total
        kept = torch.stack([sp.nnz for sp in self.sparse_params.values()]).sum()
        return target, 1.0 - kept / total

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Algorithm state (masks live in the model's state_dict as ``<param>_mask``)."""
        state: dict[str, Any] = {"step": self.step, "mask_targets": dict(self._mask_targets)}
        if self.ever_active:
            state["ever_active"] = {n: m.clone() for n, m in self.ever_active.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        if "step" not in state_dict:
            raise KeyError(
                f"{self.name}: sparsity state {sorted(state_dict)} has no 'step'; pass what "
                "state_dict() returned"
            )
        self.step = int(state_dict["step"])
        self._mask_targets.update(state_dict.get("mask_targets", {}))
        for name, ever in state_dict.get("ever_active", {}).items():
            if name in self.ever_active:
                self.ever_active[name].copy_(ever)
        self._mask_version += 1

    def _load_pre_hook(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        """Validate masks in an incoming state dict; give a dense checkpoint the current masks."""
        check_incoming_masks(self, module, state_dict, prefix)

    def _load_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        for sp in self.sparse_params.values():
            sp.prune_()
        self._mask_version += 1

    # ------------------------------------------------------------------ removal (densify)
    def remove(self) -> None:
        """Remove masks and every hook: the model and optimizers train dense from here on."""
        for optimizer in list(self._optimizers):
            self.detach_optimizer(optimizer)
        for handle in self._param_handles:
            handle.remove()
        for sp in self.sparse_params.values():
            sp.remove_mask()
        if self._root is not None:
            registry = self._root.__dict__.get("_lightning_sparse_algorithms", [])
            if self in registry:
                registry.remove(self)
        self._param_handles = []
        self.sparse_params.clear()

    # ------------------------------------------------------------------ Lightning glue
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Sparsify the LightningModule (once).

        Under ``ModelParallelStrategy`` (FSDP2), ``configure_model`` shards the parameters after
        this hook, so sparsity is applied at fit start instead, to the sharded parameters.
        """
        if not _shards_in_configure_model(trainer):
            self._apply_once(pl_module)

    def _apply_once(self, pl_module: pl.LightningModule) -> None:
        if self._root is None:
            self.apply(pl_module)
        elif self._root is not pl_module:
            raise RuntimeError(f"{self.name} was applied to another model; use one per Trainer")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Make the optimizers from ``configure_optimizers`` sparse; the callback drives updates."""
        self._apply_once(pl_module)
        self.lightning_driven = True
        self.check_finite = getattr(trainer.precision_plugin, "scaler", None) is not None
        for stale in [o for o in self._optimizers if all(o is not t for t in trainer.optimizers)]:
            self.detach_optimizer(stale)  # a previous fit's optimizer
        for optimizer in trainer.optimizers:
            if not any(o is optimizer for o in self._optimizers):
                self.apply(optimizer)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Gradients are fully accumulated (and all-reduced) here: update the masks, then prune
        gradients and optimizer state with them before the step."""
        self.update(optimizer)
        self.sync_optimizer(optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Log target and actual sparsity, and each mask update's figures once, at the first
        logging step after it (so keep ``log_every_n_steps`` <= the update interval)."""
        if not self.sparse_params or trainer.global_step % max(trainer.log_every_n_steps, 1):
            return
        target, actual = self.overall_sparsity()
        several = sum(isinstance(c, SparsityAlgorithm) for c in trainer.callbacks) > 1
        prefix = f"sparsity/{self.name}" if several else "sparsity"
        metrics = {f"{prefix}/target": target, f"{prefix}/actual": actual.float()}
        if self._unlogged_update:
            metrics.update({f"{prefix}/{k}": v for k, v in self.update_metrics().items()})
            metrics[f"{prefix}/itop"] = self.itop_rate()
            self._unlogged_update = False
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def update_metrics(self) -> dict[str, torch.Tensor]:
        """Totals and per-parameter figures of the last mask update (empty if none yet)."""
        stats = self.last_update
        if not stats:
            return {}
        out = {
            "dropped": torch.stack([s["dropped"] for s in stats.values()]).sum().float(),
            "grown": torch.stack([s["grown"] for s in stats.values()]).sum().float(),
        }
        for name, s in stats.items():
            out[f"layer/{name}"] = s["sparsity"].float()
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, params={len(self.sparse_params)})"


def _shards_in_configure_model(trainer: pl.Trainer) -> bool:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(trainer.strategy, ModelParallelStrategy)


def algorithms_of(model: nn.Module) -> list[SparsityAlgorithm]:
    """The algorithms applied to ``model`` (Group members individually), in order of application."""
    return list(model.__dict__.get("_lightning_sparse_algorithms", []))
