"""A LightningCLI parse error as one line with a suggestion (`shorten`).

jsonargparse reports a bad value under a ``Union`` (every ``class_path`` entry: callbacks, model,
data, logger) as a block that lists each subtype it tried and reprints the whole value, 15-20
lines with the cause in the middle. `shorten` finds the cause and says it in one line, with the
closest name where one exists (`difflib`):

- an argument a class does not take (``drop_fractoin``): its closest argument, and the command
  that lists them all (``--trainer.callbacks.help lightning_sparse.RigL``);
- a ``class_path`` that names no class (``lightning_sparse.Rigl``, ``lightning_sparse.modles.X``):
  the closest name in the module that exists, as a full class path;
- a value of the wrong type (``--model.init_args.dim abc``, ``--trainer.precision 17``): the key,
  the value and the accepted types or values;
- a key no parser takes (``trainer.max_step`` in a YAML file, ``--trainer.max_step`` on the
  command line): the closest key.

Anything else is left as jsonargparse says it. The functions here only read text and import the
modules a message names (jsonargparse has imported them already).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["class_arguments", "module_names", "shorten", "suggest"]

_PROBLEM = re.compile(r"^(\s*)- Problem with given class_path '([^']+)':\s*$")
_KEY = re.compile(r'^(\s*)Parser key "([^"]+)":\s*$')


def suggest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (ignoring case), or None when none is close."""
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def shorten(message: str, options: Iterable[str], usage: str) -> str:
    """One line for jsonargparse's ``message``; the message itself when its form is unknown.

    Args:
        message: what jsonargparse passes to ``ArgumentParser.error``.
        options: every key and option string the parser takes (``trainer.max_steps``,
            ``--trainer.max_steps``), for the closest one to an unknown key.
        usage: the subcommand's command line (``lightning-sparse fit``), for the help hint.
    """
    options = list(options)
    if found := re.fullmatch(r"(.*does not accept option '([^']+)')", message, re.S):
        return _with_suggestion(found[1], found[2], options)
    if found := re.fullmatch(r"unrecognized arguments: (.*)", message, re.S):
        unknown = next((a.split("=")[0] for a in found[1].split() if a.startswith("--")), None)
        return _with_suggestion(message.strip(), unknown, options) if unknown else message
    lines = message.splitlines()
    top = _KEY.match(lines[0]) if lines else None
    if top is None:
        return message
    return _union_problem(top[2], lines[1:], usage) or message


def _with_suggestion(text: str, unknown: str, options: list[str]) -> str:
    """``text`` and the option closest to ``unknown``, corrected at its first unknown segment
    (``trainr.logger.init_args.save_dir`` -> ``trainer.logger.init_args.save_dir``)."""
    dashes = "-" * (len(unknown) - len(unknown.lstrip("-")))
    keys = [o[len(dashes) :].split(".") for o in options if o.startswith("-") == bool(dashes)]
    parts = unknown[len(dashes) :].split(".")
    for i, part in enumerate(parts):
        here = {k[i] for k in keys if len(k) > i and k[:i] == parts[:i]}
        if part in here:
            continue
        close = suggest(part, here)
        if close is None:
            return text
        fixed = dashes + ".".join([*parts[:i], close, *parts[i + 1 :]])
        return f"{text}; did you mean {fixed!r}?"
    return text


def _union_problem(key: str, lines: list[str], usage: str) -> str | None:
    """The cause inside a "Does not validate against any of the Union subtypes" block."""
    for i, line in enumerate(lines):
        problem = _PROBLEM.match(line)
        if problem is not None:
            inner = _block(lines, i + 1, len(problem[1]))
            return _class_problem(key, problem[2], inner, usage)
    return _bad_value(key, lines)


def _block(lines: list[str], start: int, indent: int) -> list[str]:
    """The lines from ``start`` indented deeper than ``indent`` (one item of a jsonargparse
    list), blank lines included."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    return lines[start:end]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _class_problem(key: str, class_path: str, inner: list[str], usage: str) -> str | None:
    text = "\n".join(inner)
    if found := re.search(r"Option '([^']+)' is not accepted", text):
        arg = found[1]
        close = suggest(arg, class_arguments(class_path))
        hint = f"; did you mean {close!r}?" if close else ""
        return (
            f"{key}: {class_path} takes no argument {arg!r}{hint} (its arguments: {usage} "
            f"--{key}.help {class_path})"
        )
    if found := re.search(r"module '([^']+)' has no attribute '([^']+)'", text):
        return _no_class(key, class_path, found[1], found[2])
    if found := re.search(r"No module named '([^']+)'", text):
        module, _, name = found[1].rpartition(".")
        return _no_class(key, class_path, module, name) if module else None
    nested = next((m for line in inner if (m := _KEY.match(line))), None)
    if nested is not None:
        start = inner.index(nested[0]) + 1
        where = f"{key}.init_args.{nested[2]} ({class_path})"
        return _bad_value(where, _block(inner, start, _indent(nested[0])))
    return None


def _no_class(key: str, class_path: str, module: str, name: str) -> str:
    """``class_path`` failed at ``name`` inside the importable ``module``."""
    close = suggest(name, module_names(module))
    prefix = f"{module}.{name}"
    fix = (
        f"did you mean {close_path!r}?"
        if close and (close_path := f"{module}.{close}{class_path[len(prefix) :]}")
        else f"check the spelling (the names in {module}: python -c 'import {module}; "
        f"print(dir({module}))')"
    )
    return f"{key}: class_path {class_path!r} names no class ({module} has no {name!r}); {fix}"


def _bad_value(where: str, lines: list[str]) -> str | None:
    """A value none of the accepted types took: the value and what is accepted."""
    text = "\n".join(lines)
    given = re.search(r"Given value: (.*)", text)
    if (found := re.search(r"Expected a (.+?)\. Got value: (.*)", text)) is not None:
        return f"{where}: expected {_type_name(found[1])}, got {found[2].strip()!r}"
    subtypes = re.search(r"Subtypes: \[(.*)\]", text)
    if given is None or subtypes is None:
        return None
    value = given[1].strip()
    accepted = _accepted(subtypes[1])
    close = suggest(value, [a for a in accepted if a[:1].isdigit() or "-" in a])
    hint = f"; did you mean {close!r}?" if close and close != value else ""
    return f"{where}: {value!r} is not accepted{hint} (accepted: {', '.join(accepted)})"


def _accepted(subtypes: str) -> list[str]:
    """``typing.Literal[64, '32'], <class 'NoneType'>`` -> ``['64', '32', 'null']``."""
    accepted: list[str] = []
    for part in _top_level_items(subtypes):
        if part.startswith("typing.Literal[") and part.endswith("]"):
            accepted += [
                v.strip("'\"") for v in _top_level_items(part[len("typing.Literal[") : -1])
            ]
        else:
            accepted.append(_type_name(part))
    return list(dict.fromkeys(accepted))


def _top_level_items(text: str) -> list[str]:
    """``a, b[c, d], e`` -> ``['a', 'b[c, d]', 'e']`` (commas inside brackets kept)."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    return [*items, current.strip()] if current.strip() else items


def _type_name(text: str) -> str:
    """``<class 'int'>`` -> ``int``; ``collections.abc.Callable[[int], float]`` ->
    ``Callable[[int], float]``; ``NoneType`` -> ``null``."""
    text = re.sub(r"<class '([^']+)'>", r"\1", text.strip())
    text = re.sub(r"\b(?:[a-z_][\w]*\.)+([A-Za-z_]\w*)", r"\1", text)
    return "null" if text == "NoneType" else text


# ------------------------------------------------------------------ names to suggest from
def class_arguments(class_path: str) -> list[str]:
    """The constructor arguments of the class ``class_path`` names (those of its bases too where
    it passes ``**kwargs`` on); empty when it cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in getattr(cls, "__mro__", (cls,)):
        init = getattr(klass, "__init__", None)
        try:
            params = inspect.signature(init).parameters.values()  # type: ignore[arg-type]
        except (TypeError, ValueError):
            break
        names += [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return [n for n in dict.fromkeys(names) if n != "self"]


def module_names(module: str) -> list[str]:
    """The public names of ``module`` (``__all__`` or ``dir``) and its submodules."""
    try:
        imported: Any = importlib.import_module(module)
    except ImportError:
        return []
    names = list(getattr(imported, "__all__", None) or dir(imported))
    names += [m.name for m in pkgutil.iter_modules(getattr(imported, "__path__", []))]
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]
