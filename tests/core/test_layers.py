"""The layering: core never imports Lightning, the device or the app; each layer imports only
the layers below it (core <- lightning <- wse <- app)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_sparse"
# What each layer may import from lightning_sparse (besides itself).
ALLOWED = {
    "core": set(),
    "lightning": {"core"},
    "models": {"core", "lightning"},
    "data": {"core", "lightning"},
    "wse": {"core", "lightning"},
    "integrations": {"core", "lightning", "models", "wse"},
    "app": {"core", "lightning", "wse", "models", "data", "recipes", "integrations"},
}
THIRD_PARTY_FORBIDDEN = {"core": {"lightning", "pytorch_lightning", "jsonargparse", "wandb"}}


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute; relative ones resolved in the package)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_downward(layer: str) -> None:
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "lightning_sparse" and len(parts) > 1:
                if parts[1] != layer and parts[1] not in ALLOWED[layer]:
                    bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
            elif parts[0] in THIRD_PARTY_FORBIDDEN.get(layer, set()):
                bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not bad, "\n".join(bad)


BLOCK_LIGHTNING = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning", "pytorch_lightning"):
            raise ImportError(f"{name} is blocked: lightning_sparse.core must not need it")
sys.meta_path.insert(0, Block())
"""


def test_core_works_with_lightning_unimportable() -> None:
    """A plain PyTorch user: import the core and train a few sparse steps, Lightning blocked."""
    code = (
        BLOCK_LIGHTNING
        + """
import torch
import lightning_sparse
from lightning_sparse.core import RigL, configure
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
sparsity = RigL(0.75, update={"freq": 2}, seed=0)
model.apply(sparsity)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sparsity.apply(opt)
for _ in range(5):
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step(); opt.zero_grad()
assert sparsity.step == 5 and sparsity.last_update_step == 4
for sp in sparsity.sparse_params.values():
    assert not sp.param.detach()[~sp.mask].any()
assert configure(0.5) is not None
assert "lightning" not in sys.modules and "lightning_sparse.wse" not in sys.modules
print("ok")
"""
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_public_api_names_resolve_and_are_the_documented_kinds() -> None:
    """Every name in ``lightning_sparse.__all__`` resolves; the algorithms are Lightning
    callbacks that extend the plain core classes of the same name."""
    import lightning.pytorch as pl

    import lightning_sparse
    from lightning_sparse import core

    for name in lightning_sparse.__all__:
        assert getattr(lightning_sparse, name) is not None, name
    for name in ("Static", "GMP", "SET", "RigL", "GraNet", "Group", "SparsityAlgorithm"):
        public = getattr(lightning_sparse, name)
        assert issubclass(public, pl.Callback) and issubclass(public, getattr(core, name)), name
    assert lightning_sparse.DynamicSparsityAlgorithm is lightning_sparse.SparsityAlgorithm
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lightning_sparse.Nope  # noqa: B018
