"""`Group`: different algorithms for different parameters; the first matching filter wins.

Example (Cerebras API)::

    sparsity = Group({
        "fc1.*": Static(sparsity=0.3),
        "fc2.*": SET(sparsity=0.9, update={"freq": 1000}, drop_fraction=0.3),
    })

Filters are fnmatch globs on full dotted names (``*`` also matches ``.``), lists of globs (any
match) or callables ``(name, param) -> bool``. Parameters no filter matches stay dense.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_sparse.algorithms.base import SparsityAlgorithm, SparsityHook
from lightning_sparse.filters import ParamFilter, make_param_filter
from lightning_sparse.selection import Candidate, candidates, tied_parameter_ids

__all__ = ["Group"]

FilterSpec = str | Sequence[str] | ParamFilter | None


class Group(SparsityAlgorithm):
    """A composition of algorithms, each over the parameters its filter selects.

    Args:
        groups: ``{filter: algorithm}``; a ``None`` filter means the algorithm's own filter
            (the default filter unless it was given one). Order matters: first match wins.
    """

    def __init__(self, groups: Mapping[Any, SparsityAlgorithm] | None = None) -> None:
        super().__init__()
        self._members: list[tuple[ParamFilter | None, SparsityAlgorithm]] = []
        for spec, algorithm in (groups or {}).items():
            self.add(spec, algorithm)

    # ------------------------------------------------------------------ composition
    def add(self, param_filter: FilterSpec, algorithm: SparsityAlgorithm) -> None:
        """Append ``algorithm`` for the parameters ``param_filter`` selects."""
        if isinstance(param_filter, tuple):
            param_filter = list(param_filter)
        if isinstance(algorithm, Group) or not isinstance(algorithm, SparsityAlgorithm):
            raise TypeError(
                f"Group members must be non-Group SparsityAlgorithm objects, got "
                f"{type(algorithm).__name__}; use Group.extend to merge groups"
            )
        if self._root is not None:
            raise RuntimeError("cannot add to a Group that is already applied to a model")
        if algorithm._root is not None:
            raise RuntimeError(
                f"{algorithm.name} is already applied to a model; give the Group a new algorithm "
                "object"
            )
        self._members.append((make_param_filter(param_filter), algorithm))

    def extend(self, other: Group) -> None:
        """Append every (filter, algorithm) pair of ``other``."""
        if not isinstance(other, Group):
            raise TypeError(f"Group.extend expects a Group, got {type(other).__name__}")
        for param_filter, algorithm in other._members:
            self.add(param_filter, algorithm)

    def __getitem__(self, index: int) -> SparsityAlgorithm:
        return self._members[index][1]

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[SparsityAlgorithm]:
        return (algorithm for _, algorithm in self._members)

    @property
    def autoupdate(self) -> bool:  # type: ignore[override]
        """Whether optimizer steps update the members' masks; setting it sets every member's."""
        return self._autoupdate

    @autoupdate.setter
    def autoupdate(self, value: bool) -> None:
        self._autoupdate = value
        for algorithm in getattr(self, "_members", []):
            algorithm[1].autoupdate = value

    @property
    def lightning_driven(self) -> bool:  # type: ignore[override]
        """Set by the Lightning glue: the callback, not the step pre-hook, updates and prunes."""
        return self._lightning_driven

    @lightning_driven.setter
    def lightning_driven(self, value: bool) -> None:
        self._lightning_driven = value
        for algorithm in getattr(self, "_members", []):
            algorithm[1].lightning_driven = value

    def sync_optimizer(self, optimizer: torch.optim.Optimizer, force: bool = False) -> None:
        """Every member prunes its gradients and optimizer state if its masks changed."""
        for algorithm in self:
            if any(o is optimizer for o in algorithm._optimizers):
                algorithm.sync_optimizer(optimizer, force)

    @property
    def check_finite(self) -> bool:  # type: ignore[override]
        """Check gradients for inf/NaN before updating (set by the Lightning glue under AMP)."""
        return self._check_finite

    @check_finite.setter
    def check_finite(self, value: bool) -> None:
        self._check_finite = value
        for algorithm in getattr(self, "_members", []):
            algorithm[1].check_finite = value

    # ------------------------------------------------------------------ apply / update
    def target_sparsity(self, name: str, step: int) -> float:
        """The target of the member that owns ``name``."""
        for algorithm in self:
            if name in algorithm.sparse_params:
                return algorithm.target_sparsity(name, step)
        raise KeyError(f"{name!r} is not sparsified by this Group")

    def _apply_model(self, root: nn.Module) -> None:
        if not self._members:
            raise RuntimeError("Group is empty: add (filter, algorithm) pairs before applying it")
        if self._root is not None:
            raise RuntimeError(f"{self.name} is already applied to a model")
        tied = tied_parameter_ids(root)
        routed: list[list[Candidate]] = [[] for _ in self._members]
        for candidate in candidates(root):
            for i, (param_filter, algorithm) in enumerate(self._members):
                name, _, _, param = candidate
                chosen = (
                    param_filter(name, param)
                    if param_filter
                    else algorithm.selects(candidate, tied)
                )
                if chosen:
                    routed[i].append(candidate)
                    break
        if not any(routed):
            warnings.warn(
                f"{self.name}: no parameter of {type(root).__name__} matched any filter, so "
                "nothing was sparsified; check the filters against model.named_parameters()",
                stacklevel=3,
            )
        for (_, algorithm), chosen in zip(self._members, routed, strict=True):
            algorithm.check_attachable(chosen)  # every member, before any is attached
        for (_, algorithm), chosen in zip(self._members, routed, strict=True):
            algorithm.attach(root, chosen)
        self._root = root

    def _apply_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._root is None:
            raise RuntimeError("apply the Group to the model first, then to the optimizer")
        for algorithm in self:
            if algorithm._root is not None:
                algorithm.apply(optimizer)
        self._optimizers.append(optimizer)

    def detach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remove every member's hooks from ``optimizer``."""
        for algorithm in self:
            algorithm.detach_optimizer(optimizer)
        self._optimizers = [o for o in self._optimizers if o is not optimizer]

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Update every member."""
        for algorithm in self:
            algorithm.update(optimizer)

    @property
    def sparse_params(self) -> dict:  # type: ignore[override]
        """All members' sparse parameters by full name."""
        merged: dict = {}
        for algorithm in self._members_list():
            merged.update(algorithm.sparse_params)
        return merged

    @sparse_params.setter
    def sparse_params(self, value: dict) -> None:  # base __init__ assigns an empty dict
        pass

    def _members_list(self) -> list[SparsityAlgorithm]:
        return [a for _, a in getattr(self, "_members", [])]

    @property
    def step(self) -> int:  # type: ignore[override]
        """Completed optimizer steps (the members count in lockstep)."""
        members = self._members_list()
        return members[0].step if members else 0

    @step.setter
    def step(self, value: int) -> None:
        for algorithm in self._members_list():
            algorithm.step = value

    def remove(self) -> None:
        """Remove every member's masks and hooks."""
        for algorithm in self:
            algorithm.remove()
        self._optimizers.clear()

    # ------------------------------------------------------------------ hooks and state
    def register_target_sparsity_hook(self, hook: SparsityHook) -> list[RemovableHandle]:  # type: ignore[override]
        """Register on every member; returns one handle per member."""
        return [a.register_target_sparsity_hook(hook) for a in self]

    def register_computed_sparsity_hook(self, hook: SparsityHook) -> list[RemovableHandle]:  # type: ignore[override]
        """Register on every member; returns one handle per member."""
        return [a.register_computed_sparsity_hook(hook) for a in self]

    def overall_sparsity(self) -> tuple[float, torch.Tensor]:
        """(target, actual) over all members' parameters, weighted by size."""
        parts = [(a.overall_sparsity(), a.sparse_params) for a in self if a.sparse_params]
        if not parts:
            return 0.0, torch.zeros(())
        sizes = [sum(sp.mask.numel() for sp in params.values()) for _, params in parts]
        total = sum(sizes)
        target = sum(t * s for ((t, _), _), s in zip(parts, sizes, strict=True)) / total
        actual = sum(a * s for ((_, a), _), s in zip(parts, sizes, strict=True)) / total
        return target, actual

    @property
    def _unlogged_update(self) -> bool:
        return any(a._unlogged_update for a in self._members_list())

    @_unlogged_update.setter
    def _unlogged_update(self, value: bool) -> None:
        for algorithm in self._members_list():
            algorithm._unlogged_update = value

    @property
    def last_update(self) -> dict:  # type: ignore[override]
        """The members' last update figures, merged by parameter name."""
        merged: dict = {}
        for algorithm in self._members_list():
            merged.update(algorithm.last_update)
        return merged

    @last_update.setter
    def last_update(self, value: dict) -> None:  # base __init__ assigns an empty dict
        pass

    @property
    def ever_active(self) -> dict:  # type: ignore[override]
        """The members' "ever active" tensors (ITOP), merged by parameter name."""
        merged: dict = {}
        for algorithm in self._members_list():
            merged.update(algorithm.ever_active)
        return merged

    @ever_active.setter
    def ever_active(self, value: dict) -> None:  # base __init__ assigns an empty dict
        pass

    def state_dict(self) -> dict[str, Any]:
        """``{"groups": [member state, ...]}``."""
        return {"groups": [a.state_dict() for a in self]}

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Accepts ``{"groups": [...]}``, a list (Cerebras) or one member's dict."""
        if isinstance(state_dict, dict):
            states = state_dict["groups"] if "groups" in state_dict else [state_dict]
        else:
            states = list(state_dict)
        if len(states) != len(self._members):
            raise ValueError(
                f"sparsity state has {len(states)} group(s) but this Group has "
                f"{len(self._members)}; the checkpoint was made with a different configuration"
            )
        for algorithm, state in zip(self, states, strict=True):
            algorithm.load_state_dict(state)

    def __repr__(self) -> str:
        inner = ", ".join(repr(a) for a in self)
        return f"Group([{inner}])"
