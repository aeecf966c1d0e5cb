"""`configure`: Cerebras-style sparsity configs (float, dict, list, YAML file) -> algorithm objects.

Accepts the 2.2+ keys (``algorithm``, ``sparsity`` / ``schedule``, ``update``, ``param_filter``,
``init_method``, ``drop_fraction``, ``balance_*_groups``, ...) and the legacy 2.0/2.1 keys
(``type``, ``param_name_patterns`` as a regex / list / dict of per-pattern overrides, ``schedule``
as the update cadence, ``sparsity_schedule: [[step, s], ...]``). This module is the config
boundary: classes take flat typed arguments and never see config dicts.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .algorithms.base import SparsityAlgorithm
from .algorithms.group import Group
from .algorithms.registry import algorithm_class, available_algorithms
from .filters import ParamFilter, make_param_filter, regex_filter
from .shapers import InputGroups, OutputGroups

__all__ = ["algorithm_class", "available_algorithms", "configure", "load_sparsity_block"]
# (algorithm_class / available_algorithms live in algorithms.registry; re-exported here.)

_LEGACY_KEYS = {"type", "param_name_patterns", "sparsity_schedule"}
_IGNORED_KEYS = {
    "add_summaries": "log with the Lightning logger instead",
    "dump_masks": "masks are saved as <param>_mask in every checkpoint",
    "tiebreak": "ties are always broken deterministically",
}
_BOUNDARY_KEYS = {"algorithm", "param_filter", "balance_in_groups", "balance_out_groups"}
_PARAMS_FILE_KEYS = {"trainer", "model", "train_input", "eval_input", "optimizer", "runconfig"}

ConfigType = float | Mapping[str, Any] | Sequence[Mapping[str, Any]] | str | os.PathLike | None


def load_sparsity_block(path: str | os.PathLike) -> Any:
    """The sparsity block of a YAML file: a ModelZoo params file or a bare sparsity config.

    ModelZoo 2.2+ files keep it under ``trainer.init.sparsity``, 2.0/2.1 files at top-level
    ``sparsity``; a params file without one means dense training (returns ``None``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sparsity config {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text())
    if isinstance(data, Mapping) and _PARAMS_FILE_KEYS & set(data):
        init = (
            (data.get("trainer") or {}).get("init")
            if isinstance(data.get("trainer"), Mapping)
            else None
        )
        if isinstance(init, Mapping) and "sparsity" in init:
            return init["sparsity"]
        return data.get("sparsity")
    if isinstance(data, Mapping) and set(data) == {"sparsity"} and not _is_number(data["sparsity"]):
        return data["sparsity"]  # a params file's sparsity section saved on its own
    return data


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def configure(
    config: ConfigType,
    group_class: type[Group] = Group,
    resolve: Callable[[type], type] = lambda cls: cls,
) -> Group | None:
    """Build sparsity from a float, dict, list of dicts or YAML path; ``None`` means dense.

    Args:
        config: the configuration.
        group_class: the class of the returned group (the Lightning layer passes its callback).
        resolve: maps a registered algorithm class to the class to build (likewise).

    Returns:
        A ``Group`` with one member per config entry (first matching filter wins), or ``None``
        when the config asks for no sparsity.

    Raises:
        ValueError / TypeError: naming the bad key or value and the fix, before anything is built.
    """
    if isinstance(config, str | os.PathLike):
        config = load_sparsity_block(config)
    if config is None:
        return None
    if isinstance(config, bool) or not isinstance(config, int | float | Mapping | Sequence):
        raise TypeError(
            f"sparsity config {config!r} is not supported: use a float such as 0.8, a dict with "
            "'algorithm' and 'sparsity', a list of such dicts, or a YAML file path"
        )
    if isinstance(config, int | float):
        config = {"sparsity": config}
    entries = [config] if isinstance(config, Mapping) else list(config)
    specs = [spec for entry in entries for spec in _expand(entry)]
    built = [_build(spec, resolve) for spec in specs]  # every entry validated before any is used
    group = group_class()
    for param_filter, algorithm in built:
        if algorithm is not None:
            group.add(param_filter, algorithm)
    return group if len(group) else None


def _expand(entry: Any) -> list[dict[str, Any]]:
    """Flatten ModelZoo ``{"groups": [...], "params": {...}}`` nesting and 2.0 pattern dicts."""
    if isinstance(entry, int | float) and not isinstance(entry, bool):
        return [{"sparsity": entry}]
    if not isinstance(entry, Mapping):
        raise TypeError(f"each sparsity config entry must be a dict or a float, got {entry!r}")
    entry = dict(entry)
    if "params" in entry and isinstance(entry["params"], Mapping):
        entry = {**{k: v for k, v in entry.items() if k != "params"}, **entry["params"]}
    if "groups" in entry:
        shared = {k: v for k, v in entry.items() if k != "groups"}
        groups = entry["groups"]
        groups = [groups] if isinstance(groups, Mapping) else groups
        return [spec for group in groups for spec in _expand({**shared, **group})]
    patterns = entry.get("param_name_patterns")
    if isinstance(patterns, Mapping):
        return [
            {
                **{k: v for k, v in entry.items() if k != "param_name_patterns"},
                **(overrides or {}),
                "param_name_patterns": pattern,
            }
            for pattern, overrides in patterns.items()
        ]
    return [entry]


def _build(
    spec: dict[str, Any], resolve: Callable[[type], type]
) -> tuple[ParamFilter | None, SparsityAlgorithm | None]:
    spec = dict(spec)
    legacy = bool(_LEGACY_KEYS & set(spec))
    cls = resolve(algorithm_class(_pop_algorithm_name(spec)))
    renamed: dict[str, str] = {}
    if "sparsity_schedule" in spec:
        if "schedule" in spec or "update" in spec:
            raise ValueError(
                "sparsity_schedule: [[step, sparsity], ...] sets its own update steps; remove "
                "'schedule' / 'update' from this entry"
            )
        spec["sparsity"], spec["update"] = _unzip_sparsity_schedule(spec.pop("sparsity_schedule"))
    if "schedule" in spec:
        if legacy:
            spec["update"] = spec.pop("schedule")  # 2.0/2.1: 'schedule' is the update cadence
            renamed["update"] = "schedule"
        elif "sparsity" in spec:
            raise ValueError(
                "sparsity config gives both 'sparsity' and 'schedule', which are aliases in "
                "Cerebras 2.2+; keep one of them"
            )
        else:
            spec["sparsity"] = spec.pop("schedule")
    if "sparsity" not in spec:
        raise ValueError(
            f"sparsity config {spec} has no 'sparsity' (or 'schedule') key; add one, e.g. "
            "sparsity: 0.8, or sparsity: null for dense training"
        )
    if spec["sparsity"] is None:
        return None, None
    param_filter = _pop_filter(spec)
    for key, why in _IGNORED_KEYS.items():
        if key in spec:
            spec.pop(key)
            warnings.warn(f"sparsity key {key!r} is ignored: {why}", stacklevel=4)
    _balance_to_shaper(spec)
    _check_kwargs(cls, spec, renamed)
    return param_filter, cls(**spec)


def _balance_to_shaper(spec: dict[str, Any]) -> None:
    """Cerebras' ``balance_in_groups`` / ``balance_out_groups`` as ``shaper`` (in place)."""
    given = {k: spec.pop(k) for k in ("balance_in_groups", "balance_out_groups") if k in spec}
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise ValueError(
            f"balance_in_groups={given['balance_in_groups']} and balance_out_groups="
            f"{given['balance_out_groups']} are mutually exclusive; set one of them"
        )
    if given and "shaper" in spec:
        raise ValueError(f"give either {next(iter(given))} or shaper, not both")
    if "balance_in_groups" in given:
        spec["shaper"] = InputGroups(given["balance_in_groups"])
    elif "balance_out_groups" in given:
        spec["shaper"] = OutputGroups(given["balance_out_groups"])


def _pop_algorithm_name(spec: dict[str, Any]) -> str:
    algorithm, legacy_type = spec.pop("algorithm", None), spec.pop("type", None)
    if algorithm and legacy_type and str(algorithm).lower() != str(legacy_type).lower():
        raise ValueError(
            f"sparsity config names algorithm={algorithm!r} and the legacy type={legacy_type!r}; "
            "keep only 'algorithm'"
        )
    if str(legacy_type).lower() == "sideband":
        raise ValueError(
            "type: sideband is the Cerebras 1.x NaN-in-weights format; use algorithm: static, and "
            "convert 1.x checkpoints with lightning_sparse.convert_nan_checkpoint"
        )
    return str(algorithm or legacy_type or "static")


def _unzip_sparsity_schedule(pairs: Any) -> tuple[list[float], dict[str, list[int]]]:
    try:
        steps, levels = zip(*[(int(step), float(level)) for step, level in pairs], strict=True)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"sparsity_schedule={pairs!r} must be a list of [step, sparsity] pairs, e.g. "
            "[[0, 0.1], [6, 0.3], [8, 0.5]]"
        ) from err
    return list(levels), {"steps": list(steps)}


def _pop_filter(spec: dict[str, Any]) -> ParamFilter | None:
    glob_spec, regex_spec = spec.pop("param_filter", None), spec.pop("param_name_patterns", None)
    if glob_spec is not None and regex_spec is not None:
        raise ValueError(
            "give either param_filter (globs) or param_name_patterns (regexes), not both"
        )
    if regex_spec is not None:
        if isinstance(regex_spec, str) or (
            isinstance(regex_spec, Sequence) and all(isinstance(p, str) for p in regex_spec)
        ):
            return regex_filter(regex_spec)
        raise TypeError(
            f"param_name_patterns={regex_spec!r} must be a regex, a list of regexes or a dict "
            "{regex: overrides}"
        )
    return make_param_filter(glob_spec)


def _accepted_kwargs(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in klass.__dict__ or klass is object:
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
            break
    names.discard("self")
    return names


def _check_kwargs(cls: type, spec: dict[str, Any], renamed: dict[str, str]) -> None:
    accepted = _accepted_kwargs(cls)
    accepted -= {"register"}
    unknown = sorted(renamed.get(key, key) for key in set(spec) - accepted)
    if unknown:
        raise ValueError(
            f"sparsity algorithm {cls.__name__.lower()!r} does not take {unknown}; it accepts: "
            f"{', '.join(sorted(accepted | _BOUNDARY_KEYS))}"
        )
