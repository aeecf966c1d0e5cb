"""`install.update_figures` and `mask_ops.row_counts`: the same counts on the CPU's paths
(``count_nonzero`` per row of a large stack, a byte sum otherwise) and on a GPU's (one reduction
over the stack), and no sum of bools."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sparse.core import mask_ops, masking
from lightning_sparse.core.install import update_figures
from lightning_sparse.core.mask_ops import row_counts


def _masks(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    old = torch.rand(3, 5, 7, generator=g) < 0.4
    new = torch.rand(3, 5, 7, generator=g) < 0.4
    new[1] = old[1]  # a weight the update leaves alone
    ever = list((torch.rand(3, 5, 7, generator=g) < 0.2).unbind(0))
    return old, new, ever


def _reference(old, new, ever):  # type: ignore[no-untyped-def]
    flat_old, flat_new = old.flatten(1).tolist(), new.flatten(1).tolist()
    dropped = [
        sum(o and not n for o, n in zip(a, b, strict=True))
        for a, b in zip(flat_old, flat_new, strict=True)
    ]
    grown = [
        sum(n and not o for o, n in zip(a, b, strict=True))
        for a, b in zip(flat_old, flat_new, strict=True)
    ]
    kept = [sum(b) for b in flat_new]
    merged = [
        sum(e or n for e, n in zip(x.flatten().tolist(), b, strict=True))
        for x, b in zip(ever, flat_new, strict=True)
    ]
    return dropped, grown, kept, merged


class _BoolSums(TorchDispatchMode):
    """Records every sum over a bool tensor (on the CPU a promoting loop that widens each
    entry to int64 inside the kernel: about 30x a ``count_nonzero``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket is torch.ops.aten.sum and args[0].dtype == torch.bool:
            self.seen.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("as_on_a_gpu", [False, True], ids=["cpu", "gpu-path"])
def test_update_figures_count_exactly_on_either_path(
    as_on_a_gpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if as_on_a_gpu:
        monkeypatch.setattr(
            masking, "FUSED_FOREACH_DEVICES", {*masking.FUSED_FOREACH_DEVICES, "cpu"}
        )
    old, new, ever = _masks(0)
    expected = _reference(old, new, [e.clone() for e in ever])
    figures = update_figures(old, new, ever)
    assert figures.ever is not None
    got = [t.tolist() for t in (figures.dropped, figures.grown, figures.kept, figures.ever)]
    assert got == [list(x) for x in expected]
    assert figures.dropped[1] == figures.grown[1] == 0
    assert all(
        torch.equal(e, e | n) for e, n in zip(ever, new.unbind(0), strict=True)
    )  # or-ed in place


def test_the_cpu_path_sums_no_bools() -> None:
    """On the CPU the figures count with ``count_nonzero`` and the row counts sum bytes into
    int32: no sum over a bool tensor, whose int64 widening made a 51M model's RigL update step
    0.5 s slower (issue 26's stacked figures)."""
    old, new, ever = _masks(1)
    with _BoolSums() as sums:
        update_figures(old, new, ever)
        counts = row_counts(new)
    assert sums.seen == []
    assert counts.dtype == torch.int32
    assert torch.equal(counts, new.sum(-1).to(torch.int32))
    assert torch.equal(row_counts(new, keepdim=True), new.sum(-1, keepdim=True).to(torch.int32))


def test_long_rows_on_the_cpu_are_counted_row_by_row_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of ``HOST_SELECT_MIN`` or more in masks of ``COUNT_BY_ROW_MIN`` entries or more: one
    ``count_nonzero`` per row (a byte sum of that size is a slow converting loop on the CPU), the
    same int32 counts, with or without ``keepdim``."""
    monkeypatch.setattr(mask_ops, "HOST_SELECT_MIN", 8)
    monkeypatch.setattr(mask_ops, "COUNT_BY_ROW_MIN", 32)
    masks = torch.rand(2, 3, 16, generator=torch.Generator().manual_seed(2)) < 0.4
    with _BoolSums() as sums, _Ops() as ops:
        counts = row_counts(masks)
        kept = row_counts(masks, keepdim=True)
    assert sums.seen == [] and "count_nonzero" in ops.seen and "sum" not in ops.seen
    assert counts.dtype == kept.dtype == torch.int32
    assert torch.equal(counts, masks.sum(-1).to(torch.int32))
    assert torch.equal(kept, masks.sum(-1, keepdim=True).to(torch.int32))


class _Ops(TorchDispatchMode):
    """Records the name of every aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
