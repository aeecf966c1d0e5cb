"""Checkpoints: the algorithm's state (masks included), and a model state dict arriving.

``state_dict()`` holds the step (and the step of the last update), the seed, what identifies the
run (algorithm, parameters and shapes, hyper-parameters) and the masks, 1 bit per element
(`bitpack`; a sharded mask is gathered first). It is the one saved copy of the masks: the mask
buffers are non-persistent, so ``model.state_dict()`` holds only the weights, pruned ones 0.
``load_state_dict`` checks everything before it changes anything, then copies the masks in place,
prunes, and makes the per-step path prune gradients and optimizer state again.

Model and sparsity state load in either order, bit-exactly. Loading a model state dict prunes
the weights with the current masks at once (pruned weights are 0 at every moment); the values it
zeroed are kept aside (packed positions and values, on the CPU) until the next step, so that a
sparsity state loaded next, whose masks keep some of them, puts them back.

Earlier versions saved masks as ``<param>_mask`` entries of the model state dict: the model's
load pre-hook checks them and adopts them as the masks (and removes them from the dict, so strict
loading passes); their algorithm states (no ``"masks"``) still load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..bitpack import pack_bits, unpack_bits
from ..sharding import full, local, shard_like

if TYPE_CHECKING:
    from .base import SparsityAlgorithm


# ---------------------------------------------------------------------- the algorithm's state
def algorithm_config(algorithm: SparsityAlgorithm) -> dict[str, str]:
    """What a checkpoint must agree on to be resumed by ``algorithm`` (reprs that are stable
    across processes)."""
    drop = algorithm.drop_fraction
    return {
        "sparsity": repr(algorithm.sparsity),
        "update": repr(algorithm.update_schedule),
        "shaper": repr(algorithm.shaper),
        "distribution": algorithm.layers.name,
        **({"drop_fraction": repr(drop)} if drop is not None else {}),
    }


def algorithm_state(algorithm: SparsityAlgorithm) -> dict[str, Any]:
    """What ``algorithm.state_dict()`` returns: plain Python values and tensors, loadable with
    ``torch.load(weights_only=True)``. ``"masks"``: ``{name: uint8[ceil(numel / 8)]}`` on the
    CPU, shapes in ``"params"`` (a sharded mask is all-gathered: call it on every rank)."""
    state: dict[str, Any] = {
        "step": algorithm.step,
        "last_update_step": algorithm.last_update_step,
        "seed": algorithm.seed,
        "algorithm": type(algorithm).__name__.lower(),
        "params": {name: list(sp.mask.shape) for name, sp in algorithm.sparse_params.items()},
        "config": algorithm.config(),
        "masks": {
            name: pack_bits(full(sp.mask)).cpu() for name, sp in algorithm.sparse_params.items()
        },
        "removed": algorithm.removed,
    }
    if algorithm.ever_active:
        state["ever_active"] = {n: m.clone() for n, m in algorithm.ever_active.items()}
    return state


def _int(state: Mapping[str, Any], key: str, default: int | None, owner: str) -> int:
    value = state.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"{owner}: sparsity state {key}={value!r} must be an int step; pass what "
                         "state_dict() returned")
    return value


def load_algorithm_state(algorithm: SparsityAlgorithm, state: Any) -> None:
    """Check ``state`` against ``algorithm`` completely, then restore it.

    Raises:
        ValueError / KeyError / TypeError: another algorithm, other parameters or shapes, other
            hyper-parameters, a different explicit seed, a corrupt mask, masks for an algorithm
            not applied to a model yet, or a malformed state; nothing changed.
    """
    check_loadable(algorithm, state)
    restore_algorithm_state(algorithm, state)


def check_loadable(algorithm: SparsityAlgorithm, state: Any) -> None:
    """`check_algorithm_state`, and masks need an applied algorithm (they have nowhere to go)."""
    check_algorithm_state(algorithm, state)
    if algorithm.root is None and state.get("masks"):
        raise ValueError(f"{algorithm.name}: the sparsity state holds masks but the algorithm "
                         "is not applied to a model; call apply(model) first, then "
                         "load_state_dict")


def check_algorithm_state(algorithm: SparsityAlgorithm, state: Any) -> None:
    """Raise (see `load_algorithm_state`) unless ``state`` can be restored into ``algorithm``;
    changes nothing, so a `Group` checks every member before any loads. Before ``apply`` the
    masks are checked against the shapes the state records."""
    owner = algorithm.name
    if not isinstance(state, Mapping):
        raise TypeError(f"{owner}: sparsity state must be the dict state_dict() returned, got "
                        f"{type(state).__name__}")
    if "step" not in state:
        raise KeyError(f"{owner}: sparsity state {sorted(state)} has no 'step'; pass what "
                       "state_dict() returned")
    _int(state, "step", None, owner)
    _int(state, "last_update_step", -1, owner)
    kind = type(algorithm).__name__.lower()
    if "algorithm" in state and state["algorithm"] != kind:
        raise ValueError(f"{owner}: the checkpoint holds {state['algorithm']!r} state, not "
                         f"{kind!r}; resume with the algorithm that wrote it")
    # A state without parameters comes from a removed (densified) algorithm: VariableSPDF.
    if state.get("removed") and state.get("masks"):
        raise ValueError(f"{owner}: the sparsity state of a removed algorithm holds masks; the "
                         "checkpoint is corrupt")
    if state.get("params") and algorithm.sparse_params:
        ours = {name: list(sp.mask.shape) for name, sp in algorithm.sparse_params.items()}
        theirs = {name: list(shape) for name, shape in state["params"].items()}
        if ours != theirs:
            diff = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
            raise ValueError(f"{owner}: the checkpoint sparsifies other parameters or shapes "
                             f"(differing: {diff[:3]}); resume with the same model and "
                             "param_filter")
    if "config" in state:
        mine = algorithm.config()
        diff = {k: (state["config"].get(k), mine.get(k)) for k in set(mine) | set(state["config"])
                if state["config"].get(k) != mine.get(k)}
        if diff:
            key, (was, now) = sorted(diff.items())[0]
            raise ValueError(f"{owner}: the checkpoint was made with {key}={was}, this object "
                             f"has {key}={now} ({len(diff)} setting(s) differ); construct the "
                             "algorithm with the checkpoint's settings to resume it")
    seed = state.get("seed", algorithm.seed)
    if algorithm.seed_given and seed is not None and seed != algorithm.seed:
        raise ValueError(f"{owner}: the checkpoint was made with seed={seed}, this object has "
                         f"seed={algorithm.seed}; pass seed={seed} (or seed=None) to resume it")
    ever = state.get("ever_active", {})
    if not isinstance(ever, Mapping):
        raise ValueError(f"{owner}: sparsity state ever_active must be a dict of bool masks")
    for name, mask in ever.items():
        if name in algorithm.ever_active and (
            not torch.is_tensor(mask) or mask.shape != algorithm.ever_active[name].shape
        ):
            shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
            raise ValueError(f"{owner}: ever_active[{name!r}] has shape {shape}, "
                             f"the parameter {tuple(algorithm.ever_active[name].shape)}")
    mask_targets(algorithm, state)
    saved_masks(algorithm, state)


def saved_masks(algorithm: SparsityAlgorithm, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state's masks unpacked (bool, full shape, CPU): ``{}`` for an earlier version's state
    (its masks came with the model state dict).

    Raises:
        ValueError: ``"masks"`` is not a dict of packed masks for exactly the state's parameters
            (and, once applied, the algorithm's), or one is corrupt (`unpack_bits`).
    """
    masks = state.get("masks")
    if masks is None:
        return {}
    owner = algorithm.name
    shapes = state.get("params")
    if not isinstance(masks, Mapping) or not isinstance(shapes, Mapping):
        raise ValueError(f"{owner}: sparsity state 'masks' and 'params' must be dicts keyed by "
                         "parameter name; pass what state_dict() returned")
    if set(masks) != set(shapes):
        differ = sorted(set(masks) ^ set(shapes))
        raise ValueError(f"{owner}: sparsity state has masks for other parameters than its "
                         f"'params' (differing: {differ[:3]}); the checkpoint is corrupt")
    out = {}
    for name, packed in masks.items():
        try:
            out[name] = unpack_bits(packed, shapes[name])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{owner}: sparsity state masks[{name!r}]: {err}; the checkpoint "
                             "is corrupt, resume from another one") from None
    return out


def mask_targets(algorithm: SparsityAlgorithm, state: Mapping[str, Any]) -> dict[str, float]:
    """The targets the checkpoint's masks were built for (raises on a malformed entry)."""
    last = state.get("last_update_step", -1)
    if last >= 0:
        return {name: algorithm.target_sparsity(name, last) for name in algorithm.sparse_params}
    saved = state.get("mask_targets", {})
    if not isinstance(saved, Mapping):
        raise ValueError(f"{algorithm.name}: sparsity state mask_targets must be a dict")
    try:
        return {name: float(saved[name]) for name in algorithm.sparse_params if name in saved}
    except (TypeError, ValueError) as err:
        raise ValueError(f"{algorithm.name}: sparsity state mask_targets must map names to "
                         f"floats ({err})") from None


def restore_algorithm_state(algorithm: SparsityAlgorithm, state: Mapping[str, Any]) -> None:
    """Restore a ``state`` that `check_algorithm_state` accepted: counters and seed; the masks
    in place (all ones for the state of a removed algorithm, VariableSPDF's dense stage: it
    prunes nothing), the weights a model load zeroed put back, then pruned; gradients and
    optimizer state pruned before the next step."""
    targets = mask_targets(algorithm, state)
    masks = saved_masks(algorithm, state)
    removed = bool(state.get("removed"))
    algorithm.step = state["step"]
    algorithm.last_update_step = state.get("last_update_step", -1)
    algorithm.seed = state.get("seed", algorithm.seed)
    for name, mask in state.get("ever_active", {}).items():
        if name in algorithm.ever_active:
            algorithm.ever_active[name].copy_(mask)
    unpruned, algorithm.hooks.unpruned = algorithm.hooks.unpruned, {}
    with torch.no_grad():
        for name, sp in algorithm.sparse_params.items():
            if name not in masks and not removed:
                continue  # an earlier version's state: the masks came with the model
            if name in unpruned:  # values a model load just zeroed that these masks may keep
                unpruned[name].put_back_(sp.param, local(sp.param))
            if removed:
                sp.mask.fill_(True)
            else:
                sp.mask.copy_(shard_like(masks[name].to(sp.mask.device), sp.mask))
            sp.prune_()
    algorithm.mask_targets.update(targets)
    algorithm.hooks.changed()
