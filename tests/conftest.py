"""Shared test set-up: W&B offline and quiet, the command's help cache in a temporary folder,
the ``cuda`` marker skipped without CUDA, and
``LIGHTNING_SPARSE_PRETEND_CUDA=1`` to run the suite as Lightning sees a GPU machine
(``tests/pretend_cuda/pretend_cuda.py``).

The tree mirrors the package's layers: ``core/`` (plain PyTorch), ``lightning/`` (callbacks,
workflows, distributed), ``wse/`` (the device), ``app/`` (CLI, recipes, docs), ``models/``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# The command's help cache (`lightning_sparse.app.help_cache`) in a folder of this session, not
# the user's ~/.cache: this process and every one a test starts.
os.environ["LIGHTNING_SPARSE_CACHE"] = _CACHE = tempfile.mkdtemp(prefix="lightning_sparse_cache_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

PRETEND_CUDA_DIR = Path(__file__).resolve().parent / "pretend_cuda"
if os.environ.get("LIGHTNING_SPARSE_PRETEND_CUDA", "").strip() not in ("", "0"):
    # This process, and (through sitecustomize.py on PYTHONPATH) every Python process a test
    # starts, counts the pretended GPUs; torch itself still sees none.
    sys.path.insert(0, str(PRETEND_CUDA_DIR))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PRETEND_CUDA_DIR), os.environ.get("PYTHONPATH", "")) if p
    )
    import pretend_cuda

    pretend_cuda.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs where torch.cuda.is_available())")
    for item in items:
        # The marker, not ``"cuda" in item.keywords``: keywords also hold the names of the
        # directories above the test, so a checkout in a folder named "cuda" would skip everything.
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_run_directory_from_another_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `SparseCLI` built directly (not through ``lightning-sparse``) leaves its run-directory
    decision in ``LIGHTNING_SPARSE_RUN`` for DDP workers it may launch; every test starts
    without one, and the variable is restored after it."""
    monkeypatch.delenv("LIGHTNING_SPARSE_RUN", raising=False)
