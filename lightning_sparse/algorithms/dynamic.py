"""`DynamicSparsityAlgorithm`: masks that change on a cadence; subclasses write ``update_mask``.

Cerebras semantics: ``update`` is the cadence (``{"freq", "start", "stop"}`` with ``stop``
exclusive, ``{"steps": [...]}``, a callable ``step -> bool`` or ``None`` = every step); training
starts sparse when step 0 is an update step, otherwise dense (all-ones masks) until the first
update. ``step`` counts completed optimizer steps, and the update for step ``t`` runs after the
gradients of the next batch are accumulated, before that batch's optimizer step, so RigL's
gradient is the gradient at the current weights (Evci et al. 2020, Algorithm 1).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from lightning_sparse.algorithms.base import SparsityAlgorithm, validate_sparsity
from lightning_sparse.filters import ParamFilter
from lightning_sparse.rng import generator_for
from lightning_sparse.schedules import (
    HyperParameterSchedule,
    UpdateSchedule,
    make_hyperparam_schedule,
    make_update_schedule,
)
from lightning_sparse.shapers import Shaper
from lightning_sparse.sharding import full, is_sharded, shard_like

__all__ = ["DynamicSparsityAlgorithm"]

ScheduleSpec = float | list | dict | Callable[[int], float] | HyperParameterSchedule
UpdateSpec = int | list | dict | Callable[[int], bool] | UpdateSchedule | None


class DynamicSparsityAlgorithm(SparsityAlgorithm):
    """Base of dynamic algorithms: override ``update_mask(p, mask, sparsity) -> mask``.

    Args:
        sparsity: target sparsity: a float in [0, 1) or a schedule (``{"type": "cubic", ...}``,
            a list = Cycling, a callable ``step -> float``). Values are clamped to [0, 1].
        update: when masks change (see module docstring). ``None``: every step.
        init_method, param_filter, seed, distribution, erk_power_scale, track_itop: see
            ``SparsityAlgorithm``.
        shaper: sparsity structure (``Unstructured()`` default; ``OutputGroups``, ``NM``, ...).
    """

    needs_dense_grad = False  # RigL sets True: keep gradients dense on update steps

    def __init__(
        self,
        sparsity: ScheduleSpec,
        update: UpdateSpec = None,
        init_method: str | Callable[..., torch.Tensor] = "random",
        param_filter: str | list[str] | ParamFilter | None = None,
        seed: int = 0,
        shaper: Shaper | None = None,
        distribution: str = "uniform",
        erk_power_scale: float = 1.0,
        track_itop: bool = True,
    ) -> None:
        if isinstance(sparsity, int | float) and not isinstance(sparsity, bool):
            validate_sparsity(sparsity)
        self.sparsity = make_hyperparam_schedule(sparsity)
        self.update_schedule = make_update_schedule(update)
        super().__init__(
            init_method=init_method,
            param_filter=param_filter,
            seed=seed,
            distribution=distribution,
            erk_power_scale=erk_power_scale,
            track_itop=track_itop,
            shaper=shaper,
        )
        self.starts_sparse = bool(self.update_schedule(0))
        self._names: dict[int, str] = {}
        self._last_update_step = -1

    # ------------------------------------------------------------------ schedule
    def target_sparsity(self, name: str, step: int) -> float:
        """The sparsity schedule at ``step``, clamped to [0, 1], spread by ``distribution``."""
        return self.layer_sparsity(name, min(max(float(self.sparsity(step)), 0.0), 1.0))

    def initial_target(self, name: str) -> float:
        """0 when training starts dense (before the first update), else the step-0 target."""
        return self.target_sparsity(name, 0) if self.starts_sparse else 0.0

    def is_update_step(self, step: int | None = None) -> bool:
        """Whether masks change after ``step`` completed steps (default: the current step)."""
        step = self.step if step is None else step
        return step > 0 and bool(self.update_schedule(step))

    def validate_param(self, name: str, param: torch.Tensor) -> None:
        """Check the shaper fits the parameter, before anything is modified."""
        self.shaper.check(param.shape, name)
        target = self.target_sparsity(name, 0)
        if target >= 1.0:
            raise ValueError(
                f"sparsity schedule gives {target} at step 0 for {name!r}; must be < 1"
            )

    def initial_mask(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """Sparse at step 0 if step 0 is an update step, else dense until the first update."""
        if not self.starts_sparse:
            return torch.ones_like(param, dtype=torch.bool)
        generator = generator_for(self.seed, 0, name, param.device)
        mask = self.init_method(
            full(param.detach()),
            self.target_sparsity(name, 0),
            generator=generator,
            shaper=self.shaper,
        )
        return shard_like(mask, param)

    def attach(self, root: torch.nn.Module, chosen: list) -> None:
        """Create masks; advance stateful schedules once when training starts sparse."""
        super().attach(root, chosen)
        self._names = {id(sp.param): name for name, sp in self.sparse_params.items()}
        if chosen and self.starts_sparse:
            self.sparsity.update(True)
        self._refresh_step_flags()

    # ------------------------------------------------------------------ update
    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Recompute every mask on update steps (at most once per step); a no-op otherwise."""
        if (
            not self.sparse_params
            or not self.is_update_step()
            or self._last_update_step == self.step
        ):
            return
        if self.check_finite and not self.grads_finite():
            return  # AMP will skip this step; the step counter does not advance, retry next time
        with torch.no_grad():
            targets = {name: self.target_sparsity(name, self.step) for name in self.sparse_params}
            new_masks = self.compute_masks()
        self.sparsity.update(True)
        self._last_update_step = self.step
        self.set_masks_(new_masks, targets)

    def compute_masks(self) -> dict[str, torch.Tensor]:
        """New masks of every parameter at this step: ``update_mask`` one parameter at a time.

        A sharded parameter is gathered first (with its gradient), so top-k runs over the whole
        tensor; the new mask is sharded back like the parameter.
        """
        masks = {}
        for name, sp in self.sparse_params.items():
            param = sp.param
            p = param
            if is_sharded(param):
                p = full(param.detach())
                if param.grad is not None:
                    p.grad = full(param.grad)
                self._names[id(p)] = name
            new = self.update_mask(p, full(sp.mask), self.target_sparsity(name, self.step))
            masks[name] = shard_like(new, param)
            if p is not param:
                del self._names[id(p)]
        return masks

    @abstractmethod
    def update_mask(self, p: torch.Tensor, mask: torch.Tensor, sparsity: float) -> torch.Tensor:
        """New bool mask for parameter ``p`` (any shape) with current ``mask`` at ``sparsity``."""

    def name_of(self, p: torch.Tensor) -> str:
        """Full name of sparse parameter ``p`` (for per-parameter randomness)."""
        return self._names[id(p)]

    def generator(self, p: torch.Tensor) -> torch.Generator:
        """Random stream for ``p`` at this step: same on every rank and after a resume."""
        return generator_for(self.seed, self.step, self.name_of(p), p.device)

    # ------------------------------------------------------------------ step flags, state
    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        super()._post_step(optimizer, args, kwargs)
        self._refresh_step_flags()

    def _refresh_step_flags(self) -> None:
        # Gradients stay dense through the backward of a step whose update needs them.
        self._dense_grad_needed = self.needs_dense_grad and self.is_update_step()

    def state_dict(self) -> dict[str, Any]:
        """Step, last update step and every stateful schedule's state."""
        return {
            **super().state_dict(),
            "last_update_step": self._last_update_step,
            "sparsity": self.sparsity.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output, schedule state included."""
        super().load_state_dict(state_dict)
        self._last_update_step = int(state_dict.get("last_update_step", -1))
        self.sparsity.load_state_dict(state_dict.get("sparsity", {}))
        self._refresh_step_flags()
