"""Config errors at the edges name the file, the key path, the bad value and the fix.

Each case is checked in memory and, where it can come from a file, in a YAML file: a bare
sparsity config, a 2.0/2.1 params file (``sparsity:``) or a 2.2+ one (``trainer.init.sparsity``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lightning_sparse import configure
from lightning_sparse.core.configure import load_sparsity_block
from lightning_sparse.core.filters import glob_filter, regex_filter


def write(tmp_path: Path, text: str, name: str = "sparsity.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def in_params_file(tmp_path: Path, block: object, layout: str) -> tuple[Path, str]:
    """``block`` saved as the sparsity section of a params file; returns the file and its key."""
    if layout == "2.1":
        data, key = {"model": {"d_model": 8}, "sparsity": block}, "sparsity"
    else:
        data, key = {"trainer": {"init": {"sparsity": block}}}, "trainer.init.sparsity"
    return write(tmp_path, yaml.safe_dump(data), f"params_{layout}.yaml"), key


def message_of(config: object, error: type[Exception] = ValueError) -> str:
    with pytest.raises(error) as info:
        configure(config)
    return str(info.value)


def assert_names(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} missing from: {message}"


# ---------------------------------------------------------------- 1. legacy regexes, globs

BAD_REGEXES = [
    ("*.weight", "nothing to repeat"),
    ("fc1.(weight", "missing )"),
    ("layers.[0-1.weight", "unterminated character set"),
]
REGEX_FIX = ("Python regex", "'.*' not '*'", "param_filter")


@pytest.mark.parametrize(("pattern", "why"), BAD_REGEXES)
def test_regex_filter_names_the_pattern_the_error_and_the_fix(pattern: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        regex_filter(["fc2", pattern])
    assert_names(str(info.value), repr(pattern), why, *REGEX_FIX)
    assert not isinstance(info.value, re.error)


@pytest.mark.parametrize(("pattern", "why"), BAD_REGEXES)
@pytest.mark.parametrize(
    ("config", "key"),
    [
        (
            lambda p: {"type": "rigl", "sparsity": 0.5, "param_name_patterns": p},
            "param_name_patterns",
        ),
        (
            lambda p: {"type": "set", "sparsity": 0.5, "param_name_patterns": ["fc2", p]},
            "param_name_patterns",
        ),
        (
            lambda p: {
                "type": "gmp",
                "param_name_patterns": {p: {"sparsity_schedule": [[0, 0.5]]}},
            },
            "param_name_patterns[",
        ),
        (
            lambda p: [
                {"sparsity": 0.3, "param_filter": "x*"},
                {"type": "static", "sparsity": 0.5, "param_name_patterns": p},
            ],
            "[1].param_name_patterns",
        ),
    ],
    ids=["string", "list", "per-pattern-dict", "second-entry"],
)
def test_bad_legacy_regex_in_config(
    tmp_path: Path, config: object, key: str, pattern: str, why: str
) -> None:
    built = config(pattern)  # type: ignore[operator]
    assert_names(message_of(built), repr(pattern), why, key, *REGEX_FIX)
    path = write(tmp_path, yaml.safe_dump(built))
    assert_names(message_of(path), str(path), repr(pattern), why, key, *REGEX_FIX)


@pytest.mark.parametrize("layout", ["2.1", "2.10"])
def test_bad_legacy_regex_in_a_params_file_names_file_and_key(tmp_path: Path, layout: str) -> None:
    block = {"type": "rigl", "sparsity": 0.75, "schedule": 100, "param_name_patterns": "*.weight"}
    path, root = in_params_file(tmp_path, block, layout)
    assert_names(
        message_of(path), str(path), f"{root}.param_name_patterns", "'*.weight'", *REGEX_FIX
    )


def test_non_string_glob_names_key_and_entry(tmp_path: Path) -> None:
    with pytest.raises(TypeError) as info:
        glob_filter(["fc1.weight", 3])  # type: ignore[list-item]
    assert_names(str(info.value), "param_filter", "3", "string", "'fc*.weight'")
    path = write(tmp_path, "sparsity: 0.5\nparam_filter: [fc1.weight, 3]\n")
    assert_names(message_of(path, TypeError), str(path), "param_filter", "3", "glob")


# ---------------------------------------------------------------- 2. YAML syntax errors

YAML_ERRORS = [
    # (text, line, column, words of the YAML problem)
    ("algorithm: set\nsparsity: 0.5\nupdate: freq: 10\n", 3, 13, "mapping values"),
    ("sparsity:\n  type: rigl\n  sparsity: [0.5\n  schedule: 100\n", 4, 11, "expected ',' or ']'"),
    ("trainer:\n  init:\n\tsparsity: 0.5\n", 3, 1, "'\\t'"),
]


@pytest.mark.parametrize(("text", "line", "column", "problem"), YAML_ERRORS)
@pytest.mark.parametrize("load", [configure, load_sparsity_block])
def test_yaml_syntax_error_names_file_line_and_column(
    tmp_path: Path, load: object, text: str, line: int, column: int, problem: str
) -> None:
    path = write(tmp_path, text, "params.yaml")
    with pytest.raises(ValueError) as info:
        load(path)  # type: ignore[operator]
    message = str(info.value)
    assert_names(message, str(path), f"line {line}, column {column}", problem, "fix the YAML")
    assert "<unicode string>" not in message


def test_yaml_syntax_error_line_is_yaml_s_own(tmp_path: Path) -> None:
    """The reported position is PyYAML's mark, 1-based, as editors count."""
    text = YAML_ERRORS[0][0]
    with pytest.raises(yaml.MarkedYAMLError) as info:
        yaml.safe_load(text)
    mark = info.value.problem_mark
    path = write(tmp_path, text)
    assert f"line {mark.line + 1}, column {mark.column + 1}" in message_of(path)


def test_file_that_is_not_text_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"PK\x03\x04\xff\xfe\x00binary")
    assert_names(message_of(path), str(path), "not UTF-8", "YAML file")


def test_directory_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError) as info:
        configure(tmp_path)
    assert_names(str(info.value), str(tmp_path), "directory", "YAML file inside")


# ---------------------------------------------------------------- 3. a file holding a bare word

CONFIG_FORMS = (
    "a float",
    "'algorithm' and 'sparsity'",
    "a list",
    "'sparsity:'",
    "trainer.init.sparsity",
)


@pytest.mark.parametrize("load", [configure, load_sparsity_block])
def test_file_holding_a_bare_word(tmp_path: Path, load: object) -> None:
    path = write(tmp_path, "rigl\n")
    with pytest.raises(TypeError) as info:
        load(path)  # type: ignore[operator]
    message = str(info.value)
    assert_names(message, str(path), "holds", "'rigl'", "algorithm: rigl", *CONFIG_FORMS)
    assert "'r'" not in message


@pytest.mark.parametrize(
    ("block", "shown", "hint"),
    [
        ("magic", "'magic'", "not a sparsity config"),
        ("0.8", "'0.8'", "0.8 unquoted"),
        (True, "True", "not a sparsity config"),
    ],
)
@pytest.mark.parametrize("layout", ["2.1", "2.10"])
def test_params_file_whose_sparsity_is_not_a_config(
    tmp_path: Path, layout: str, block: object, shown: str, hint: str
) -> None:
    path, root = in_params_file(tmp_path, block, layout)
    assert_names(message_of(path, TypeError), str(path), f"at {root}", shown, hint, *CONFIG_FORMS)


def test_algorithm_name_passed_as_a_path() -> None:
    """A string is a file path; an algorithm name there gets the dict to write instead."""
    with pytest.raises(FileNotFoundError) as info:
        configure("rigl")
    assert_names(str(info.value), "'rigl'", "does not exist", "file path", "'algorithm': 'rigl'")


# ---------------------------------------------------------------- 4. wrongly typed keys

TYPE_ERRORS = [
    # (config, key path under the root, the bad value as shown, words of the expected form)
    ({"groups": 5}, "groups", "groups=5", "list of mappings"),
    ({"groups": "rigl"}, "groups", "groups='rigl'", "list of mappings"),
    (
        {"groups": [{"algorithm": "set", "params": {"sparsity": 0.5}}, "fc1"]},
        "groups[1]",
        "'fc1'",
        "mapping with 'algorithm' and 'params'",
    ),
    (
        {"groups": [{"algorithm": "set", "params": 3}]},
        "groups[0].params",
        "params=3",
        "mapping of the algorithm's options",
    ),
    ({"algorithm": "set", "params": [0.5]}, "params", "params=[0.5]", "mapping"),
    (
        {"sparsity": 0.5, "param_name_patterns": 5},
        "param_name_patterns",
        "param_name_patterns=5",
        "a regex, a list of regexes",
    ),
    (
        {"type": "set", "sparsity": 0.5, "param_name_patterns": {"fc1": 0.9}},
        "param_name_patterns['fc1']",
        "got 0.9",
        "mapping of overrides",
    ),
    ({"sparsity": 0.5, "param_filter": 3}, "param_filter", "param_filter=3", "glob string"),
    (
        {"groups": [{"algorithm": "set", "params": {"sparsity": 0.5, "update": "often"}}]},
        "groups[0].update",
        "'often'",
        "{'freq': n",
    ),
    (
        {"algorithm": "rigl", "sparsity": 0.5, "update": {"freq": "daily"}},
        "update",
        "'daily'",
        "whole number of steps",
    ),
    (
        {"type": "set", "sparsity": 0.5, "schedule": "often"},
        "schedule",
        "'often'",
        "an int n (every n steps)",
    ),
    (
        {"algorithm": "set", "sparsity": 0.5, "update": {"freq": 5}, "drop_fraction": "high"},
        "drop_fraction",
        "'high'",
        "a number",
    ),
    (
        {"algorithm": "set", "sparsity": 0.5, "balance_out_groups": "x"},
        "balance_out_groups",
        "'x'",
        "positive int",
    ),
    (
        {"type": "gmp", "sparsity_schedule": 0.5},
        "sparsity_schedule",
        "0.5",
        "[step, sparsity] pairs",
    ),
    ({"algorithm": "magic", "sparsity": 0.5}, "algorithm", "'magic'", "valid algorithms"),
]


def located(root: str, key: str) -> str:
    return f"{root}{key}" if key.startswith("[") else f"{root}.{key}" if root else key


@pytest.mark.parametrize(("config", "key", "value", "expected"), TYPE_ERRORS)
def test_wrong_type_names_key_value_and_form(
    config: dict, key: str, value: str, expected: str
) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        configure(config)
    assert_names(str(info.value), f"at {key}", value, expected)
    with pytest.raises(type(info.value)) as in_list:
        configure([{"sparsity": 0.2, "param_filter": "x*"}, config])
    assert_names(str(in_list.value), f"at {located('[1]', key)}", value, expected)


@pytest.mark.parametrize(("config", "key", "value", "expected"), TYPE_ERRORS)
@pytest.mark.parametrize("layout", ["bare", "2.1", "2.10"])
def test_wrong_type_in_a_file_names_the_file_too(
    tmp_path: Path, layout: str, config: dict, key: str, value: str, expected: str
) -> None:
    if layout == "bare":
        path, root = write(tmp_path, yaml.safe_dump(config)), ""
    else:
        path, root = in_params_file(tmp_path, config, layout)
    with pytest.raises((TypeError, ValueError)) as info:
        configure(path)
    assert_names(str(info.value), f"in {str(path)!r}", f"at {located(root, key)}", value, expected)


def test_key_path_inside_a_modelzoo_params_file(tmp_path: Path) -> None:
    """The example of the issue, word for word."""
    path = write(
        tmp_path,
        (
            "model: {d_model: 8}\n"
            "sparsity:\n"
            "  groups:\n"
            "    - algorithm: set\n"
            "      params: {sparsity: 0.5, update: often}\n"
        ),
    )
    message = message_of(path)
    assert message.startswith(f"in {str(path)!r}, at sparsity.groups[0].update: "), message
    assert_names(message, "'often'", "every n steps")


def test_in_memory_top_level_messages_are_unchanged() -> None:
    """Without a file or a nested key there is nothing to prefix."""
    message = message_of({"algorithm": "rigl", "sparsity": 0.5, "drop_fractoin": 0.3})
    assert message.startswith("sparsity algorithm 'rigl' does not take ['drop_fractoin']")
    assert message_of(1.2).startswith("sparsity=1.2")


def test_unknown_key_in_a_file_names_the_file_and_the_entry(tmp_path: Path) -> None:
    path = write(tmp_path, "- {sparsity: 0.3, param_filter: 'fc1.*'}\n- {sparsity: 0.5, drop: 1}\n")
    assert_names(message_of(path), f"in {str(path)!r}, at [1]:", "['drop']", "accepts")


def test_mixed_key_types_are_listed_not_crashed() -> None:
    """YAML allows int keys; the unknown-key message lists them next to the string ones."""
    assert_names(message_of({"sparsity": 0.5, 1: 2, "x": 3}), "[1, 'x']", "accepts")
