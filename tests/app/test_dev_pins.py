"""The checks CI makes before the tests agree with each other: the pre-commit hooks run the tool
versions pyproject's dev extra pins (what .ci/run installs), the type stub of the recipes package
names what the package defines, and the coverage floors cover every layer and fail as stated."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[2]


def dev_pins() -> dict[str, str]:
    """``{package: version}`` of the ``==`` pins in pyproject's dev extra."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for requirement in extra["optional-dependencies"]["dev"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", requirement)
        if match:
            pins[match[1].lower()] = match[2]
    return pins


def test_ci_tools_are_pinned() -> None:
    assert {"ruff", "mypy", "pytest-cov"} <= set(dev_pins()), dev_pins()


def test_pre_commit_runs_the_pinned_ruff_and_the_venv_mypy() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    repos = {repo["repo"]: repo for repo in config["repos"]}
    ruff = repos["https://github.com/astral-sh/ruff-pre-commit"]
    assert ruff["rev"] == f"v{dev_pins()['ruff']}", (
        f".pre-commit-config.yaml runs ruff {ruff['rev']} but pyproject.toml pins "
        f"ruff=={dev_pins()['ruff']} (what CI runs): change both together"
    )
    assert {hook["id"] for hook in ruff["hooks"]} == {"ruff-check", "ruff-format"}
    (mypy,) = [hook for hook in repos["local"]["hooks"] if hook["id"] == "mypy"]
    # The venv's mypy (the pinned one, with the dependencies CI type-checks against), over the
    # whole package as configured in pyproject.toml, as .ci/run runs it.
    assert mypy["entry"] == ".venv/bin/mypy" and mypy["pass_filenames"] is False
    assert ".venv/bin/mypy\n" in (REPO / ".ci" / "run").read_text()


def test_the_recipes_stub_names_what_the_recipes_package_defines() -> None:
    def public(path: Path) -> set[str]:
        names: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        return {n for n in names if not n.startswith("_")}

    stub = public(REPO / "lightning_sparse" / "recipes.pyi")
    assert stub and stub == public(REPO / "recipes" / "__init__.py")


# ------------------------------------------------------------------------------ coverage floors
def floors_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "coverage_floors", REPO / ".ci" / "coverage_floors.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_layer_has_a_floor() -> None:
    layers = {p.parent.name for p in (REPO / "lightning_sparse").glob("*/__init__.py")}
    assert set(floors_module().FLOORS) == layers | {"root"}


def report(files: dict[str, tuple[int, int, int, int]]) -> dict:
    """A coverage JSON report: ``{path: (statements, covered, branches, covered branches)}``."""
    return {
        "meta": {"branch_coverage": True},
        "files": {
            path: {
                "summary": {
                    "num_statements": s,
                    "covered_lines": c,
                    "num_branches": b,
                    "covered_branches": cb,
                }
            }
            for path, (s, c, b, cb) in files.items()
        },
    }


def test_a_layer_below_its_floor_fails_naming_layer_figure_and_floor(
    capsys: pytest.CaptureFixture,
) -> None:
    floors = floors_module()
    data = report(
        {
            "lightning_sparse/core/a.py": (100, 95, 10, 9),
            "lightning_sparse/core/b.py": (100, 85, 10, 5),  # core: 90% lines, 70% branches
            "lightning_sparse/wse/c.py": (10, 10, 4, 4),
            "lightning_sparse/__init__.py": (5, 5, 0, 0),
        }
    )
    limits = {"core": (90, 75), "wse": (100, 100), "root": (100, 100)}
    assert floors.check(data, limits) == [
        "layer 'core': branch coverage 70.00% is below its floor of 75%; add tests for the new "
        "code (coverage's report lists the lines)"
    ]
    assert floors.check(data, {**limits, "core": (90, 70)}) == []
    failures = floors.check(data, {"core": (0, 0), "wse": (0, 0), "root": (0, 0), "app": (1, 1)})
    assert failures == ["layer 'app': no measured file (was the package imported?)"]
    failures = floors.check(data, {"core": (0, 0), "root": (0, 0)})
    assert failures == [
        "layer 'wse' has no coverage floor: add one to FLOORS in .ci/coverage_floors.py"
    ]
    assert "core" in capsys.readouterr().out
    assert floors.layer_of("recipes/__init__.py") == "root"
    assert floors.check({**data, "meta": {"branch_coverage": False}}, limits)[0].startswith(
        "the report has no branch coverage"
    )
