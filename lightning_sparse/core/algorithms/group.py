"""`Group`: different algorithms for different parameters; the first matching filter wins.

Example (Cerebras API)::

    sparsity = Group({
        "fc1.*": Static(sparsity=0.3),
        "fc2.*": SET(sparsity=0.9, update={"freq": 1000}, drop_fraction=0.3),
    })

A composite, not an algorithm: it routes each parameter to one member and forwards every call
to the members, which own their masks, hooks and steps. Filters are fnmatch globs on full
dotted names (``*`` also matches ``.``), lists of globs or callables ``(name, param) -> bool``;
a ``None`` filter uses the member's own. Parameters no filter matches stay dense.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import report
from ..apply_checks import already_applied
from ..apply_model import model_apply_visits_child, transaction
from ..filters import ParamFilter, PatternFilter, make_param_filter, unselected_patterns
from ..observers import SparsityHook, UpdateHook
from ..selection import Candidate, candidates, default_dense_ids, default_selects
from .base import SparsityAlgorithm

__all__ = ["Group"]

FilterSpec = str | Sequence[str] | ParamFilter | None


class Group:
    """A composition of algorithms, each over the parameters its filter selects.

    Args:
        groups: ``{filter: algorithm}``; order matters (first match wins).
    """

    def __init__(self, groups: Mapping[Any, SparsityAlgorithm] | None = None) -> None:
        if groups is not None and not isinstance(groups, Mapping):
            raise TypeError(
                f"Group(groups={groups!r}) needs a mapping {{filter: algorithm}}, e.g. "
                "{'fc1.*': Static(0.5)}"
            )
        self.members: list[tuple[ParamFilter | None, SparsityAlgorithm]] = []
        self.root: nn.Module | None = None
        self.name = "sparsity_group"
        for spec, algorithm in (groups or {}).items():
            self.add(spec, algorithm)

    # ------------------------------------------------------------------ composition
    def add(self, param_filter: FilterSpec, algorithm: SparsityAlgorithm) -> None:
        """Append ``algorithm`` for the parameters ``param_filter`` selects."""
        if not isinstance(algorithm, SparsityAlgorithm):
            raise TypeError(
                f"Group members must be SparsityAlgorithm objects, got {type(algorithm).__name__}"
                "; use Group.extend to merge groups"
            )
        if self.root is not None:
            raise RuntimeError("cannot add to a Group that is already applied to a model")
        if algorithm.root is not None or any(algorithm is a for a in self):
            raise RuntimeError(
                f"{algorithm.name} is already applied to a model or a member of this Group; "
                "give every filter its own algorithm object"
            )
        spec = list(param_filter) if isinstance(param_filter, tuple) else param_filter
        self.members.append((make_param_filter(spec), algorithm))

    def extend(self, other: Group) -> None:
        """Append every (filter, algorithm) pair of ``other``."""
        if not isinstance(other, Group):
            raise TypeError(f"Group.extend expects a Group, got {type(other).__name__}")
        for param_filter, algorithm in other.members:
            self.add(param_filter, algorithm)

    def __getitem__(self, index: int) -> SparsityAlgorithm:
        return self.members[index][1]

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[SparsityAlgorithm]:
        return (algorithm for _, algorithm in self.members)

    # ------------------------------------------------------------------ apply
    def __call__(self, module: nn.Module) -> None:
        """``model.apply(group)``: acts on the model's call only (`model_apply_visits_child`)."""
        if not model_apply_visits_child(module):
            self.apply(module)

    def apply(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        """Sparsify a model (every member, all or nothing) or an optimizer (every member)."""
        if isinstance(obj, torch.optim.Optimizer):
            if self.root is None:
                raise RuntimeError("apply the Group to the model first, then to the optimizer")
            for algorithm in self:
                if algorithm.root is not None:
                    algorithm.apply(obj)
            return
        if not isinstance(obj, nn.Module):
            raise TypeError(
                f"Group.apply expects an nn.Module or an Optimizer, got {type(obj).__name__}"
            )
        if not self.members:
            raise RuntimeError("Group is empty: add (filter, algorithm) pairs before applying it")
        if self.root is not None:
            raise already_applied(self.name, self.root, obj)
        # The members' apply phases (their masks' `MaskState`), all or nothing.
        transaction(obj, [algorithm.mask_state for algorithm in self], self.route(obj))
        self.root = obj

    def route(self, root: nn.Module) -> list[list[Candidate]]:
        """The candidates of ``root`` each member gets (first matching filter wins). Warns, by
        name, of every pattern and every member that selects nothing (`report_unselected`)."""
        dense = default_dense_ids(root)  # tied weights, heads, PEFT adapters
        routed: list[list[Candidate]] = [[] for _ in self.members]
        matched: list[list[str]] = [[] for _ in self.members]  # every name each filter matches
        names = []
        for candidate in candidates(root):
            names.append(candidate[0])
            owner = None
            for i, (param_filter, algorithm) in enumerate(self.members):
                if param_filter is not None:
                    chosen = param_filter(candidate[0], candidate[3])
                elif algorithm.param_filter is not None:
                    chosen = algorithm.param_filter(candidate[0], candidate[3])
                else:
                    chosen = default_selects(candidate, dense) and candidate[3].requires_grad
                if chosen:
                    matched[i].append(candidate[0])
                    owner = i if owner is None else owner
            if owner is not None:
                routed[owner].append(candidate)
        if not any(routed):
            warnings.warn(
                f"{self.name}: no parameter of {type(root).__name__} matched any filter, so "
                "nothing was sparsified; check the filters against model.named_parameters()",
                stacklevel=4,
            )
        for message in self.report_unselected(names, routed, matched):
            warnings.warn(message, stacklevel=3)
        return routed

    def report_unselected(
        self, names: list[str], routed: list[list[Candidate]], matched: list[list[str]]
    ) -> list[str]:
        """Messages for each pattern (of a glob filter) and each other filter that selects no
        parameter: it matches none, or every one it matches went to an earlier member
        (``Group({"*.weight": a, "0.weight": b})`` leaves ``b`` nothing)."""
        taken_by = {c[0]: self._label(i) for i, chosen in enumerate(routed) for c in chosen}
        messages = []
        for i, (param_filter, algorithm) in enumerate(self.members):
            own = param_filter if param_filter is not None else algorithm.param_filter
            selected = {c[0] for c in routed[i]}
            if isinstance(own, PatternFilter):
                messages += unselected_patterns(self._label(i), own, names, selected, taken_by)
            elif not selected:
                label = getattr(own, "__qualname__", None) or repr(own)
                what = "the default filter" if own is None else f"filter {label}"
                if not matched[i]:
                    messages.append(f"{self._label(i)}: {what} matches no parameter")
                else:
                    owners = sorted({taken_by[n] for n in matched[i]})
                    messages.append(
                        f"{self._label(i)}: {what} selects nothing: the {len(matched[i])} "
                        f"parameter(s) it matches (first: {matched[i][0]!r}) go to "
                        f"{', '.join(owners)}, listed earlier (the first matching filter wins)"
                    )
        return messages

    def _label(self, index: int) -> str:
        return f"{self.name}[{index}] ({self.members[index][1].name})"

    # ------------------------------------------------------------------ forwarded to members
    def _applied(self) -> list[SparsityAlgorithm]:
        return [a for a in self if a.root is not None]

    def update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Update every member."""
        for algorithm in self:
            algorithm.update(optimizer)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Every member's pre-step work on ``optimizer``."""
        for algorithm in self:
            if any(o is optimizer for o in algorithm.optimizers):
                algorithm.before_step(optimizer)

    def detach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remove every member's hooks from ``optimizer``."""
        for algorithm in self:
            algorithm.detach_optimizer(optimizer)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Optimizers the applied members are applied to."""
        seen: dict[int, torch.optim.Optimizer] = {}
        for algorithm in self:
            seen.update((id(o), o) for o in algorithm.optimizers)
        return list(seen.values())

    def _set(self, attr: str, value: Any) -> None:
        for algorithm in self:
            setattr(algorithm, attr, value)

    autoupdate = property(
        lambda self: all(a.autoupdate for a in self),
        lambda self, v: self._set("autoupdate", v),
        doc="Whether optimizer steps update the members' masks.",
    )
    step_driver = property(
        lambda self: next((a.step_driver for a in self if a.step_driver is not None), None),
        lambda self, v: self._set("step_driver", v),
        doc="The training loop that calls the members' before_step (set by a layer above).",
    )
    check_finite = property(
        lambda self: any(a.check_finite for a in self),
        lambda self, v: self._set("check_finite", v),
        doc="Skip updates on steps AMP will skip (set under AMP).",
    )
    unlogged_update = property(
        lambda self: any(a.unlogged_update for a in self),
        lambda self, v: self._set("unlogged_update", v),
    )

    @property
    def step(self) -> int:
        """Completed optimizer steps (the members count in lockstep)."""
        applied = self._applied() or list(self)
        return applied[0].step if applied else 0

    @property
    def dense_grad_needed(self) -> bool:
        """Whether any member needs the dense gradient in this step's backward."""
        return any(a.dense_grad_needed for a in self)

    def _merged(self, attr: str) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for algorithm in self:
            merged.update(getattr(algorithm, attr))
        return merged

    sparse_params = property(
        lambda self: self._merged("sparse_params"),
        doc="All members' sparse parameters by full name.",
    )
    last_update = property(
        lambda self: self._merged("last_update"),
        doc="The members' last update figures by parameter name.",
    )
    ever_active = property(
        lambda self: self._merged("ever_active"),
        doc="The members' ever-active masks (ITOP) by parameter name.",
    )

    def mask_target(self, name: str) -> float:
        """The target of the member that owns ``name``."""
        for algorithm in self:
            if name in algorithm.sparse_params:
                return algorithm.mask_target(name)
        raise KeyError(f"{name!r} is not sparsified by this Group")

    def overall_sparsity(self) -> tuple[float, torch.Tensor]:
        """(target, actual) over all members' parameters, weighted by size."""
        return report.overall_sparsity(self.sparse_params, self.mask_target)

    def itop_rate(self) -> torch.Tensor:
        """Share of all members' sparse weights ever active (0-d tensor)."""
        return report.itop_rate(self.ever_active)

    def check_range(self, horizon: int) -> None:
        """Every member's schedules over ``[0, horizon]``."""
        for algorithm in self:
            algorithm.check_range(horizon)

    def register_update_hook(self, hook: UpdateHook) -> list[RemovableHandle]:
        """Register on every member; one handle per member."""
        return [a.register_update_hook(hook) for a in self]

    def register_target_sparsity_hook(self, hook: SparsityHook) -> list[RemovableHandle]:
        """Register on every member; one handle per member."""
        return [a.register_target_sparsity_hook(hook) for a in self]

    def register_computed_sparsity_hook(self, hook: SparsityHook) -> list[RemovableHandle]:
        """Register on every member; one handle per member."""
        return [a.register_computed_sparsity_hook(hook) for a in self]

    def remove(self) -> None:
        """Remove every member's masks and hooks."""
        for algorithm in self:
            algorithm.remove()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"groups": [member state, ...]}``."""
        return {"groups": [a.state_dict() for a in self]}

    def _member_states(
        self, state_dict: dict[str, Any] | list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """One state per member from ``{"groups": [...]}``, a list (Cerebras) or one dict."""
        if isinstance(state_dict, Mapping):
            states = state_dict["groups"] if "groups" in state_dict else [state_dict]
        else:
            states = list(state_dict)
        if len(states) != len(self.members):
            raise ValueError(
                f"sparsity state has {len(states)} group(s) but this Group has "
                f"{len(self.members)}; the checkpoint was made with a different configuration"
            )
        return states

    def check_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Raise unless every member could load its part of ``state_dict``; changes nothing."""
        for algorithm, state in zip(self, self._member_states(state_dict), strict=True):
            algorithm.check_state_dict(state)

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Accepts ``{"groups": [...]}``, a list (Cerebras) or one member's dict; all members
        load or none does."""
        states = self._member_states(state_dict)
        for algorithm, state in zip(self, states, strict=True):  # all members before any loads
            algorithm.check_state_dict(state, loading=True)
        before = [a.state_dict() for a in self]  # a member's own load_state_dict may check more
        try:
            for algorithm, state in zip(self, states, strict=True):
                algorithm.load_state_dict(state)
        except BaseException:
            for algorithm, state in zip(self, before, strict=True):
                algorithm.load_state_dict(state)
            raise

    def __repr__(self) -> str:
        return f"Group([{', '.join(repr(a) for a in self)}])"
