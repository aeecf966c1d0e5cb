"""The input gradient's column blocks (`native.spmm_t` with ``block_bytes``) at their
boundaries, against masked dense products in float64, and the measured choice between blocked
and whole (`kernel_variants.py`); the machine's cache sizes as sysfs gives them (`caches.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_sparse.wse import CSRWeight, kernel_variants, kernels, native
from lightning_sparse.wse.caches import cache_sizes, parse_size

COMPILED = pytest.mark.skipif(not kernels.compiled_available(), reason="native kernels unavailable")


def _grad_x(csr: CSRWeight, weight: torch.Tensor, grad_y: torch.Tensor, block: int):
    out = torch.full((grad_y.shape[0], csr.shape[1]), float("nan"), dtype=grad_y.dtype)
    native.spmm_t(csr.crow_indices, csr.col_indices, csr.gather_values(weight), grad_y, out, block)
    return out


@COMPILED
@pytest.mark.parametrize("tokens", [1, 16, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_column_blocks_at_their_boundaries(tokens: int, threads: int) -> None:
    """100 columns in blocks of 32 (float64, 16-token tiles: 4 KB; 64 columns for one token):
    the last block partial; row 0 keeps columns 0 and 99 only (first and last block), row 1
    only columns of the second block, row 2 nothing, row 3 every column, row 4 the first and
    last column of every block (31/32, 63/64, 95/96). Blocked equals whole bit for bit and masked
    dense in float64; one block of every column (1 GB) is the whole layout."""
    mask = torch.zeros(5, 100, dtype=torch.bool)
    mask[0, [0, 99]] = True
    mask[1, 32:64] = True
    mask[3] = True
    mask[4, [0, 31, 32, 63, 64, 95, 96, 99]] = True
    generator = torch.Generator().manual_seed(tokens)
    weight = torch.randn(5, 100, dtype=torch.float64, generator=generator) * mask
    grad_y = torch.randn(tokens, 5, dtype=torch.float64, generator=generator)
    csr = CSRWeight.from_dense(weight, mask)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = [_grad_x(csr, weight, grad_y, b) for b in (0, 4 << 10, 8 << 10, 1 << 30)]
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(results[0], grad_y @ weight, rtol=1e-12, atol=1e-12)
    for blocked in results[1:]:
        assert torch.equal(blocked, results[0])


@COMPILED
def test_the_faster_layout_is_measured_once_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call of a key runs both layouts `TUNED["variant_rounds"]` times each and keeps
    the faster; later calls of the key (another density within its bucket) run only that one,
    and the result equals the kernel's either way."""
    kernel_variants.clear_variant_cache()
    runs: list[int] = []
    real = native.spmm_t
    clock = iter(range(1000))

    def timed(*args: object) -> None:
        runs.append(args[5] if len(args) > 5 else 0)  # type: ignore[arg-type]
        real(*args)  # type: ignore[arg-type]

    # Blocked runs take 1 tick, whole ones 3: perf_counter ticks once per read, plus 2 more
    # inside each whole run.
    def fake_clock() -> float:
        return float(next(clock))

    def slow_whole(*args: object) -> None:
        timed(*args)
        if runs[-1] == 0:
            next(clock), next(clock)

    monkeypatch.setattr(kernel_variants.native, "spmm_t", slow_whole)
    monkeypatch.setattr(kernel_variants.time, "perf_counter", fake_clock)
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(64, 300, generator=generator) >= 0.9
    weight = torch.randn(64, 300, generator=generator) * mask
    grad_y = torch.randn(40, 64, generator=generator)
    csr = CSRWeight.from_dense(weight, mask)
    values = csr.gather_values(weight)
    out = torch.empty(40, 300)
    kernel_variants.spmm_t(csr.crow_indices, csr.col_indices, values, grad_y, out)
    block = native.tile_budgets().scatter_block
    rounds = int(kernel_variants.TUNED["variant_rounds"].value)
    assert runs == [0, block] * rounds
    assert list(kernel_variants.variant_choices().values()) == [block]
    torch.testing.assert_close(out, grad_y @ weight)
    runs.clear()
    kernel_variants.spmm_t(csr.crow_indices, csr.col_indices, values, grad_y, out)
    assert runs == [block]
    kernel_variants.clear_variant_cache()


@COMPILED
def test_narrow_layers_never_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most 32 columns (the kernel's narrowest block) there is one layout: no timing."""
    kernel_variants.clear_variant_cache()
    weight = torch.randn(8, 32)
    csr = CSRWeight.from_dense(weight, torch.ones(8, 32, dtype=torch.bool))
    out = torch.empty(5, 32)
    grad_y = torch.randn(5, 8)
    kernel_variants.spmm_t(csr.crow_indices, csr.col_indices, weight.reshape(-1), grad_y, out)
    torch.testing.assert_close(out, grad_y @ weight)
    assert kernel_variants.variant_choices() == {}


@pytest.mark.parametrize(("text", "expected"), [
    ("48K\n", 48 << 10), ("2048K", 2 << 20), ("480M", 480 << 20), ("64", 64), ("", None),
    ("big", None),
])  # fmt: skip
def test_parse_size(text: str, expected: int | None) -> None:
    assert parse_size(text) == expected


def test_cache_sizes_from_sysfs(tmp_path: Path) -> None:
    """A fake sysfs tree of an Intel Xeon's cpu0: L1d (not the instruction cache), L2, L3."""
    for index, (level, kind, size) in enumerate(
        [
            (1, "Data", "48K"),
            (1, "Instruction", "64K"),
            (2, "Unified", "2048K"),
            (3, "Unified", "491520K"),
        ]  # fmt: skip
    ):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, text in (("level", str(level)), ("type", kind), ("size", size)):
            (folder / name).write_text(text + "\n")
    sizes = cache_sizes(tmp_path)
    assert (sizes.l1d, sizes.l2, sizes.last_level) == (48 << 10, 2 << 20, 480 << 20)
    assert cache_sizes(tmp_path / "absent") == type(sizes)()  # no sysfs: every size unknown
