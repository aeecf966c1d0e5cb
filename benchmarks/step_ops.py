"""Kernel launches and host syncs of a training step, counted on the CPU.

On a GPU a small model's step is launch-bound: every aten op that computes launches a kernel,
and every read of a device value on the host (``.item()``, ``int(t)``, a data-dependent shape)
waits for the queue to drain. Both are deterministic, so they are counted here, on the CPU, with
a `TorchDispatchMode` over a plain loop, and `bench_step_ops.py` and
``tests/core/test_step_ops.py`` share the rules:

* **kernels**: every aten op that reaches the dispatcher, except views and metadata (an op
  whose schema says it aliases its input, ``func.is_view``: ``view``, ``t``, ``detach``,
  ``select``, ...) and bare allocations (``empty*``): they launch nothing. A ``_foreach_*`` op
  counts 1 when every tensor it gets has one dtype (CUDA's fused path, one launch per chunk of
  tensors), else one per tensor of its first list (CUDA falls back to a loop over the tensors).
* **host syncs**: ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``), ops whose
  output shape depends on the data (``nonzero``, ``masked_select``, ``unique``, indexing with a
  bool mask), ops that return a Python value computed on the device (``equal``,
  ``is_nonzero``), and ``lift_fresh`` (a tensor made from host data, ``torch.tensor([...])``:
  a pageable host-to-device copy on a GPU). Reads to the host that never reach the
  dispatcher on the CPU are caught one level up (`HostReads`, a `TorchFunctionMode`):
  ``.tolist()``, ``.numpy()`` and ``.cpu()``, each a device-to-host copy on a GPU.

What the CPU cannot show: ``.to(device)`` is a no-op on the CPU, so such copies are not seen
(the package makes none on the step path). While counting (`as_on_a_gpu`), the CPU takes the
GPU's paths: no sampled top-k of long CPU rows (`mask_ops.HOST_SELECT_MIN`), pruning as one
compiled kernel (`masking.FUSED_FOREACH_DEVICES`, `fused_mask`: counted as one launch); and
fused AdamW (what `bench_gpu_step.py` runs) leaves out the held denominators of non-fused Adam
on the CPU (`per_step.hold_denominators`).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sparse.core import mask_ops, masking

aten = torch.ops.aten
_ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty}
_SYNCS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten.equal,
    aten.is_nonzero,
    aten.lift_fresh,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
}
_INDEXING = {aten.index, aten.index_put, aten.index_put_}


@dataclass
class Counts:
    """Kernel launches and host syncs by op name."""

    kernels: Counter[str] = field(default_factory=Counter)
    syncs: Counter[str] = field(default_factory=Counter)

    @property
    def n_kernels(self) -> int:
        return sum(self.kernels.values())

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())


def _bool_indexed(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None
    )


class OpCounter(TorchDispatchMode):
    """Counts what runs under it into ``counts`` (module docstring: the rules)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = Counts()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        packet = func.overloadpacket
        name = packet.__name__
        if packet in _SYNCS or (packet in _INDEXING and _bool_indexed(args)):
            self.counts.syncs[name] += 1
        if packet is not aten.lift_fresh and packet is not aten._local_scalar_dense:
            if not func.is_view and packet not in _ALLOCATIONS:
                self.counts.kernels[name] += _launches(name, args)
        return func(*args, **(kwargs or {}))


def _launches(name: str, args: tuple[Any, ...]) -> int:
    """1, or for a ``_foreach_*`` op whose tensors differ in dtype, one per tensor."""
    if not name.startswith("_foreach_"):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple))]
    dtypes = {t.dtype for a in lists for t in a if isinstance(t, torch.Tensor)}
    return 1 if len(dtypes) <= 1 else len(lists[0])


_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}


class HostReads(TorchFunctionMode):
    """Counts ``.tolist()``, ``.numpy()`` and ``.cpu()`` into ``counts.syncs``."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func in _HOST_READS:
            self.counts.syncs[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def as_on_a_gpu() -> Iterator[None]:
    """Meanwhile, the CPU takes the paths a GPU takes: no sampled top-k of long rows
    (`mask_ops.HOST_SELECT_MIN`), pruning as one compiled kernel
    (`masking.FUSED_FOREACH_DEVICES`)."""
    before, had = mask_ops.HOST_SELECT_MIN, "cpu" in masking.FUSED_FOREACH_DEVICES
    mask_ops.HOST_SELECT_MIN = sys.maxsize
    masking.FUSED_FOREACH_DEVICES.add("cpu")
    try:
        yield
    finally:
        mask_ops.HOST_SELECT_MIN = before
        if not had:
            masking.FUSED_FOREACH_DEVICES.discard("cpu")


def count(fn: Callable[[], object]) -> Counts:
    """The kernels and host syncs of ``fn()``, run as on a GPU (`as_on_a_gpu`)."""
    with as_on_a_gpu(), OpCounter() as counter, HostReads(counter.counts):
        fn()
    return counter.counts
