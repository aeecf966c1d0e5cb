"""Cerebras 2.0/2.1 entry point: ``configure_sparsity_wrapper`` and ``SparsityWrapperOptimizer``.

Cerebras 2.0 (``cerebras_pytorch.sparse``, "SparsityOptimizer" API) sparsified a model with::

    optimizer = cstorch.sparse.configure_sparsity_wrapper(
        model, optimizer, "rigl", sparsity=0.9, schedule=100, drop_fraction=0.3,
        param_name_patterns=[".*dense_layer.weight"],
    )

and used the returned ``SparsityWrapperOptimizer`` as a drop-in replacement for ``optimizer``
(docs: https://docs.cerebras.net/en/2.1.0/wsc/api/cerebras_pytorch/sparse.html). Here the same
call builds a 2.2+ algorithm through ``configure`` and applies it with ``apply(model)`` and
``apply(optimizer)``; the wrapper only delegates, so pruning happens in the algorithm's official
step hooks whether the wrapper or the wrapped optimizer is stepped.

Differences from 2.0: masks are ``<param>_mask`` buffers in ``model.state_dict()`` (2.0 kept them
in the optimizer's ``"sparsity"`` state); ``state_dict()["sparsity"]`` holds the algorithm's state
(its step counter and schedule state); ``load_state_dict`` does not mutate its argument.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .algorithms.base import SparsityAlgorithm
from .algorithms.group import Group
from .configure import configure
from .filters import ParamFilter

__all__ = ["SparsityWrapperOptimizer", "configure_sparsity_wrapper"]

ParamNamePatterns = str | list[str] | dict[str, dict[str, Any] | None]

_OPTIMIZER_HOOK_REGISTRIES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class SparsityWrapperOptimizer(torch.optim.Optimizer):
    """A drop-in optimizer: the wrapped optimizer, plus sparsity state in its checkpoints.

    ``param_groups``, ``state`` and ``defaults`` *are* the wrapped optimizer's (read through to it,
    so they stay the same objects even after it reloads its state): torch LR schedulers work on
    the wrapper unchanged. Step and state-dict hooks registered on the wrapper run around the
    wrapped optimizer's step and state dict.

    Cerebras 2.0 API: ``cerebras_pytorch.sparse.SparsityWrapperOptimizer(optimizer,
    sparsity_optimizer)``.

    Args:
        optimizer: the optimizer to wrap; ``sparsity`` must already be applied to it.
        sparsity: the algorithm applied to the model and to ``optimizer``.

    Raises:
        ValueError: if ``sparsity`` is not applied to ``optimizer``.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, sparsity: SparsityAlgorithm | Group
    ) -> None:
        if not any(o is optimizer for o in sparsity.optimizers):
            raise ValueError(
                f"{sparsity!r} is not applied to the optimizer being wrapped; call "
                "sparsity.apply(optimizer) first, or use configure_sparsity_wrapper"
            )
        self.optimizer = optimizer
        self.sparsity = sparsity
        # Not Optimizer.__init__: it would build new param groups. Set up what it sets besides
        # them: the hook registries and the hooked step (so register_step_pre_hook works here).
        for registry in _OPTIMIZER_HOOK_REGISTRIES:
            setattr(self, registry, OrderedDict())
        self._patch_step_function()

    # The wrapped optimizer's own objects, never copies.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` list."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter ``state``."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer; its sparsity hooks update masks and re-prune weights."""
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients of the wrapped optimizer's parameters."""
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer (its parameters must belong to the model)."""
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"sparsity"``: the algorithm's state."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = {**self.optimizer.state_dict(), "sparsity": self.sparsity.state_dict()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = post_hook(self, state) or state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (a dense optimizer's state dict leaves sparsity as is).

        As in Cerebras 2.0, a state dict without ``"sparsity"`` (from the dense optimizer) loads
        into the wrapped optimizer only; the algorithm keeps its step and schedule state.
        """
        state = dict(state_dict)  # 2.0 popped "sparsity" from the caller's dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state = pre_hook(self, state) or state
        sparsity_state = state.pop("sparsity", None)
        self.optimizer.load_state_dict(state)
        if sparsity_state is not None:
            self.sparsity.load_state_dict(sparsity_state)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r}, sparsity={self.sparsity!r})"


def configure_sparsity_wrapper(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sparsity_type: str,
    param_name_patterns: ParamNamePatterns | None = None,
    sparse_param_filter: ParamFilter | None = None,
    **kwargs: Any,
) -> SparsityWrapperOptimizer:
    """Sparsify ``model`` and ``optimizer`` from 2.0-style arguments; return a drop-in optimizer.

    Cerebras 2.0 API: ``cerebras_pytorch.sparse.configure_sparsity_wrapper(model, optimizer,
    sparsity_type, param_name_patterns=None, sparse_param_filter=None, **kwargs)``.

    Args:
        model: the model to sparsify; ``optimizer`` must hold only its parameters.
        optimizer: the optimizer to wrap (any ``torch.optim.Optimizer``).
        sparsity_type: ``"static"``, ``"gmp"``, ``"set"``, ``"rigl"``, ``"granet"`` or the
            lower-cased name of a user ``SparsityAlgorithm`` subclass.
        param_name_patterns: which parameters to sparsify: a regex (``re.search``), a list of
            regexes, or ``{regex: {option: value} | None}`` for per-pattern options (first match
            wins). Takes precedence over ``sparse_param_filter``, as in 2.0.
        sparse_param_filter: ``(name, param) -> bool`` used when no patterns are given; default:
            weights with ``ndim >= 2`` that are not embeddings, norms or the output head.
        **kwargs: algorithm options in 2.0 or 2.2+ spelling: ``sparsity``, ``schedule`` (the
            2.0 update cadence: an int n = every n steps, ``{freq, start, stop}`` or a list of
            steps), ``sparsity_schedule=[[step, sparsity], ...]``, ``init_method``,
            ``drop_fraction``, ``balance_in_groups``, ``seed``, ...

    Returns:
        A ``SparsityWrapperOptimizer`` over ``optimizer``; its ``.sparsity`` is the algorithm.

    Raises:
        ValueError / TypeError: from ``configure`` for a bad option (naming it), if the
            configuration is dense (``sparsity=None``), or if both ``schedule`` and ``update``
            are given.
    """
    if "schedule" in kwargs and "update" in kwargs:
        raise ValueError(
            "give the update cadence once: 'schedule' (the Cerebras 2.0 name) or 'update' (2.2+)"
        )
    config: dict[str, Any] = dict(kwargs)
    if "schedule" in config:
        config["update"] = config.pop("schedule")  # in 2.0 'schedule' is always the cadence
    config["algorithm"] = sparsity_type
    if param_name_patterns is not None:
        config["param_name_patterns"] = param_name_patterns
    elif sparse_param_filter is not None:
        config["param_filter"] = sparse_param_filter
    sparsity = configure(config)
    if sparsity is None:
        raise ValueError(
            f"configure_sparsity_wrapper got a dense configuration ({kwargs!r}); use the "
            "optimizer directly for dense training"
        )
    sparsity.apply(model)
    sparsity.apply(optimizer)
    return SparsityWrapperOptimizer(optimizer, sparsity)
