"""An algorithm's saved state: made (`pack_state`), checked, read, and restored into its masks.

The state holds the step (and the step of the last update), the seed, what identifies the run
(``"algorithm"``, ``"params"`` = names and shapes, ``"config"`` = hyper-parameter reprs) and the
masks, 1 bit per element (``"masks"``, `bitpack`), the one saved copy of the masks. Every check
here runs before a load changes anything, so a refused state leaves the algorithm, its masks and
the model as they were; a `Group` checks every member before any loads. The checks and readers
are pure functions over the dict ``state_dict()`` returns; `restore_masks_` and
`restore_ever_active_` write the live masks in place. Earlier versions' states
(no ``"masks"``: the masks came with the model state dict; ``"mask_targets"`` instead of
``"last_update_step"``) still pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .bitpack import check_packed, pack_bits, unpack_bits
from .legacy import earlier_ever_active, earlier_targets
from .masking import PrunedValues
from .sharding import full, local, shard_like
from .sparse_parameter import SparseParameter

__all__ = [
    "Expected",
    "Unpacked",
    "check_state",
    "pack_state",
    "restore_ever_active_",
    "restore_masks_",
    "saved_ever_active",
    "saved_masks",
    "saved_targets",
]


@dataclass(frozen=True)
class Expected:
    """What a state must agree with to be loaded (the loading algorithm's facts).

    Attributes:
        owner: the algorithm's name, for messages.
        kind: its registry name (``"rigl"``).
        shapes: ``{param name: shape}`` of its sparse parameters (empty before ``apply``).
        config: its hyper-parameters as reprs (`SparsityAlgorithm.config`).
        seed: its seed; ``seed_given``: whether the user chose it.
        ever_active: ``{param name: shape}`` of its ever-active masks (ITOP).
        applied: whether it is applied to a model (masks have somewhere to go).
    """

    owner: str
    kind: str
    shapes: dict[str, list[int]] = field(default_factory=dict)
    config: dict[str, str] = field(default_factory=dict)
    seed: int | None = None
    seed_given: bool = False
    ever_active: dict[str, tuple[int, ...]] = field(default_factory=dict)
    applied: bool = False


Target = Callable[[str, int], float]  # (param name, step) -> the sparsity its mask was built for


def pack_state(
    *,
    step: int,
    last_update_step: int,
    seed: int | None,
    kind: str,
    masks: Mapping[str, torch.Tensor],
    config: dict[str, str],
    removed: bool,
    ever_active: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """The state ``state_dict()`` returns: plain Python values and tensors, loadable with
    ``torch.load(weights_only=True)``. ``"masks"``: ``{name: uint8[ceil(numel / 8)]}`` on the
    CPU, shapes in ``"params"`` (a sharded mask is all-gathered: call it on every rank);
    ``"ever_active"`` (ITOP) packed like the masks, when there are any."""
    state: dict[str, Any] = {
        "step": step,
        "last_update_step": last_update_step,
        "seed": seed,
        "algorithm": kind,
        "params": {name: list(mask.shape) for name, mask in masks.items()},
        "config": config,
        "masks": {name: pack_bits(full(mask)).cpu() for name, mask in masks.items()},
        "removed": removed,
    }
    if ever_active:  # packed like the masks: on the CPU, 1 bit per weight
        state["ever_active"] = {n: pack_bits(full(m)).cpu() for n, m in ever_active.items()}
    return state


def check_state(state: Any, expected: Expected, target: Target, loading: bool = True) -> None:
    """Raise unless ``state`` can be restored into the algorithm ``expected`` describes.

    Args:
        state: what ``state_dict()`` returned (possibly from another run or version).
        expected: the loading algorithm's facts.
        target: its sparsity per parameter and step (checks the targets the masks were built for).
        loading: masks need an applied algorithm (False: only checking, e.g. before ``apply``).

    Raises:
        TypeError / KeyError / ValueError: not a dict, no ``step``, a malformed counter, another
            algorithm, other parameters or shapes, other hyper-parameters, a different explicit
            seed, a malformed ever-active mask or target, a corrupt packed mask, masks for an
            algorithm not applied to a model yet. The message names the key and the fix.
    """
    owner = expected.owner
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{owner}: sparsity state must be the dict state_dict() returned, got "
            f"{type(state).__name__}"
        )
    if "step" not in state:
        raise KeyError(
            f"{owner}: sparsity state {sorted(state)} has no 'step'; pass what "
            "state_dict() returned"
        )
    _int(state, "step", None, owner)
    _int(state, "last_update_step", -1, owner)
    if "algorithm" in state and state["algorithm"] != expected.kind:
        raise ValueError(
            f"{owner}: the checkpoint holds {state['algorithm']!r} state, not "
            f"{expected.kind!r}; resume with the algorithm that wrote it"
        )
    # A state without parameters comes from a removed (densified) algorithm: VariableSPDF.
    if state.get("removed") and state.get("masks"):
        raise ValueError(
            f"{owner}: the sparsity state of a removed algorithm holds masks; the "
            "checkpoint is corrupt"
        )
    if state.get("params") and expected.shapes:
        theirs = {name: list(shape) for name, shape in state["params"].items()}
        if expected.shapes != theirs:
            ours = expected.shapes
            diff = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
            raise ValueError(
                f"{owner}: the checkpoint sparsifies other parameters or shapes "
                f"(differing: {diff[:3]}); resume with the same model and "
                "param_filter"
            )
    if "config" in state:
        mine, saved = expected.config, state["config"]
        settings = {
            k: (saved.get(k), mine.get(k))
            for k in set(mine) | set(saved)
            if saved.get(k) != mine.get(k)
        }
        if settings:
            key, (was, now) = sorted(settings.items())[0]
            raise ValueError(
                f"{owner}: the checkpoint was made with {key}={was}, this object "
                f"has {key}={now} ({len(settings)} setting(s) differ); construct the "
                "algorithm with the checkpoint's settings to resume it"
            )
    seed = state.get("seed", expected.seed)
    if expected.seed_given and seed is not None and seed != expected.seed:
        raise ValueError(
            f"{owner}: the checkpoint was made with seed={seed}, this object has "
            f"seed={expected.seed}; pass seed={seed} (or seed=None) to resume it"
        )
    _check_ever_active(state, expected)
    saved_targets(state, list(expected.shapes), target, owner)
    saved_masks(state, owner)
    if loading and not expected.applied and state.get("masks"):
        raise ValueError(
            f"{owner}: the sparsity state holds masks but the algorithm is not "
            "applied to a model; call apply(model) first, then load_state_dict"
        )


def _int(state: Mapping[str, Any], key: str, default: int | None, owner: str) -> int:
    value = state.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(
            f"{owner}: sparsity state {key}={value!r} must be an int step; pass what "
            "state_dict() returned"
        )
    return value


def _check_ever_active(state: Mapping[str, Any], expected: Expected) -> None:
    ever = state.get("ever_active", {})
    if not isinstance(ever, Mapping):
        raise ValueError(
            f"{expected.owner}: sparsity state ever_active must be a dict of bool masks"
        )
    for name, mask in ever.items():
        shape = expected.ever_active.get(name)
        if shape is None:
            continue
        if earlier_ever_active(mask, shape):  # an earlier version's: the mask itself
            continue
        got = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        try:
            check_packed(mask, shape)  # packed like the masks
        except ValueError as err:
            raise ValueError(
                f"{expected.owner}: ever_active[{name!r}] has shape {got}; it must be the "
                f"packed bits of the parameter's {shape} mask ({err})"
            ) from None


def saved_ever_active(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state's ever-active masks (ITOP) as bool tensors of the parameters' shapes (packed
    bits unpacked; an earlier version's full-size masks as they are). Call after `check_state`.
    """
    shapes = state.get("params") or {}
    out = {}
    for name, mask in (state.get("ever_active") or {}).items():
        if name not in shapes:
            continue
        shape = tuple(shapes[name])
        out[name] = mask if earlier_ever_active(mask, shape) else unpack_bits(mask, shape)
    return out


def saved_masks(state: Mapping[str, Any], owner: str) -> Mapping[str, torch.Tensor]:
    """The state's masks (bool, full shape, CPU), each unpacked when it is read (`Unpacked`: a
    model's masks are never all unpacked at once), every one checked first; ``{}`` for an
    earlier version's state (its masks came with the model state dict).

    Raises:
        ValueError: ``"masks"`` is not a dict of packed masks for exactly the state's parameters,
            or one is corrupt (`check_packed`).
    """
    masks = state.get("masks")
    if masks is None:
        return {}
    shapes = state.get("params")
    if not isinstance(masks, Mapping) or not isinstance(shapes, Mapping):
        raise ValueError(
            f"{owner}: sparsity state 'masks' and 'params' must be dicts keyed by "
            "parameter name; pass what state_dict() returned"
        )
    if set(masks) != set(shapes):
        differ = sorted(set(masks) ^ set(shapes))
        raise ValueError(
            f"{owner}: sparsity state has masks for other parameters than its "
            f"'params' (differing: {differ[:3]}); the checkpoint is corrupt"
        )
    for name, packed in masks.items():
        try:
            check_packed(packed, shapes[name])
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"{owner}: sparsity state masks[{name!r}]: {err}; the checkpoint "
                "is corrupt, resume from another one"
            ) from None
    return Unpacked(masks, shapes)


class Unpacked(Mapping[str, torch.Tensor]):
    """``{name: bool mask}`` over checked packed masks (`saved_masks`), each unpacked when read."""

    def __init__(self, packed: Mapping[str, torch.Tensor], shapes: Mapping[str, Any]) -> None:
        self._packed, self._shapes = packed, shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        return unpack_bits(self._packed[name], self._shapes[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)


def saved_targets(
    state: Mapping[str, Any], names: list[str], target: Target, owner: str
) -> dict[str, float]:
    """The sparsity each of ``names``' saved masks was built for: the schedule at the last
    update step, or an earlier version's ``"mask_targets"`` (raises on a malformed entry)."""
    last = state.get("last_update_step", -1)
    if last >= 0:
        return {name: target(name, last) for name in names}
    return earlier_targets(state, names, owner)


def restore_ever_active_(
    ever_active: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]
) -> None:
    """Copy the ``saved`` ever-active masks (`saved_ever_active`) into the live ones."""
    for name, mask in saved.items():
        if name in ever_active:
            ever = ever_active[name]
            ever.copy_(shard_like(mask.to(ever.device), ever))


def restore_masks_(
    sparse_params: Mapping[str, SparseParameter],
    masks: Mapping[str, torch.Tensor],
    removed: bool,
    unpruned: Mapping[str, PrunedValues],
) -> None:
    """Copy the saved ``masks`` (`saved_masks`) into the mask buffers (all ones for a removed
    algorithm's state), put back first the values a model load just zeroed (``unpruned``) and
    prune. A parameter without a saved mask keeps its mask (an earlier version's state: the
    masks came with the model)."""
    with torch.no_grad():
        for name, sp in sparse_params.items():
            if name not in masks and not removed:
                continue  # an earlier version's state: the masks came with the model
            if name in unpruned:
                unpruned[name].put_back_(sp.param, local(sp.param))
            if removed:
                sp.mask.fill_(True)
            else:
                sp.mask.copy_(shard_like(masks[name].to(sp.mask.device), sp.mask))
            sp.prune_()
