"""Run the suite as Lightning would see it on a GPU machine, on a machine without one.

``LIGHTNING_SPARSE_PRETEND_CUDA=N`` (N >= 1 GPUs; any other non-empty value means 1) makes
Lightning count N CUDA devices: ``accelerator="auto"`` then picks ``"cuda"`` (and fails at once,
since torch has no CUDA here), and every ``accelerator="cpu"`` Trainer emits "GPU available but
not used", as on the H200 that found issue 26. A test that means the CPU but leaves the
accelerator to Lightning, or that turns that warning into an error, fails here as it would there.

Only Lightning's count is patched (``lightning.fabric.accelerators.cuda.num_cuda_devices``, which
``CUDAAccelerator.is_available``/``auto_device_count``, the accelerator connector's choice and
``_log_device_info``'s warning all read); torch itself still sees no GPU, so ``torch.cuda`` calls,
``@pytest.mark.cuda`` skips and Hugging Face's device choice are unchanged.

``tests/conftest.py`` calls `install` in the pytest process and puts this folder on
``PYTHONPATH``, where ``sitecustomize.py`` calls it in every Python process a test starts (the
``lightning-sparse`` CLI, ``tests/scripts/*.py``, Lightning's ddp ranks, spawned workers). That
``sitecustomize`` shadows any other on the path (a virtual environment made by ``.ci/setup`` has
none); a subprocess started with ``python -I`` or ``-E`` does not pretend.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

ENV = "LIGHTNING_SPARSE_PRETEND_CUDA"
TARGET = "lightning.fabric.accelerators.cuda"
# Modules that bind ``num_cuda_devices`` by name when imported (``from ... import``).
BOUND = ("lightning.pytorch.accelerators.cuda",)


def pretended_devices() -> int:
    """How many GPUs Lightning is to count: 0 when ``ENV`` is unset or empty."""
    value = os.environ.get(ENV, "").strip()
    if not value or value == "0":
        return 0
    return int(value) if value.isdigit() else 1


def _patch(module: ModuleType, count: int) -> None:
    def num_cuda_devices() -> int:
        return count

    module.num_cuda_devices = num_cuda_devices  # type: ignore[attr-defined]
    for name in BOUND:
        if name in sys.modules:
            sys.modules[name].num_cuda_devices = num_cuda_devices  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``TARGET`` as soon as it is executed, before any module binds its names."""

    def __init__(self, count: int) -> None:
        self.count = count

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module
        count = self.count

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _patch(module, count)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> int:
    """Make Lightning count `pretended_devices` GPUs in this process; returns that count."""
    count = pretended_devices()
    if not count:
        return 0
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET], count)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(count))
    return count
