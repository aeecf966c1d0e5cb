"""Roofline per layer: the device's sparse kernels against the vendor BLAS, and the machine's roofs.

Issue 18.2 asks, where a kernel cannot beat the vendor BLAS on a machine, by how much and why.
This script measures, in one process, on this machine:

- the roofs (best of ``--repeats``): **compute**, the GFLOP/s of PyTorch's dense matmul (the
  vendor BLAS: MKL on x86) on a 2048^3 float32 product; the layers' own BLAS calls may reach a
  little more (a share of the roof over 100%); **memory**, the GB/s of a STREAM-like triad
  (``c = a + s * b``) on 64M-float arrays, far past every cache;
- per masked layer shape of the 51M model (``--model 51m``: 1024x1024, 2816x1024, 1024x2816;
  512 tokens) or the recipe model (``--model recipe``: 128x128, 352x128, 128x352; 2048 tokens),
  and per sparsity, the three matmuls of a training step, each timed alone (median of
  ``--repeats``, dense and sparse interleaved):

  ========  =====================  ======================================
  pass      dense (vendor BLAS)    device (native CSR kernels, compact)
  ========  =====================  ======================================
  forward   ``X @ W^T``            SpMM over ``W``'s CSR
  input     ``dY @ W``             scatter along ``W``'s CSR (*)
  weight    ``dY^T @ X``           SDDMM at the kept positions (values)
  ========  =====================  ======================================

(*) ``spmm_t``: the accumulator whole or by L1 column blocks, whichever
`kernel_variants.spmm_t` measures faster for the shape (as the device runs it); the choice is
printed at the end.

For each: useful FLOPs (dense ``2 N out in``; sparse ``2 N nnz``), the minimum bytes (every
operand read once, the result written once: values + column indices (16-bit) + row pointers
for the sparse operand), their ratio (arithmetic intensity, FLOP/byte), the roof at that intensity
(``min(compute roof, intensity x memory roof)``), the achieved GFLOP/s and its share of the roof,
and the time ratio dense / sparse (> 1: the kernel beats the BLAS).

``--ceilings`` adds what this core sustains for the kernels' inner loops alone
(``benchmarks/ceilings.cpp``, built with the kernels' flags): the FMA peak on registers; one
vector load per FMA streamed from L1 (the least a kernel that loads its input per FMA needs);
the forward's gather (per kept weight an index, a value and two vector loads at a random row of
the tile: the SDDMM reads the same) and the input gradient's scatter (a load, an FMA and a store
per vector), each over tiles sized for L1 and for L2.

    python benchmarks/bench_roofline.py [--model 51m|recipe] [--sparsities 0.9,0.95]
        [--threads 2] [--repeats 15] [--ceilings]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _harness import load_average, machine_facts

from lightning_sparse.wse import CSRWeight, compiled_available, kernel_variants, native

MODELS = {
    "51m": ((512,), ((1024, 1024), (2816, 1024), (1024, 2816))),
    "recipe": ((2048,), ((128, 128), (352, 128), (128, 352))),
}


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def compute_roof(repeats: int) -> float:
    """GFLOP/s of the dense matmul (vendor BLAS) on a 2048^3 float32 product, the best of
    ``repeats`` (a roof is what the machine can reach)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    out = torch.empty(2048, 2048)
    return 2 * 2048**3 / _best_s(lambda: torch.mm(a, b, out=out), repeats) / 1e9


def memory_roof(repeats: int) -> float:
    """GB/s of the triad ``c = a + 0.5 * b`` on 64M floats (12 bytes moved per element), the
    best of ``repeats``."""
    n = 64 << 20
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    return 12 * n / _best_s(lambda: torch.add(a, b, alpha=0.5, out=c), repeats) / 1e9


def ceilings(threads: int, peak: float) -> None:
    """Builds ``ceilings.cpp`` and prints each inner-loop probe's GFLOP/s on ``threads`` threads
    and its share of the compute roof ``peak``."""
    source = Path(__file__).with_name("ceilings.cpp")
    compiler = subprocess.run(["c++", "--version"], capture_output=True, check=False)
    if compiler.returncode != 0:
        print("ceilings: no C++ compiler")
        return
    with tempfile.TemporaryDirectory() as folder:
        built = Path(folder) / "ceilings.so"
        flags = [f for f in native._CXX_FLAGS]  # the kernels' own flags
        subprocess.run(["c++", *flags, str(source), "-o", str(built)], check=True)
        lib = ctypes.CDLL(str(built))
        probe = lib.ls_ceiling
        probe.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
        probe.restype = ctypes.c_double
        rows_l1, rows_l2 = 128, 2816  # two 64-byte vectors a row: 16 KB, 352 KB
        print(f"\nceilings of the kernels' inner loops ({threads} threads; share of the roof):")
        for name, kind, rows in (
            ("FMA peak (registers)", 0, 0),
            ("1 vector load per FMA, L1 stream", 3, rows_l1),
            ("gather (forward, SDDMM), L1 tile 16 KB", 1, rows_l1),
            ("gather, L2 tile 128 KB (K = 1024)", 1, 1024),
            ("gather, L2 tile 352 KB (K = 2816)", 1, rows_l2),
            ("scatter (input gradient), L1 16 KB", 2, rows_l1),
            ("scatter, L2 128 KB", 2, 1024),
            ("scatter, L2 352 KB", 2, rows_l2),
        ):
            gflops = probe(kind, rows, threads)
            print(f"  {name:<42} {gflops:7.1f} GFLOP/s {gflops / peak:6.0%}")


def layer_rows(
    out_f: int, in_f: int, tokens: int, sparsity: float, repeats: int
) -> list[tuple[str, float, float, float, float]]:
    """(pass, dense seconds, sparse seconds, dense bytes, sparse bytes) for one layer."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_f, in_f, generator=g)
    mask = torch.rand(out_f, in_f, generator=g) >= sparsity
    weight *= mask
    csr = CSRWeight.from_dense(weight, mask)
    values = csr.gather_values(weight)
    x, grad_y = torch.randn(tokens, in_f, generator=g), torch.randn(tokens, out_f, generator=g)
    y, grad_x = torch.empty(tokens, out_f), torch.empty(tokens, in_f)
    grad_w, grad_values = torch.empty(out_f, in_f), torch.empty(csr.nnz)
    crow, col = csr.crow_indices, csr.col_indices
    nnz = csr.nnz
    index_bytes = nnz * col.element_size() + (out_f + 1) * crow.element_size()
    dense_w = 4 * out_f * in_f
    sparse_w = 4 * nnz + index_bytes
    activations = 4 * tokens * (in_f + out_f)
    passes = (
        ("forward", lambda: torch.mm(x, weight.t(), out=y),
         lambda: native.spmm(crow, col, values, x, None, y)),
        ("input grad", lambda: torch.mm(grad_y, weight, out=grad_x),
         lambda: kernel_variants.spmm_t(crow, col, values, grad_y, grad_x)),
        ("weight grad", lambda: torch.mm(grad_y.t(), x, out=grad_w),
         lambda: native.sddmm(crow, col, grad_y, x, grad_values)),
    )  # fmt: skip
    rows = []
    for name, dense, sparse in passes:
        dense_s: list[float] = []
        sparse_s: list[float] = []
        dense(), sparse()
        for _ in range(repeats):  # interleaved: a burst of load hits both
            dense_s.append(_median_s(dense, 1))
            sparse_s.append(_median_s(sparse, 1))
        # The weight gradient writes the weight (dense) or its values (sparse); the others read it.
        rows.append((name, statistics.median(dense_s), statistics.median(sparse_s),
                     dense_w + activations, sparse_w + activations))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="51m")
    parser.add_argument("--sparsities", default="0.9,0.95")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ceilings", action="store_true", help="the inner loops' ceilings")
    args = parser.parse_args()
    if not compiled_available():
        raise SystemExit("the native kernels are not available here (no C compiler?)")
    torch.set_num_threads(args.threads)
    print(machine_facts())
    peak, bandwidth = compute_roof(args.repeats), memory_roof(args.repeats)
    print(
        f"roofs: compute {peak:.1f} GFLOP/s (dense matmul 2048^3, the vendor BLAS); memory "
        f"{bandwidth:.1f} GB/s (triad, 64M floats); ridge {peak / bandwidth:.1f} FLOP/byte"
    )
    if args.ceilings:
        ceilings(args.threads, peak)
    (tokens,), shapes = MODELS[args.model]
    print(f"\nmodel {args.model}: {tokens} tokens; float32; {args.threads} threads; median of "
          f"{args.repeats}\n")  # fmt: skip
    header = (
        f"{'layer':<10} {'sparsity':>8} {'pass':<11} {'kernel':<7} {'ms':>7} "
        f"{'GFLOP/s':>8} {'FLOP/B':>7} {'roof':>7} {'of roof':>7} {'dense/sparse':>12}"
    )
    print(header)
    for sparsity in (float(s) for s in args.sparsities.split(",")):
        for out_f, in_f in shapes:
            nnz = round((1 - sparsity) * out_f * in_f)
            for name, dense_s, sparse_s, dense_b, sparse_b in layer_rows(
                out_f, in_f, tokens, sparsity, args.repeats
            ):
                for kernel, seconds, flops, nbytes in (
                    ("blas", dense_s, 2 * tokens * out_f * in_f, dense_b),
                    ("sparse", sparse_s, 2 * tokens * nnz, sparse_b),
                ):
                    intensity = flops / nbytes
                    roof = min(peak, intensity * bandwidth)
                    achieved = flops / seconds / 1e9
                    ratio = f"{dense_s / sparse_s:>12.2f}" if kernel == "sparse" else ""
                    print(f"{out_f}x{in_f:<5} {sparsity:>8.2f} {name:<11} {kernel:<7} "
                          f"{1e3 * seconds:>7.3f} {achieved:>8.1f} {intensity:>7.1f} "
                          f"{roof:>7.1f} {achieved / roof:>7.0%} {ratio}")  # fmt: skip
    print(
        "\nroof = min(compute roof, FLOP/B x memory roof) at the minimum traffic; 'of roof' is "
        "the achieved share. dense/sparse > 1: the sparse kernel is faster than the BLAS."
    )
    budgets = native.tile_budgets()
    print(
        f"tile budgets (this machine's caches): SpMM {budgets.spmm >> 10} KB, SDDMM "
        f"{budgets.sddmm >> 10} KB, input-gradient block {budgets.scatter_block / 1024:.1f} KB"
    )
    for key, block in kernel_variants.variant_choices().items():
        layout = "column blocks" if block else "whole"
        print(f"input gradient {key[2][0]}x{key[2][1]}, density bucket {key[3]}: {layout}")
    print(f"load average after the run: {load_average()}")


if __name__ == "__main__":
    main()
