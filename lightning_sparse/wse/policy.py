"""Which kernel path runs a sparse layer: a pure policy over shape, density, machine and timings.

No tensor work, no timing, no state: every function maps plain facts (a layer's shape and kept
count, the token count, the device, dtype and whether the native library loaded, the best
measured seconds of each candidate) to a decision, so the rules are testable without running a
kernel. `autotune.py` measures and caches; `ops.py` runs. Every tuned constant is one row of
`TUNED`, with the benchmark (and machine) that produced it.

Paths: "compiled" (the native kernels, `native.py`), "torch" (PyTorch's CSR ops), "dense"
(`F.linear` on the masked weight, always a candidate: the fallback that keeps the device never
slower than dense beyond timing noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_L1D",
    "DEFAULT_L2",
    "PATHS",
    "TUNED",
    "U16_COLUMNS",
    "TileBudgets",
    "Tuned",
    "autotune_key",
    "choose_path",
    "close_call",
    "decode_forces_dense",
    "decode_stream_copies",
    "kernel_threads",
    "margin",
    "narrow_columns",
    "tile_budgets",
    "token_bucket_of",
    "unsupported_reason",
    "variant_key",
]

PATHS = ("compiled", "torch", "dense")
U16_COLUMNS = 1 << 16
"""Widest weight whose column indices the device holds in 16 bits (`csr.CSRWeight`)."""


def narrow_columns(in_features: int) -> bool:
    """Whether a weight with ``in_features`` columns holds 16-bit column indices (the rule of
    `csr.CSRWeight`, `csr_linear.CSRLinear` and the memory statistics)."""
    return in_features <= U16_COLUMNS


@dataclass(frozen=True)
class Tuned:
    """One tuned constant of the path choice.

    Attributes:
        value: the constant.
        benchmark: the command (and machine, date) whose measurements set it; "design" where no
            measurement did.
        finding: what the measurement showed.
    """

    value: float
    benchmark: str
    finding: str


TUNED: dict[str, Tuned] = {
    "margin": Tuned(
        0.05,
        "benchmarks/bench_sparse_linear.py (2-core Intel Xeon VM, 2026-11-23)",
        "a sparse path must beat dense by more than this share of dense's time in inference: "
        "one within timing noise risks being slower on the real run",
    ),
    "margin_training": Tuned(
        0.2,
        "benchmarks/bench_wse_training.py --sparsities 0.5,0.7 --threads 1 --steps 7 (2-core "
        "Intel Xeon VM, 2026-11-23)",
        "the margin for fwd+bwd calls: inside a step a sparse layer pays costs its timing alone "
        "misses (inputs out of cache, per-call work); at 70% paths 8-12% faster alone made the "
        "recipe step 10% slower than dense",
    ),
    "decode_bytes_ratio": Tuned(
        0.5,
        "benchmarks/bench_wse_decode.py --dim 1024 (2-core Intel Xeon VM, 2026-11-23); now "
        "only serving's storage rule (`csr_linear.runs_in_csr`), not re-measured",
        "few-token inference streams each layer's weights from memory, which timing one layer "
        "(weights in cache) misses: a sparse path is a candidate only if its values and column "
        "indices are at most this share of the dense bytes; at 50% (0.75 of the bytes) one-token "
        "kernels 7-20% faster alone made decode 0.85-0.91x dense, at 70% (0.45) 1.12-1.42x",
    ),
    "close_call": Tuned(
        0.2,
        "benchmarks/bench_sparse_linear.py (2-core Intel Xeon VM, 2026-11-23, load 1.4-3.3)",
        "a sparse path within this share of dense's best time is re-measured before the choice: "
        "5 disturbed rounds had picked compiled at 0.91x for 4096x1024 at 70%",
    ),
    "tile_l2_share": Tuned(
        0.5,
        "kernel timing of the 51M model's layers (1024x1024, 2816x1024, 1024x2816 at 90% and 95%, "
        "512 tokens, 1 thread): 2-core AMD EPYC VM (1 MB L2), 2026-11-25/27; 2-core Intel Xeon "
        "VM (2 MB L2), 2026-11-28",
        "the SpMM and SDDMM kernels' transposed token tiles (features x tokens) are sized for "
        "this share of L2 (`tile_budgets`): 512 KB was the best constant on the AMD EPYC "
        "(below two vectors of tokens the SDDMM's dot products drop from 40 to 30 GFLOP/s; two "
        "vectors of the SpMM at K = 2816 ran 84-92 against 75-80 with one); on the Intel Xeon "
        "the SDDMM at K = 2816 runs 51.8 GFLOP/s with 1 MB (four vectors) against 47.1 with "
        "512 KB (two); the SpMM is within 5% from 128 KB to 2 MB there",
    ),
    "scatter_l1_share": Tuned(
        5 / 6,
        "the input-gradient kernel alone (the 51M model's layers, 512 tokens, 1 thread), "
        "2-core Intel Xeon VM (48 KB L1d), 2026-11-28",
        "the input gradient's accumulator, run by column blocks, takes this share of L1d per "
        "block (`tile_budgets`): 40 KB blocks ran 1024x2816 at 90% at 44-47 GFLOP/s against "
        "30 whole (accumulator in L2) and 41-42 with 32 KB; 24 KB blocks lost (short rows per "
        "block); whether the blocks run at all is measured per shape (`kernel_variants.py`)",
    ),
    "busy_core": Tuned(
        0.5,
        "benchmarks/bench_threads.py (2-core Intel Xeon VM, 2026-11-23) for the start-time "
        "choice; the device applies it per kernel call",
        "a core other processes use at least this much of counts as busy: a kernel thread "
        "sharing it stalls every parallel region it is in",
    ),
    "close_repeats": Tuned(10, "design", "extra interleaved rounds for a close call"),
    "variant_rounds": Tuned(
        2,
        "design",
        "timed runs of each kernel variant on its first call (`kernel_variants.py`); the best "
        "of them is its score",
    ),
    "repeats": Tuned(5, "design", "timed rounds per candidate (after one warm-up round)"),
    "few_tokens": Tuned(16, "design", "calls of at most this many tokens count as decode"),
    "runner_calls": Tuned(
        8, "design", "calls per timed decode sample: one call is below timer and scheduler noise"
    ),
    "decode_stream_caches": Tuned(
        2,
        "python benchmarks/bench_wse_decode.py --dim 1024 --sparsities 0.5 (2-core AMD EPYC VM, "
        "32 MB L3, 2026-11-27)",
        "few-token inference is timed through copies of the layer filling this many times the "
        "last-level cache, so weights stream from memory as in a model's decode; the bytes rule "
        "it replaces for such layers (a sparse path only below half the dense bytes, from an "
        "Intel Xeon) kept every 50% layer dense here, where the one-token kernel runs the "
        "model's token 2.2x faster than dense",
    ),
    "decode_stream_copies": Tuned(
        64,
        "python benchmarks/bench_wse_decode.py (the recipe model, dim 128; AMD EPYC, 2026-11-27)",
        "at most this many copies of a layer in a streamed decode timing; a smaller layer keeps "
        "the bytes rule: streamed 128x352 layers timed the one-token kernel faster, which made "
        "the recipe model's decode (in cache) 0.86x dense against 0.92x with the rule",
    ),
}


def unsupported_reason(
    path: str, device_type: str, dtype: torch.dtype, native_reason: str | None
) -> str | None:
    """Why ``path`` cannot run on inputs of ``device_type``/``dtype`` (None when it can);
    ``native_reason`` is why the native library is unavailable (None when it loaded)."""
    floats = (torch.float32, torch.float64)
    if path == "compiled":
        if device_type != "cpu" or dtype not in floats:
            got = f"{device_type} {dtype}"
            return f"the compiled kernels need CPU float32/float64 tensors, got {got}"
        return native_reason
    if path == "torch" and device_type == "cpu" and dtype not in floats:
        return f"PyTorch's CPU CSR kernels need float32/float64 tensors, got {dtype}"
    return None


def autotune_key(
    device_type: str,
    dtype: torch.dtype,
    shape: tuple[int, int],
    nnz: int,
    tokens: int,
    requires_grad: bool,
    mode: str,
) -> tuple:
    """The key one "auto" choice is cached under: quarter-octave density buckets and power-of-two
    token buckets, so a GMP schedule or a short last batch reuses a choice instead of
    re-measuring. ``mode`` counts for training calls only: "masked" (`sparse_linear`: dense
    masks weight and gradient), "kept" (dense is plain ``F.linear`` under an algorithm),
    "compact" (the layer holds its kept values: dense builds the weight per call)."""
    numel = shape[0] * shape[1]
    density = max(nnz / numel if numel else 1.0, 1e-9)
    density_bucket = round(4 * math.log2(density))
    token_bucket = 1 << max(tokens - 1, 0).bit_length()
    return (
        device_type, dtype, shape, density_bucket, token_bucket, requires_grad,
        mode if requires_grad else "masked",
    )  # fmt: skip


def token_bucket_of(key: tuple) -> int:
    """The token count a key's candidates are timed at."""
    return key[4]


def decode_forces_dense(
    shape: tuple[int, int], nnz: int, element_size: int, tokens: int, requires_grad: bool
) -> bool:
    """Whether a weight served in CSR (`csr_linear.runs_in_csr`) is served dense instead: its
    values plus column indices (16-bit where `narrow_columns`) exceed
    ``TUNED["decode_bytes_ratio"]`` of the dense weight's bytes. The device's "auto" applies it
    to few-token calls of layers too small to time beyond the cache (`decode_stream_copies`
    None); larger ones it times streamed."""
    if requires_grad or tokens > TUNED["few_tokens"].value:
        return False
    index_bytes = 2 if narrow_columns(shape[1]) else 4  # the one-token kernel's columns
    sparse_bytes = nnz * (element_size + index_bytes)
    return sparse_bytes > TUNED["decode_bytes_ratio"].value * shape[0] * shape[1] * element_size


def decode_stream_copies(
    layer_bytes: int, cache_bytes: int | None, tokens: int, requires_grad: bool
) -> int | None:
    """Copies of a layer the path timing cycles through: for few-token inference as many as
    fill ``TUNED["decode_stream_caches"]`` times the last-level cache of ``cache_bytes`` (None:
    unknown, taken as 32 MB), so each call reads its weights from memory as in a model's decode;
    None where that takes more than ``TUNED["decode_stream_copies"]`` (a layer this small
    belongs to a model that sits in cache: `decode_forces_dense` and one copy decide, as
    before); 1 for other calls (weights in cache, as in a many-token call)."""
    if requires_grad or tokens > TUNED["few_tokens"].value:
        return 1
    stream = TUNED["decode_stream_caches"].value * (cache_bytes or 32 << 20)
    copies = max(math.ceil(stream / max(layer_bytes, 1)), 1)
    return None if copies > TUNED["decode_stream_copies"].value else copies


DEFAULT_L1D = 32 << 10
"""L1 data cache assumed where sysfs gives none (an AMD EPYC's, Zen 4)."""
DEFAULT_L2 = 1 << 20
"""L2 assumed where sysfs gives none (the same)."""


@dataclass(frozen=True)
class TileBudgets:
    """Bytes the native kernels cut their tiles to (`native.py` sets them at load).

    Attributes:
        spmm: the forward's transposed input tile (features x tokens).
        sddmm: the weight gradient's transposed input tile.
        scatter_block: a column block of the input gradient's accumulator (features x tokens).
    """

    spmm: int
    sddmm: int
    scatter_block: int


def tile_budgets(l1d: int | None, l2: int | None) -> TileBudgets:
    """The kernels' tile budgets for a core with ``l1d`` bytes of L1 data cache and ``l2`` of
    L2 (None: unknown, `DEFAULT_L1D` / `DEFAULT_L2`): the transposed input tiles take
    ``TUNED["tile_l2_share"]`` of L2, an accumulator block ``TUNED["scatter_l1_share"]`` of
    L1d. Same sizes, same tiles, whichever CPU: 512 KB and 26.7 KB for 1 MB and 32 KB caches."""
    l2_bytes = l2 if l2 else DEFAULT_L2
    l1_bytes = l1d if l1d else DEFAULT_L1D
    tile = int(TUNED["tile_l2_share"].value * l2_bytes)
    return TileBudgets(tile, tile, int(TUNED["scatter_l1_share"].value * l1_bytes))


def variant_key(
    name: str, dtype: torch.dtype, shape: tuple[int, int], nnz: int, tokens: int
) -> tuple:
    """The key a kernel variant's measured choice (`kernel_variants.py`) is cached under:
    the kernel, dtype and shape, quarter-octave density and power-of-two token buckets (as
    `autotune_key`), so a GMP schedule or a short last batch reuses it."""
    _, _, _, density_bucket, token_bucket, _, _ = autotune_key(
        "cpu", dtype, shape, nnz, tokens, False, "masked"
    )
    return name, dtype, shape, density_bucket, token_bucket


def kernel_threads(requested: int, cpus: int, others_busy: float | None) -> int:
    """Threads for a kernel call: ``requested`` (torch's count) on a machine of ``cpus`` cores
    of which other processes keep ``others_busy`` busy (None: unknown), less every core they
    use at least ``TUNED["busy_core"]`` of; at least one."""
    if others_busy is None or requested <= 1:
        return max(requested, 1)
    free = math.ceil(cpus - others_busy - TUNED["busy_core"].value)
    return max(1, min(requested, free))


def margin(requires_grad: bool) -> float:
    """The share of dense's time a sparse path must save to be chosen."""
    return TUNED["margin_training" if requires_grad else "margin"].value


def close_call(best: dict[str, float]) -> bool:
    """Whether a sparse path's best time is within ``TUNED["close_call"]`` of dense's either
    way (then it is measured longer before the choice)."""
    if "dense" not in best:
        return False
    dense = best["dense"]
    share = TUNED["close_call"].value
    return any(
        abs(seconds - dense) <= share * dense for name, seconds in best.items() if name != "dense"
    )


def choose_path(best: dict[str, float], margin: float = TUNED["margin"].value) -> str:
    """The path "auto" picks from each candidate's best measured seconds: the fastest, except
    that "dense" (when measured) stays unless a sparse path beats it by more than ``margin``
    of its time."""
    fastest = min(best, key=lambda p: best[p])
    if "dense" in best and fastest != "dense" and best[fastest] >= (1.0 - margin) * best["dense"]:
        return "dense"
    return fastest
