"""`core/legacy.py`: every compatibility shim is registered, with the release that removes it.

The list below is the registry's, written out: a shim added, removed or given another release
changes both. A module that speaks of an earlier version of the package without being a
registered shim's site fails `test_no_compatibility_code_outside_the_registered_sites`.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest
import torch

from lightning_sparse import __version__
from lightning_sparse.core import SparsityAlgorithm, legacy
from lightning_sparse.core.legacy import SHIMS

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_sparse"

EXPECTED = {
    "mask_entries": "0.3.0",
    "state_without_packed_masks": "0.3.0",
    "callbacks_layout": "0.3.0",
    "summary_totals": "0.3.0",
    "hf_bool_masks": "0.3.0",
    "checkpoint_temporaries": "0.3.0",
    "rule_without_name": "0.3.0",
    "DynamicSparsityAlgorithm": "0.3.0",
    "register_masks": "0.3.0",
    "cadences_in_schedules": "0.3.0",
    "hf_torch_dtype": "0.3.0",
}
# What a compatibility shim's code says of itself.
MARKERS = re.compile(r"earlier version|older name|deprecated alias|alias of|alias,", re.I)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_shims_are_these_and_each_names_its_removal() -> None:
    assert {name: shim.removed_in for name, shim in SHIMS.items()} == EXPECTED
    for name, shim in SHIMS.items():
        assert shim.name == name and shim.keeps and shim.sites
        assert _version(shim.removed_in) > _version(__version__), name


@pytest.mark.parametrize("site", sorted({s for shim in SHIMS.values() for s in shim.sites}))
def test_every_site_exists(site: str) -> None:
    module, _, qualname = site.partition(":")
    if module.startswith("integrations.hf"):
        pytest.importorskip("transformers")
    obj: object = importlib.import_module(f"lightning_sparse.{module}")
    for part in qualname.split("."):
        obj = getattr(obj, part)


def test_no_compatibility_code_outside_the_registered_sites() -> None:
    """A module whose code speaks of an earlier version (or an alias, a deprecated name) is the
    site of a registered shim: a new shim must be registered to be written."""
    sites = {
        f"lightning_sparse.{s.partition(':')[0]}" for shim in SHIMS.values() for s in shim.sites
    }
    unregistered = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        if module not in sites and MARKERS.search(path.read_text()):
            unregistered.append(module)
    assert not unregistered, f"compatibility code outside core/legacy.SHIMS' sites: {unregistered}"


def test_aliases_are_the_names_they_stand_for() -> None:
    from lightning_sparse import core
    from lightning_sparse.core import algorithms, state_dict
    from lightning_sparse.core.algorithms import base

    for where in (core, algorithms, base):
        assert where.DynamicSparsityAlgorithm is SparsityAlgorithm
    wse = pytest.importorskip("lightning_sparse.wse")
    assert wse.register_masks is state_dict.restore_masks


def test_a_rule_written_without_the_name_still_works_and_warns() -> None:
    """``update_mask(p, mask, sparsity)`` (the rule before it took the parameter's name) is
    called with the name left out; defining such a class warns, naming the release."""
    with pytest.warns(DeprecationWarning, match="takes no parameter name.*0.3.0"):

        class KeepFirst(SparsityAlgorithm, register=False):
            def update_mask(
                self, p: torch.Tensor, mask: torch.Tensor, sparsity: float
            ) -> torch.Tensor:
                keep = int((1 - sparsity) * p.numel())
                return (torch.arange(p.numel()) < keep).reshape(p.shape)

    layer = torch.nn.Linear(4, 4)
    algorithm = KeepFirst(0.5, update={"freq": 1})
    algorithm.apply(layer)
    layer.weight.grad = torch.ones(4, 4)
    algorithm.step = 1
    algorithm.update()
    assert algorithm.sparse_params["weight"].mask.flatten().tolist() == [True] * 8 + [False] * 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's form: no warning

        class Today(SparsityAlgorithm, register=False):
            def update_mask(
                self, name: str, p: torch.Tensor, mask: torch.Tensor, sparsity: float
            ) -> torch.Tensor:
                return mask

    assert legacy.named_rule(Today, "update_mask") is None
