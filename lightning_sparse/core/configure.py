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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from . import validate
from .algorithms.base import SparsityAlgorithm
from .algorithms.group import Group
from .algorithms.registry import algorithm_class, available_algorithms
from .filters import ParamFilter, make_param_filter, regex_filter
from .schedules import make_hyperparam_schedule, make_update_schedule
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

    Raises:
        FileNotFoundError: no such file.
        ValueError / TypeError: the file is not YAML (naming its line and column) or its block is
            not a sparsity config (e.g. a bare word), naming the file and the key.
    """
    return _load(Path(path))[0]


def _load(path: Path) -> tuple[Any, str]:
    """The sparsity block of the YAML file ``path`` and its key path in the file."""
    if path.is_dir():
        raise IsADirectoryError(
            f"sparsity config {str(path)!r} is a directory; pass the YAML file inside it"
        )
    if not path.is_file():
        raise FileNotFoundError(f"sparsity config {str(path)!r} does not exist")
    data = _read_yaml(path)
    block, key = data, ""
    if isinstance(data, Mapping) and _PARAMS_FILE_KEYS & set(data):
        trainer = data.get("trainer")
        init = trainer.get("init") if isinstance(trainer, Mapping) else None
        if isinstance(init, Mapping) and "sparsity" in init:
            block, key = init["sparsity"], "trainer.init.sparsity"
        else:
            block, key = data.get("sparsity"), "sparsity"
    elif (
        isinstance(data, Mapping) and set(data) == {"sparsity"} and not _is_number(data["sparsity"])
    ):
        block, key = data["sparsity"], "sparsity"  # a params file's sparsity section on its own
    if block is not None and not _is_config(block):
        raise _not_a_config(block, path, key)
    return block, key


def _read_yaml(path: Path) -> Any:
    """Parse ``path``; a syntax error names the file, the line and the column."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"sparsity config file {str(path)!r} is not UTF-8 text (byte {err.start}: "
            f"{err.reason}); pass a YAML file"
        ) from err
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        context = err.context_mark
        while_ = (
            f" ({err.context} at line {context.line + 1}, column {context.column + 1})"
            if err.context and context and context is not mark
            else ""
        )
        snippet = mark.get_snippet() if mark else None
        shown = f":\n{snippet}\n" if snippet else "; "
        raise ValueError(
            f"sparsity config file {str(path)!r} is not valid YAML: {err.problem}{where}{while_}"
            f"{shown}fix the YAML syntax there (indentation, ': ' after each key, matching "
            "brackets and quotes)"
        ) from err
    except yaml.YAMLError as err:
        raise ValueError(f"sparsity config file {str(path)!r} is not valid YAML: {err}") from err


_CONFIG_FORMS = (
    "a sparsity config is a float such as 0.8, a mapping with 'algorithm' and 'sparsity' "
    "(e.g. {algorithm: rigl, sparsity: 0.8, update: {freq: 100}}), a list of such mappings, or "
    "a ModelZoo params file with a 'sparsity:' section (2.0/2.1) or 'trainer.init.sparsity' (2.2+)"
)


def _is_config(value: Any) -> bool:
    return (
        _is_number(value)
        or isinstance(value, Mapping)
        or (isinstance(value, Sequence) and not isinstance(value, str | bytes))
    )


def _not_a_config(value: Any, path: Path, key: str) -> TypeError:
    """The error for a file whose block is no config at all (a bare word, a bool, ...)."""
    what = {"str": "string", "bool": "boolean"}.get(type(value).__name__, type(value).__name__)
    at = f" at {key}" if key else ""
    holds = f"sparsity config file {str(path)!r} holds the {what} {value!r}{at}"
    hint = ""
    if isinstance(value, str) and value.lower() in available_algorithms():
        hint = f"; for the algorithm write 'algorithm: {value}' with a 'sparsity:' level"
    elif isinstance(value, str) and _parses_as_number(value):
        hint = f"; for a level write {value} unquoted"
    return TypeError(f"{holds}, not a sparsity config{hint}: {_CONFIG_FORMS}")


def _parses_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _where(path: Path | None, key: str) -> str:
    """Prefix naming where a config value came from: the file and the key path in it."""
    if path is not None:
        return f"in {str(path)!r}, at {key}: " if key else f"in {str(path)!r}: "
    return f"sparsity config at {key}: " if key else ""


def _sub(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


@contextmanager
def _at(path: Path | None, key: str) -> Iterator[None]:
    """Prefix ValueError / TypeError messages raised inside with where the value came from."""
    try:
        yield
    except (ValueError, TypeError) as err:
        prefix = _where(path, key)
        if not prefix:
            raise
        if type(err) in (ValueError, TypeError):
            raise type(err)(f"{prefix}{err}") from err
        if hasattr(err, "add_note"):  # Python 3.11+
            err.add_note(f"({prefix.rstrip(': ')})")
        raise


def _is_number(value: Any) -> bool:
    return validate.is_number(value)


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
        ValueError / TypeError: naming the bad key or value and the fix, before anything is built;
            for a YAML file also the file and the key path in it (``sparsity.groups[0].update``).
    """
    path: Path | None = None
    root = ""
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        if (
            isinstance(config, str)
            and not path.exists()
            and config.lower() in available_algorithms()
        ):
            raise FileNotFoundError(
                f"sparsity config {config!r} does not exist: a string is read as a YAML file path; "
                f"for the algorithm pass {{'algorithm': {config.lower()!r}, 'sparsity': 0.8}}"
            )
        config, root = _load(path)
    if config is None:
        return None
    if isinstance(config, bool) or not _is_config(config):
        if path is not None:
            raise _not_a_config(config, path, root)
        raise TypeError(
            f"sparsity config {config!r} is not supported: use a float such as 0.8, a dict with "
            "'algorithm' and 'sparsity', a list of such dicts, or a YAML file path"
        )
    if _is_number(config):
        config = {"sparsity": config}
    if not isinstance(config, Mapping | Sequence):  # _is_config said so: a number became a dict
        raise TypeError(f"sparsity config {config!r} is not supported")
    entries = (
        [(root, config)]
        if isinstance(config, Mapping)
        else [(f"{root}[{i}]", entry) for i, entry in enumerate(config)]
    )
    specs = [spec for key, entry in entries for spec in _expand(entry, path, key)]
    built = [_build(spec, resolve, path, key) for key, spec in specs]  # all validated first
    group = group_class()
    for param_filter, algorithm in built:
        if algorithm is not None:
            group.add(param_filter, algorithm)
    return group if len(group) else None


def _expand(entry: Any, path: Path | None, key: str) -> list[tuple[str, dict[str, Any]]]:
    """Flatten ModelZoo ``{"groups": [...], "params": {...}}`` nesting and 2.0 pattern dicts.

    Returns ``(key path, flat entry)`` pairs; a wrongly typed key raises, naming where it is.
    """
    if _is_number(entry):
        return [(key, {"sparsity": entry})]
    if not isinstance(entry, Mapping):
        raise TypeError(
            f"{_where(path, key)}each sparsity config entry must be a dict or a float, got "
            f"{entry!r}; e.g. {{algorithm: rigl, sparsity: 0.8}}"
        )
    entry = dict(entry)
    if "params" in entry:
        params = entry.pop("params")
        if params is not None and not isinstance(params, Mapping):
            raise TypeError(
                f"{_where(path, _sub(key, 'params'))}params={params!r} must be a mapping of the "
                "algorithm's options, e.g. params: {sparsity: 0.8, update: {freq: 100}}"
            )
        entry = {**entry, **(params or {})}
    if "groups" in entry:
        shared = {k: v for k, v in entry.items() if k != "groups"}
        groups, groups_key = entry["groups"], _sub(key, "groups")
        if isinstance(groups, Mapping):
            located = [(groups_key, groups)]
        elif isinstance(groups, Sequence) and not isinstance(groups, str | bytes):
            located = [(f"{groups_key}[{i}]", group) for i, group in enumerate(groups)]
        else:
            raise TypeError(
                f"{_where(path, groups_key)}groups={groups!r} must be a list of mappings, each "
                "with 'algorithm' and 'params' (or the options inline), e.g. groups: "
                "[{algorithm: rigl, params: {sparsity: 0.8}}], or one such mapping"
            )
        specs = []
        for group_key, group in located:
            if not isinstance(group, Mapping):
                raise TypeError(
                    f"{_where(path, group_key)}each entry of groups must be a mapping with "
                    f"'algorithm' and 'params', got {group!r}; e.g. "
                    "{algorithm: rigl, params: {sparsity: 0.8}}"
                )
            specs += _expand({**shared, **group}, path, group_key)
        return specs
    patterns = entry.get("param_name_patterns")
    if isinstance(patterns, Mapping):
        specs = []
        for pattern, overrides in patterns.items():
            pattern_key = f"{_sub(key, 'param_name_patterns')}[{pattern!r}]"
            if overrides is not None and not isinstance(overrides, Mapping):
                raise TypeError(
                    f"{_where(path, pattern_key)}the options for pattern {pattern!r} must be a "
                    f"mapping of overrides such as {{sparsity: 0.9}}, or null, got {overrides!r}"
                )
            shared = {k: v for k, v in entry.items() if k != "param_name_patterns"}
            specs.append(
                (pattern_key, {**shared, **(overrides or {}), "param_name_patterns": pattern})
            )
        return specs
    return [(key, entry)]


def _build(
    spec: dict[str, Any], resolve: Callable[[type], type], path: Path | None, key: str
) -> tuple[ParamFilter | None, SparsityAlgorithm | None]:
    """One algorithm from one flat entry; errors name ``path`` and the key path under ``key``."""
    spec = dict(spec)
    legacy = bool(_LEGACY_KEYS & set(spec))
    name_key = next((k for k in ("algorithm", "type") if k in spec), "")
    with _at(path, _sub(key, name_key) if name_key else key):
        cls = resolve(algorithm_class(_pop_algorithm_name(spec)))
    renamed: dict[str, str] = {}
    if "sparsity_schedule" in spec:
        if "schedule" in spec or "update" in spec:
            raise ValueError(
                f"{_where(path, key)}sparsity_schedule: [[step, sparsity], ...] sets its own "
                "update steps; remove 'schedule' / 'update' from this entry"
            )
        with _at(path, _sub(key, "sparsity_schedule")):
            pairs = _unzip_sparsity_schedule(spec.pop("sparsity_schedule"))
        spec["sparsity"], spec["update"] = pairs
    if "schedule" in spec:
        if legacy:
            spec["update"] = spec.pop("schedule")  # 2.0/2.1: 'schedule' is the update cadence
            renamed["update"] = "schedule"
        elif "sparsity" in spec:
            raise ValueError(
                f"{_where(path, key)}sparsity config gives both 'sparsity' and 'schedule', which "
                "are aliases in Cerebras 2.2+; keep one of them"
            )
        else:
            spec["sparsity"] = spec.pop("schedule")
    if "sparsity" not in spec:
        raise ValueError(
            f"{_where(path, key)}sparsity config {spec} has no 'sparsity' (or 'schedule') key; "
            "add one, e.g. sparsity: 0.8, or sparsity: null for dense training"
        )
    if spec["sparsity"] is None:
        return None, None
    filter_name = "param_name_patterns" if "param_name_patterns" in spec else "param_filter"
    in_pattern_dict = "param_name_patterns[" in key.rsplit(".", 1)[-1]
    with _at(path, key if in_pattern_dict else _sub(key, filter_name)):
        param_filter = _pop_filter(spec)
    for ignored, why in _IGNORED_KEYS.items():
        if ignored in spec:
            spec.pop(ignored)
            warnings.warn(
                f"{_where(path, key)}sparsity key {ignored!r} is ignored: {why}", stacklevel=4
            )
    balance = next((k for k in ("balance_in_groups", "balance_out_groups") if k in spec), "")
    with _at(path, _sub(key, balance) if balance else key):
        _balance_to_shaper(spec)
    with _at(path, key):
        _check_kwargs(cls, spec, renamed)
    try:
        algorithm = cls(**spec)
    except (ValueError, TypeError):
        with _at(path, _culprit(spec, renamed, key)):
            raise
    return param_filter, algorithm


def _culprit(spec: dict[str, Any], renamed: dict[str, str], key: str) -> str:
    """The key path of the first schedule-like value that cannot be built, else ``key``.

    Only called to place the error of a failed constructor: it never accepts or rejects anything.
    """
    for name, make in (
        ("update", make_update_schedule),
        ("drop_fraction", make_hyperparam_schedule),
    ):
        if name in spec:
            try:
                make(spec[name])
            except (ValueError, TypeError):
                return _sub(key, renamed.get(name, name))
    return key


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
        params = inspect.signature(klass.__dict__["__init__"]).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
            break
    names.discard("self")
    return names


def _check_kwargs(cls: type, spec: dict[str, Any], renamed: dict[str, str]) -> None:
    accepted = _accepted_kwargs(cls)
    accepted -= {"register"}
    unknown = sorted((renamed.get(key, key) for key in set(spec) - accepted), key=str)
    if unknown:
        raise ValueError(
            f"sparsity algorithm {cls.__name__.lower()!r} does not take {unknown}; it accepts: "
            f"{', '.join(sorted(accepted | _BOUNDARY_KEYS))}"
        )
