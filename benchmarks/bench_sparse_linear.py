"""Sparse Linear forward+backward on the emulated wafer-scale device versus dense `F.linear`.

For each weight shape and sparsity it prints dense_time / sparse_time (higher is better) for our
native CSR kernels ("compiled"), for PyTorch's stock CSR ops on the same structure ("torch"), and
the path "auto" picks with its own ratio ("auto x": `sparse_linear`'s cost; "dense" when no sparse
path beats dense by the autotune margin, so it should never be far below 1), the same for what the
executor runs under a sparsity algorithm ("kept": pruned weights and gradients kept at 0 by the
algorithm, so its "dense" is plain `F.linear`, the baseline itself), plus the cost of
rebuilding the CSR structure after a mask change. The "decode" columns do the same for one
token without autograd (the inference runner the executor uses for batch-1 generation). Dense
and sparse runs are interleaved in one process and summarised by their median, so a burst of
background load hits every method, though not equally: on oversubscribed cores every multi-threaded
kernel stalls whenever one of its threads is descheduled. The load average is printed for context.

    python benchmarks/bench_sparse_linear.py [--tokens 512] [--threads 2] [--repeats 15]
    python benchmarks/bench_sparse_linear.py --tokens 2048 --sparsities 0.9 \\
        --shapes 128x128,352x128,128x352   # the recipe model's layers, its batch

On a shared machine, `--threads 1 --clock thread` times CPU time of the calling thread instead of
wall-clock time: it ignores time spent descheduled, so it estimates the intrinsic cost.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_sparse.wse import CSRWeight, compiled_available, resolve_path, sparse_linear
from lightning_sparse.wse.kernels import inference_runner

SHAPES = ((1024, 1024), (4096, 1024))
SPARSITIES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)


def _step_fn(
    path: str | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    csr: CSRWeight,
    grad_y: torch.Tensor,
) -> Callable[[], None]:
    """One forward+backward; `path=None` is plain dense `F.linear` (the baseline)."""

    def step() -> None:
        for tensor in (x, weight, bias):
            if tensor is not None:
                tensor.grad = None
        if path is None:
            y = F.linear(x, weight, bias)
        else:
            y = sparse_linear(x, weight, csr, bias, path=path)
        y.backward(grad_y)

    return step


def _interleaved_medians(
    fns: dict[str, Callable[[], None]],
    repeats: int,
    clock: Callable[[], float],
    summary: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: allocator, thread pool, caches
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: summary(ts) for name, ts in times.items()}


DECODE_CALLS = 50  # one-token calls per timed sample (each is microseconds)


def _decode_fn(
    path: str | None, weight: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor, csr: CSRWeight
) -> Callable[[], None]:
    """``DECODE_CALLS`` one-token forwards without autograd; `path=None` is dense `F.linear`."""
    x1 = torch.randn(1, weight.shape[1])
    with torch.no_grad():
        masked, b = (weight * mask).detach(), bias.detach()
        if path is None:
            run = functools.partial(F.linear, weight=masked, bias=b)
        else:
            run = inference_runner(path, csr.gather_values(masked), csr, masked, mask, b)

    def calls() -> None:
        with torch.no_grad():
            for _ in range(DECODE_CALLS):
                run(x1)

    return calls


def _rebuild_ms(
    weight: torch.Tensor, mask: torch.Tensor, clock: Callable[[], float], repeats: int = 5
) -> float:
    """Median time of `CSRWeight.from_dense`, what a mask update costs the device."""
    times = []
    for _ in range(repeats):
        start = clock()
        CSRWeight.from_dense(weight, mask)
        times.append(clock() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument(
        "--shapes",
        default=",".join(f"{o}x{i}" for o, i in SHAPES),
        help="comma-separated OUTxIN weight shapes (the recipe model's: 128x128,352x128,128x352)",
    )
    parser.add_argument(
        "--sparsities", default=",".join(str(s) for s in SPARSITIES), help="comma-separated"
    )
    args = parser.parse_args()
    try:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
        sparsities = [float(v) for v in args.sparsities.split(",")]
    except ValueError:
        parser.error(f"--shapes={args.shapes!r} must look like 1024x1024,4096x1024 and "
                     f"--sparsities={args.sparsities!r} like 0.5,0.9")  # fmt: skip
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread measures one thread's CPU time; use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    paths = ["compiled", "torch"] if compiled_available() else ["torch"]
    generator = torch.Generator().manual_seed(0)
    print(
        f"fp32, {args.tokens} tokens, {torch.get_num_threads()} threads, {args.clock} clock, "
        f"median of {args.repeats} interleaved repeats; ratio = dense_time / sparse_time "
        f"(fwd+bwd); load average at start {_load()}"
    )
    header = f"{'weight':>10} {'sparsity':>8} {'dense ms':>9} " + " ".join(
        f"{p + ' ms':>11} {p + ' x':>10}" for p in paths
    )
    print(
        header + f" {'auto picks':>10} {'auto x':>7} {'kept picks':>10} {'kept x':>7}"
        f" {'rebuild ms':>10}"
        f" {'decode picks':>12} {'decode x':>8}"
    )
    for out_features, in_features in shapes:
        x = torch.randn(args.tokens, in_features, generator=generator).requires_grad_()
        weight = torch.randn(out_features, in_features, generator=generator).requires_grad_()
        bias = torch.randn(out_features, generator=generator).requires_grad_()
        grad_y = torch.randn(args.tokens, out_features, generator=generator)
        for sparsity in sparsities:
            mask = torch.rand(out_features, in_features, generator=generator) >= sparsity
            csr = CSRWeight.from_dense(weight, mask)
            auto = resolve_path(x, weight, csr, "auto")  # autotunes now, before the timing
            # What the executor runs under a sparsity algorithm (pruned weights and gradients
            # kept at 0): "dense" is plain F.linear, and timed as such by "auto".
            kept = resolve_path(x, weight, csr, "auto", zeros_kept=True)
            x1 = torch.randn(1, in_features)
            decode = resolve_path(x1, weight.detach(), csr, "auto", requires_grad=False)
            fns = {"dense": _step_fn(None, x, weight, bias, csr, grad_y)}
            fns.update({p: _step_fn(p, x, weight, bias, csr, grad_y) for p in paths})
            fns["auto"] = _step_fn(auto, x, weight, bias, csr, grad_y)
            fns["kept"] = _step_fn(None if kept == "dense" else kept, x, weight, bias, csr, grad_y)
            fns["decode dense"] = _decode_fn(None, weight, mask, bias, csr)
            fns["decode auto"] = _decode_fn(decode, weight, mask, bias, csr)
            medians = _interleaved_medians(fns, args.repeats, clock)
            cells = " ".join(
                f"{1e3 * medians[p]:11.2f} {medians['dense'] / medians[p]:10.2f}" for p in paths
            )
            auto_x = medians["dense"] / medians["auto"]
            kept_x = medians["dense"] / medians["kept"]
            decode_x = medians["decode dense"] / medians["decode auto"]
            print(
                f"{out_features:>5}x{in_features:<4} {sparsity:8.0%} {1e3 * medians['dense']:9.2f}"
                f" {cells} {auto:>10} {auto_x:7.2f} {kept:>10} {kept_x:7.2f}"
                f" {_rebuild_ms(weight, mask, clock):10.2f}"
                f" {decode:>12} {decode_x:8.2f}"
            )
    print(f"load average at end {_load()}")


def _load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


if __name__ == "__main__":
    main()
