"""Shared test set-up: W&B offline and quiet, and the ``cuda`` marker skipped without CUDA.

The tree mirrors the package's layers: ``core/`` (plain PyTorch), ``lightning/`` (callbacks,
workflows, distributed), ``wse/`` (the device), ``app/`` (CLI, recipes, docs), ``models/``.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs where torch.cuda.is_available())")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
