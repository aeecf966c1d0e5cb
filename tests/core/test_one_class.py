"""`SparsityAlgorithm` is one class a reader can follow (issue 19.1): its behaviour is in the
class or in pure helpers it calls, never in functions of other modules that take it as ``self``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from lightning_sparse.core import SparsityAlgorithm
from lightning_sparse.core.algorithms import base

CORE = Path(__file__).resolve().parents[2] / "lightning_sparse" / "core"


def test_every_method_of_the_algorithm_is_written_in_its_class() -> None:
    """No ``method = other_module.function`` aliases: each callable (and property) in the
    class's namespace was defined in its body, in ``base.py``."""
    borrowed = []
    for name, value in vars(SparsityAlgorithm).items():
        fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if not (callable(fn) and hasattr(fn, "__code__")):
            continue  # data: the docstring, class attributes
        own = fn.__qualname__.startswith("SparsityAlgorithm.") and fn.__module__ == base.__name__
        if not own:
            borrowed.append(f"{name} = {fn.__module__}.{fn.__qualname__}")
    assert not borrowed, f"methods defined outside the class: {borrowed}"


def test_no_core_function_works_on_an_algorithm_as_self() -> None:
    """No module-level function of the core reads or sets attributes of an argument that is the
    algorithm (annotated ``SparsityAlgorithm`` or named ``algorithm``): helpers get the values
    they need. (A registry may hold algorithms: `applied.record(model, algorithm)`.)"""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for arg in node.args.args + node.args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                if "SparsityAlgorithm" not in annotation and arg.arg != "algorithm":
                    continue
                if any(
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == arg.arg
                    for sub in ast.walk(node)
                ):
                    found.append(f"{path.relative_to(CORE)}:{node.lineno} {node.name}({arg.arg})")
    assert not found, f"functions working on the algorithm as self: {found}"
