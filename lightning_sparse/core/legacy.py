"""Compatibility with earlier versions of this package: every shim, and the version it goes in.

`SHIMS` lists each shim: what it keeps working, where it is used, and the release that removes
it (the package is 0.1.0). ``tests/core/test_legacy.py`` holds the same list and fails on a shim
that is not registered here (a module that speaks of "an earlier version" without one). The
code of the shims is here, except the aliases: an alias must live where it is imported from, so
its sites are listed.

This module sits low in the core (it imports no algorithm), so the readers of saved state, the
per-step path (through the hook `SparsityAlgorithm` gives it) and the layers above can all call
it. Nothing here is for new code.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .applied import mask_paths, owned_masks
from .sparse_parameter import as_mask, mask_buffer_name

__all__ = [
    "SHIMS",
    "Shim",
    "adopt_mask_entries",
    "callbacks_layout_state",
    "earlier_callback_states",
    "earlier_ever_active",
    "earlier_targets",
    "hf_bool_mask_shapes",
    "mask_keys",
    "named_rule",
    "summary_totals",
    "take_mask_entries",
]


@dataclass(frozen=True)
class Shim:
    """One compatibility shim.

    Attributes:
        name: its key in `SHIMS`.
        keeps: what it keeps working.
        sites: where its code or alias is, ``"module:qualified name"`` with the module named
            from the package (``"lightning.callback:find_sparsity_state"``: the package's
            ``lightning/callback.py``): names for whoever removes the shim, not imports (the
            core imports nothing above it).
        removed_in: the release that removes it.
    """

    name: str
    keeps: str
    sites: tuple[str, ...]
    removed_in: str


_CORE = "core"
SHIMS: dict[str, Shim] = {
    s.name: s
    for s in (
        Shim(
            "mask_entries",
            "model state dicts with <param>_mask entries (the masks' layout before they left "
            "the model state dict for the algorithm's state)",
            (
                f"{_CORE}.legacy:mask_keys",
                f"{_CORE}.legacy:take_mask_entries",
                f"{_CORE}.legacy:adopt_mask_entries",
                f"{_CORE}.mask_state:MaskState",
                f"{_CORE}.per_step:StepHooks.before_model_load",
                f"{_CORE}.state_dict:checkpoint_masks",
                f"{_CORE}.state_dict:strip_masks",
                f"{_CORE}.state_dict:restore_masks",
                "lightning.load_weights:drop_mask_entries",
                "lightning.loading:restore_checkpoint_masks",
                "models.lit_lm:LitCausalLM.on_load_checkpoint",
            ),
            "0.3.0",
        ),
        Shim(
            "state_without_packed_masks",
            "algorithm states without packed masks (the masks came with the model), with "
            "mask_targets instead of last_update_step, or full-size ever-active masks",
            (
                f"{_CORE}.legacy:earlier_targets",
                f"{_CORE}.legacy:earlier_ever_active",
                f"{_CORE}.saved_state:saved_masks",
                f"{_CORE}.saved_state:restore_masks_",
            ),
            "0.3.0",
        ),
        Shim(
            "callbacks_layout",
            "Lightning checkpoints holding the sparsity state under checkpoint['callbacks']",
            (
                f"{_CORE}.legacy:callbacks_layout_state",
                f"{_CORE}.legacy:earlier_callback_states",
                "lightning.callback:check_resumable",
                "lightning.callback:find_sparsity_state",
            ),
            "0.3.0",
        ),
        Shim(
            "summary_totals",
            "run summaries and FLOP counters saved with totals only, or segments only",
            (
                f"{_CORE}.legacy:summary_totals",
                "lightning.summary:SparseRunSummary.load_state_dict",
                f"{_CORE}.flop_account:FlopLedger.load_state_dict",
                "lightning.flop_meter:FlopMeter.load_state_dict",
            ),
            "0.3.0",
        ),
        Shim(
            "hf_bool_masks",
            "the transformers Trainer callback's state files with a bool 'masks' dict",
            (
                f"{_CORE}.legacy:hf_bool_mask_shapes",
                "integrations.hf:SparsityTrainerCallback",
            ),
            "0.3.0",
        ),
        Shim(
            "checkpoint_temporaries",
            "the temporaries an interrupted AtomicCheckpointIO left under earlier names "
            "(.<name>.ckpt.<random>.tmp), removed with the current ones",
            ("lightning.checkpointing:remove_stale_temporaries",),
            "0.3.0",
        ),
        Shim(
            "rule_without_name",
            "update_mask(p, mask, sparsity) and grow_score(p) of user algorithms written before "
            "the rule got the parameter's name (warns when the class is defined)",
            (f"{_CORE}.legacy:named_rule", f"{_CORE}.algorithms.base:SparsityAlgorithm"),
            "0.3.0",
        ),
        Shim(
            "DynamicSparsityAlgorithm",
            "the earlier name of the one base class, SparsityAlgorithm (an alias)",
            (
                f"{_CORE}.algorithms.base:DynamicSparsityAlgorithm",
                f"{_CORE}.algorithms:DynamicSparsityAlgorithm",
                f"{_CORE}:DynamicSparsityAlgorithm",
                "lightning:DynamicSparsityAlgorithm",
            ),
            "0.3.0",
        ),
        Shim(
            "register_masks",
            "the device's earlier name of core.state_dict.restore_masks (an alias)",
            ("wse.executor:register_masks", "wse:register_masks"),
            "0.3.0",
        ),
        Shim(
            "cadences_in_schedules",
            "the update cadences imported from core.schedules, their home before core.cadences "
            "(re-exports)",
            (
                f"{_CORE}.schedules:FreqSchedule",
                f"{_CORE}.schedules:ListSchedule",
                f"{_CORE}.schedules:make_update_schedule",
            ),
            "0.3.0",
        ),
        Shim(
            "hf_torch_dtype",
            "HFCausalLM(torch_dtype=...), Hugging Face's earlier name of dtype (warns)",
            ("models.hf:HFCausalLM", "models.hf:_resolve_dtype"),
            "0.3.0",
        ),
    )
}


# ------------------------------------------------------------------ mask_entries
_SUFFIX = mask_buffer_name("")  # "_mask"
_ADOPTING: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models with `adopt_mask_entries`


def mask_keys(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """``{mask key: parameter key}`` for every ``<name>_mask`` entry whose ``<name>`` is present
    (the layout of earlier versions)."""
    return {
        key: key[: -len(_SUFFIX)]
        for key in state_dict
        if key.endswith(_SUFFIX) and key[: -len(_SUFFIX)] in state_dict
    }


def take_mask_entries(
    state_dict: dict[str, Any],
    prefix: str,
    root: nn.Module,
    sparse_params: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """An earlier version's ``*_mask`` entries for ``sparse_params``, checked and taken out of
    ``state_dict`` (a model's load pre-hook: torch passes it a copy), so strict loading passes;
    the per-step path makes them the masks after the load (`StepHooks.after_model_load`).

    Args:
        state_dict: the dict being loaded.
        prefix: the key prefix of ``root`` in it.
        root: the model the algorithm was applied to (its masks are found by module, so a wrapper
            that moved a layer, peft's ``base_layer``, still loads).
        sparse_params: the algorithm's ``{name: SparseParameter}``.

    Returns:
        ``{param name: bool mask}`` of the entries found (``{}`` for today's layout).

    Raises:
        ValueError: an entry of the wrong shape or not 0/1, or a mask for a parameter that no
            algorithm on ``root`` sparsifies; ``state_dict`` is then unchanged.
    """
    paths = mask_paths(root)  # where each mask is now
    fix = "the checkpoint was saved from a different model configuration"
    found = {}
    for name, sp in sparse_params.items():
        key = prefix + paths.get((id(sp.module), sp.mask_name), f"{name}_mask")
        if key in state_dict:
            found[name] = (key, as_mask(state_dict[key], key, name, sp.mask.shape, fix))
    claimed = {prefix + paths[k] for k in owned_masks(root) if k in paths}
    params = {prefix + n for n, _ in root.named_parameters()}
    foreign = [
        k
        for k in state_dict
        if k.startswith(prefix)
        and k.endswith(_SUFFIX)
        and k[: -len(_SUFFIX)] in params
        and k not in claimed
    ]
    if foreign:
        raise ValueError(
            f"checkpoint has masks for {foreign[:3]} which this sparsity configuration leaves "
            "dense; include those parameters in param_filter, or drop the keys to load them dense"
        )
    for key, _ in found.values():
        del state_dict[key]
    return {name: mask for name, (_, mask) in found.items()}


def adopt_mask_entries(model: nn.Module) -> None:
    """From now on ``model`` (which `state_dict.restore_masks` gave masks) takes the ``*_mask``
    entries of a state dict it loads as its masks (once per model)."""
    if model not in _ADOPTING:
        model.register_load_state_dict_pre_hook(_adopt_mask_entries)
        _ADOPTING.add(model)


def _adopt_mask_entries(root: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load pre-hook of a model `restore_masks` gave masks: ``*_mask`` entries for masks no
    algorithm owns are checked, all of them, then copied into the buffers and taken out of the
    dict being loaded (torch passes a copy), so strict loading passes."""
    owned = owned_masks()
    found = []
    for path, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            buffer = mask_buffer_name(attr)
            key = f"{prefix}{path}.{buffer}" if path else f"{prefix}{buffer}"
            if key not in state_dict or module._buffers.get(buffer) is None or param is None:
                continue
            if (id(module), buffer) in owned:
                continue  # the algorithm's own load pre-hook takes it
            fix = "the state dict is from another model"
            mask = as_mask(state_dict[key], key, key[: -len(_SUFFIX)], tuple(param.shape), fix)
            found.append((module, buffer, key, mask))
    with torch.no_grad():
        for module, buffer, key, mask in found:
            module._buffers[buffer].copy_(mask)
            del state_dict[key]


# ------------------------------------------------------------------ state_without_packed_masks
def earlier_targets(state: Mapping[str, Any], names: list[str], owner: str) -> dict[str, float]:
    """The targets an earlier version saved with its masks (``"mask_targets"``), for the
    ``names`` it has (raises on a malformed entry)."""
    saved = state.get("mask_targets", {})
    if not isinstance(saved, Mapping):
        raise ValueError(f"{owner}: sparsity state mask_targets must be a dict")
    try:
        return {name: float(saved[name]) for name in names if name in saved}
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{owner}: sparsity state mask_targets must map names to floats ({err})"
        ) from None


def earlier_ever_active(mask: object, shape: tuple[int, ...]) -> bool:
    """Whether ``mask`` is an ever-active mask as an earlier version saved it: the bool mask of
    ``shape`` itself, not packed bits."""
    return torch.is_tensor(mask) and tuple(mask.shape) == shape and mask.dtype == torch.bool


# ------------------------------------------------------------------ callbacks_layout
def callbacks_layout_state(checkpoint: Mapping[str, Any], key: str) -> Any:
    """The state an earlier version saved for callback ``key`` under
    ``checkpoint["callbacks"]`` (Lightning hands it to the callback's ``load_state_dict``
    itself), or None."""
    return (checkpoint.get("callbacks") or {}).get(key)


def earlier_callback_states(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """Every callback state of ``checkpoint["callbacks"]`` (the earlier layout), by key."""
    return checkpoint.get("callbacks") or {}


# ------------------------------------------------------------------ summary_totals
def summary_totals(state: Mapping[str, Any]) -> dict[str, Any]:
    """A FLOP meter's state from an earlier run summary's, which saved the totals only."""
    return {
        "counters": state["counters"],
        "last_dense_grad_step": state.get("last_dense_grad_step", -1),
    }


# ------------------------------------------------------------------ hf_bool_masks
def hf_bool_mask_shapes(saved: Mapping[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of the bool ``"masks"`` an earlier version of the transformers Trainer
    callback saved beside its state; None for today's files (the masks are in the state)."""
    if "masks" not in saved:
        return None
    return {name: tuple(mask.shape) for name, mask in saved["masks"].items()}


# ------------------------------------------------------------------ rule_without_name
# The rule methods and how many arguments they took before the parameter's name came first.
_RULES = {"update_mask": 3, "grow_score": 1}


def named_rule(cls: type, method: str) -> Callable[..., Any] | None:
    """``cls.<method>`` (``update_mask`` or ``grow_score``, defined in ``cls`` itself) wrapped
    to take the parameter's name first when it was written without it; None when it takes the
    name already (or ``cls`` does not define it). Warns (``DeprecationWarning``) once, at the
    class's definition."""
    fn = cls.__dict__.get(method)
    if fn is None or not callable(fn) or getattr(fn, "__isabstractmethod__", False):
        return None
    params = list(inspect.signature(fn).parameters.values())[1:]  # after self
    if not params or params[0].name == "name" or len(params) != _RULES[method]:
        return None
    warnings.warn(
        f"{cls.__qualname__}.{method}{inspect.signature(fn)} takes no parameter name; the rule "
        f"is {method}(self, name, ...) now (the name first), and this form goes in "
        f"{SHIMS['rule_without_name'].removed_in}",
        DeprecationWarning,
        stacklevel=4,
    )

    @functools.wraps(fn)
    def with_name(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    return with_name
