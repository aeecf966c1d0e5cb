"""The wheel's contents as pyproject.toml declares them: every package and the data files the
app needs at run time (`.ci/wheel_check` builds and installs the wheel itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[2]


def setuptools_config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_packages_cover_every_package_directory_and_the_recipes() -> None:
    # Directories with an __init__.py, and any other with Python files (a namespace package
    # would be left out of the wheel just the same if it were not listed).
    found = {
        ".".join(module.parent.relative_to(REPO).parts)
        for module in (REPO / "lightning_sparse").rglob("*.py")
    }
    assert all((REPO / p.replace(".", "/") / "__init__.py").is_file() for p in found), found
    declared = set(setuptools_config()["packages"])
    assert declared == found | {"lightning_sparse.recipes"}, (
        "pyproject.toml [tool.setuptools] packages must list every directory of lightning_sparse "
        f"with an __init__.py; missing {sorted(found - declared)}, extra {sorted(declared - found)}"
    )
    assert setuptools_config()["package-dir"] == {"lightning_sparse.recipes": "recipes"}


def test_package_data_matches_the_recipes_and_sources() -> None:
    data = setuptools_config()["package-data"]
    assert set(data["lightning_sparse.recipes"]) == {"*.yaml", "sweeps/*.yaml"}
    assert data["lightning_sparse.wse"] == ["csrc/*.cpp"]
    assert (REPO / "recipes" / "rigl_llama.yaml").is_file()  # the default recipe
    assert list((REPO / "lightning_sparse" / "wse" / "csrc").glob("*.cpp"))
    assert not list((REPO / "recipes").rglob("*.yml"))  # would not be packaged
