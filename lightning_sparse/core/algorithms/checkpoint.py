"""Checkpoints: the algorithm's own state, and masks arriving with a model state dict.

An algorithm checkpoint holds the step (and the step of the last update), the seed, and what
identifies the run it came from (algorithm, parameters and shapes, hyper-parameters), so a
checkpoint of another algorithm or configuration is refused before anything changes. Masks are
``<param>_mask`` buffers in the model's state dict. Earlier versions' states (``step``,
``mask_targets``, schedule state) still load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .attach import algorithms_of

if TYPE_CHECKING:
    from .base import SparsityAlgorithm


def mask_paths(root: nn.Module) -> dict[tuple[int, str], str]:
    """``{(id(module), mask buffer name): state-dict key below root}`` for the masks' current
    place: a wrapper that moved a layer (peft's ``q_proj`` -> ``q_proj.base_layer``) moves its
    key, while the algorithm keeps the parameter names of ``apply``."""
    return {
        (id(module), buffer): f"{path}.{buffer}" if path else buffer
        for path, module in root.named_modules(remove_duplicate=False)
        for buffer in module._buffers
        if buffer.endswith("_mask")
    }


def check_incoming_masks(
    algorithm: SparsityAlgorithm,
    root: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *hook_args: Any,
) -> None:
    """Check (and complete) the ``*_mask`` entries of ``state_dict`` before ``root`` loads it.

    A checkpoint without a mask for one of ``algorithm``'s parameters (a dense checkpoint) gets
    the current mask, so strict loading succeeds and the post-load hook prunes the loaded
    weights. Raises ``ValueError``, before anything is loaded, for a mask of the wrong shape, a
    non-0/1 mask, or a mask for a parameter that no algorithm on ``root`` sparsifies.

    Args:
        algorithm: the algorithm whose masks are checked.
        root: the module the algorithm was applied to (``state_dict`` keys start at it).
        state_dict: the dict being loaded (torch passes a copy; it is completed in place).
        prefix: key prefix of ``root`` inside ``state_dict``.
        hook_args: the rest of ``nn.Module``'s load pre-hook arguments (unused).
    """
    paths = mask_paths(root)
    for name, sp in algorithm.sparse_params.items():
        key = f"{prefix}{paths.get((id(sp.module), sp.mask_name), f'{name}_mask')}"
        if key not in state_dict:
            state_dict[key] = sp.mask.clone()
            continue
        incoming = state_dict[key]
        if tuple(incoming.shape) != tuple(sp.mask.shape):
            raise ValueError(
                f"checkpoint mask {key!r} has shape {tuple(incoming.shape)} but parameter "
                f"{name!r} has shape {tuple(sp.mask.shape)}; the checkpoint was saved from a "
                "different model configuration"
            )
        if incoming.dtype != torch.bool:
            if not bool(((incoming == 0) | (incoming == 1)).all()):
                raise ValueError(f"checkpoint mask {key!r} must hold only 0/1 or bool values")
            state_dict[key] = incoming.to(torch.bool)
    claimed = {
        f"{prefix}{paths.get((id(sp.module), sp.mask_name), f'{name}_mask')}"
        for other in (algorithms_of(root) or [algorithm])
        for name, sp in other.sparse_params.items()
    }
    params = {f"{prefix}{n}" for n, _ in root.named_parameters()}
    foreign = [
        k
        for k in state_dict
        if k.startswith(prefix)
        and k.endswith("_mask")
        and k[: -len("_mask")] in params
        and k not in claimed
    ]
    if foreign:
        raise ValueError(
            f"checkpoint has masks for {foreign[:3]} which this sparsity configuration leaves "
            "dense; include those parameters in param_filter, or drop the keys to load them dense"
        )


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
    """What ``algorithm.state_dict()`` returns (plain Python values and bool tensors)."""
    state: dict[str, Any] = {
        "step": algorithm.step,
        "last_update_step": algorithm.last_update_step,
        "seed": algorithm.seed,
        "algorithm": type(algorithm).__name__.lower(),
        "params": {name: list(sp.mask.shape) for name, sp in algorithm.sparse_params.items()},
        "config": algorithm.config(),
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
            hyper-parameters, a different explicit seed, or a malformed state; nothing changed.
    """
    check_algorithm_state(algorithm, state)
    restore_algorithm_state(algorithm, state)


def check_algorithm_state(algorithm: SparsityAlgorithm, state: Any) -> None:
    """Raise (see `load_algorithm_state`) unless ``state`` can be restored into ``algorithm``;
    changes nothing, so a `Group` checks every member before any loads."""
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
    """Restore a ``state`` that `check_algorithm_state` accepted."""
    targets = mask_targets(algorithm, state)
    algorithm.step = state["step"]
    algorithm.last_update_step = state.get("last_update_step", -1)
    algorithm.seed = state.get("seed", algorithm.seed)
    for name, mask in state.get("ever_active", {}).items():
        if name in algorithm.ever_active:
            algorithm.ever_active[name].copy_(mask)
    algorithm.mask_targets.update(targets)
    algorithm.hooks.version += 1
