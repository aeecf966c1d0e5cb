"""`install.update_figures` and `mask_ops.row_counts`: the same counts on the CPU's path
(``count_nonzero`` per weight) and on a GPU's (one reduction over the stack), and no sum of
bools on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sparse.core import masking
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
        import lightning_sparse.core.install as install

        monkeypatch.setattr(install, "FUSED_FOREACH_DEVICES", masking.FUSED_FOREACH_DEVICES)
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
