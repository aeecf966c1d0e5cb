"""`SparsityAlgorithm` is one class a reader can follow (issue 19.1): its behaviour is in the
class or in pure helpers it calls, never in functions of other modules that take it as ``self``;
the masks it holds are a component of their own (`MaskState`, issue 33.1), which asks it for its
decisions only.
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


def test_the_base_knows_no_child_and_no_layer_above() -> None:
    """The drop-and-grow rule's names are `DropAndGrow`'s, not the base's; the Lightning layer and
    the device reach the base through what they set (``step_driver``) and what it asks of them
    (`held`): ``base.py`` names neither layer in its code (docstrings aside)."""
    for name in ("drop_fraction", "drop_fraction_at", "grow_candidates", "lightning_driven"):
        assert not hasattr(SparsityAlgorithm, name), name
    tree = ast.parse((CORE / "algorithms" / "base.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args}
    above = sorted(n for n in names if "lightning" in n.lower() or "wse" in n.lower())
    assert not above, f"base.py names the layers above: {above}"


def test_a_step_driver_calls_before_step_itself() -> None:
    """With ``step_driver`` set (by a training loop above the core), the optimizer's step
    pre-hook leaves `before_step` to the loop: an update due at the step waits for its call."""
    import torch
    from torch import nn

    from lightning_sparse.core import SET

    model = nn.Linear(8, 8)
    sparsity = SET(0.5, update={"freq": 1}, seed=0)
    sparsity.apply(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sparsity.apply(optimizer)
    sparsity.step_driver = "a loop"
    for _ in range(2):
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
    assert sparsity.step == 2 and sparsity.last_update_step == -1  # nobody called before_step
    model(torch.ones(2, 8)).sum().backward()
    sparsity.before_step(optimizer)  # the loop's call
    optimizer.step()
    assert sparsity.last_update_step == 2


def test_the_masks_state_asks_its_algorithm_for_decisions_only() -> None:
    """`MaskState` holds an algorithm's masks and carries its decisions out: of the algorithm
    (its ``owner``) it calls what the `Owner` protocol names and nothing else, so the two do not
    hand control to each other through attributes."""
    from lightning_sparse.core import mask_state

    allowed = {name for name in vars(mask_state.Owner) if not name.startswith("_")}
    used = set()
    for node in ast.walk(ast.parse(Path(mask_state.__file__).read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        of = node.value
        if isinstance(of, ast.Attribute) and isinstance(of.value, ast.Name):
            of_owner = of.attr == "owner" and of.value.id == "self"  # self.owner.<name>
        else:
            of_owner = isinstance(of, ast.Name) and of.id == "owner"  # owner.<name>
        if of_owner:
            used.add(node.attr)
    assert used and used <= allowed, f"MaskState reads its algorithm's {sorted(used - allowed)}"


def test_every_module_of_the_package_is_at_most_600_lines() -> None:
    """Files stay small (STYLE.md; issue 33.1): a module past 600 lines holds more than one job."""
    package = CORE.parent
    long = {
        str(path.relative_to(package)): lines
        for path in sorted(package.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > 600
    }
    assert not long, f"modules over 600 lines: {long}"
