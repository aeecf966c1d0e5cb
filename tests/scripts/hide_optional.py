"""A pytest plugin that hides the optional packages the GPU image lacks, as if not installed.

    PYTHONPATH=. python -m pytest -p tests.scripts.hide_optional -m "not slow" tests/core

The lent GPU machines have neither jsonargparse (with its ``signatures`` extra), wandb nor
compressed-tensors (docs/gpu.md), and `benchmarks/gpu_check.sh` runs the CUDA tests and the suite
there even when no wheel of them was carried: the tests that need one must skip themselves, not
fail to be collected. `tests/app/test_gpu_check.py` collects those parts under this plugin.

Loaded before collection, it puts ``None`` into ``sys.modules`` for each package (an import then
raises ``ModuleNotFoundError``, so ``pytest.importorskip`` skips, and
``importlib.util.find_spec`` answers None), and makes ``importlib.metadata`` find no distribution
of them (as Lightning's requirement checks would find on that machine).
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

HIDDEN = ("jsonargparse", "docstring_parser", "typeshed_client", "wandb", "compressed_tensors")

for _name in HIDDEN:
    if _name in sys.modules and sys.modules[_name] is not None:
        raise RuntimeError(f"{_name} was imported before hide_optional could hide it")
    sys.modules[_name] = None  # type: ignore[assignment]

_from_name = importlib.metadata.Distribution.from_name.__func__  # type: ignore[attr-defined]


def _hidden_from_name(cls: type[importlib.metadata.Distribution], name: str) -> Any:
    if name.replace("-", "_").lower() in HIDDEN:
        raise importlib.metadata.PackageNotFoundError(name)
    return _from_name(cls, name)


importlib.metadata.Distribution.from_name = classmethod(_hidden_from_name)  # type: ignore[assignment]
