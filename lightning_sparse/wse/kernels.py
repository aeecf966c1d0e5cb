"""Sparse linear layer over a `CSRWeight`, with autograd, on three interchangeable execution paths.

`sparse_linear(x, weight, mask_or_csr, bias)` equals masked dense training,
`F.linear(x, weight * mask, bias)`, in value and in gradients (`grad_weight` is dense with zeros at
pruned positions, so optimizers see exactly what masked dense training gives them), while only
kept weights cost FLOPs:

- forward        Y = X W^T                     walks the CSR of W
- input grad     grad_X = grad_Y W             same kernel on the CSR of W^T (`t_*` fields)
- weight grad    grad_W[i, j] = sum_t grad_Y[t, i] X[t, j] at kept (i, j) only (SDDMM)

Paths (see `PATHS`):
- "compiled": the C++/OpenMP kernels in `csrc/wse_kernels.cpp`, compiled once per machine
  with the system C++ compiler into a cache directory and loaded with ctypes: a few seconds to
  build, no dependency on torch's C++ headers or ABI; OpenMP resolves to the runtime torch already
  loaded. CPU, float32/float64. Tokens are the vector dimension; threads take tiles of tokens.
- "torch": PyTorch's own CSR ops (`torch.sparse.mm`, `torch.sparse.sampled_addmm`); any device.
- "dense": `F.linear(x, weight * mask, bias)`, the reference and the winner for tiny layers.

Inference (no autograd) goes through `inference_runner`: a function per layer and token count on
pre-gathered values, which the device's executor keeps while nothing changes.
- "auto" (default) times every available path once per (device, dtype, shape, density bucket,
  token bucket, grad) key on synthetic data of that shape and structure, then keeps the fastest.
  "dense" is always a candidate (training and the inference runner alike), and a sparse path
  wins only if it beats dense by more than `AUTOTUNE_MARGIN` of dense's time
  (`AUTOTUNE_MARGIN_TRAINING` for fwd+bwd calls), so the device is
  never slower than dense by more than timing noise (at 50% density it usually runs dense).

Force a path with the `path=` argument or the `LIGHTNING_SPARSE_WSE_PATH` environment variable
("auto", "compiled", "torch", "dense"); `LIGHTNING_SPARSE_WSE_COMPILE=0` (read once per process)
never builds the native library. `resolve_path` reports which path a call takes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_sparse.core.masking import zero_pruned_
from lightning_sparse.wse.csr import CSRWeight

PATHS = ("compiled", "torch", "dense")
PATH_ENV = "LIGHTNING_SPARSE_WSE_PATH"
"""Environment variable forcing a path: "auto" (default), "compiled", "torch" or "dense"."""

_AUTOTUNE_REPEATS = 5
AUTOTUNE_MARGIN = 0.05
"""Share of dense's time by which a sparse path must beat "dense" for "auto" to choose it: a
sparse path within timing noise of dense is not worth its risk of being slower on the real run."""
AUTOTUNE_MARGIN_TRAINING = 0.2
"""The margin for fwd+bwd (training) calls: inside a training step a sparse layer pays costs its
timing alone misses (inputs no longer in cache, per-call work around the kernels). Measured on the
recipe model (2048 tokens, 1 thread, Intel Xeon): at 70% paths 8-12% faster alone made the whole
step 10% slower than dense."""
DECODE_BYTES_RATIO = 0.5
"""Few-token (decode) inference is memory-bound: inside a model each layer's weights stream from
memory, which the autotuner's repeated calls on one layer (weights in cache) do not see. A sparse
path is a candidate there only if its kept values and column indices are at most this share of
the dense weight's bytes. Measured on the 50M-parameter Llama (batch-1 decode, 2 threads, Intel
Xeon): at 50% (values + 16-bit indices = 0.75 of the dense bytes) one-token kernels 7-20% faster
alone made decode 0.85-0.91x dense; at 70% (0.45) they made it 1.12-1.42x."""
_AUTOTUNE_CACHE: dict[tuple, str] = {}

# Native library settings (see the last section).
COMPILE_ENV = "LIGHTNING_SPARSE_WSE_COMPILE"
"""Set to "0" to never build or load the native library (the "compiled" path is then absent)."""
CACHE_ENV = "LIGHTNING_SPARSE_CACHE_DIR"
"""Directory for the built library; default `$XDG_CACHE_HOME/lightning_sparse` or `~/.cache/...`."""
# The C++/OpenMP source, compiled once per machine (tokens are the vector dimension: each kernel
# transposes a tile of tokens into a feature-major buffer; see the file's header).
_CPP_SOURCE = (Path(__file__).parent / "csrc" / "wse_kernels.cpp").read_text()


def sparse_linear(
    x: Tensor,
    weight: Tensor,
    mask_or_csr: Tensor | CSRWeight,
    bias: Tensor | None = None,
    *,
    path: str | None = None,
) -> Tensor:
    """Masked linear layer `F.linear(x, weight * mask, bias)` executed in CSR.

    Args:
        x: input `[..., in]`.
        weight: dense weight `[out, in]` (the live parameter; values are gathered each call).
        mask_or_csr: bool mask `[out, in]` (True = kept; converted on every call) or a prebuilt
            `CSRWeight` (reuse it until the mask changes).
        bias: optional `[out]`.
        path: "compiled", "torch", "dense" or "auto"; None follows `LIGHTNING_SPARSE_WSE_PATH`.

    Returns:
        `[..., out]`. Gradients w.r.t. `x`, `weight` (dense, zero where pruned) and `bias` equal
        those of masked dense training.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices, or an unusable forced path.
    """
    csr = (
        mask_or_csr
        if isinstance(mask_or_csr, CSRWeight)
        else CSRWeight.from_dense(weight, mask_or_csr)
    )
    _check_inputs(x, weight, csr, bias)
    requires_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    chosen = resolve_path(x, weight, csr, path, requires_grad)
    return _run_path(chosen, x, weight, csr, bias)


def inference_runner(
    path: str, values: Tensor, csr: CSRWeight, weight: Tensor, mask: Tensor, bias: Tensor | None
) -> Callable[[Tensor], Tensor]:
    """A function ``x [..., in] -> [..., out]`` running `sparse_linear`'s forward without autograd
    on fixed ``values`` (the executor's decode fast path: per call only the output allocation and
    one native call, nothing re-checked; build a new runner when values, mask or path change).

    Args:
        path: "compiled", "torch" or "dense" (`resolve_path`).
        values: `[nnz]` kept values in CSR order (float32/float64, or bfloat16 storage of
            float32 values: every path computes in float32 with the rounded values; the
            compiled one-token kernel reads the bf16 values directly); csr: their structure.
        weight, mask: the live dense weight and its bool mask (used by the "dense" path).
        bias: optional `[out]`.
    """
    out_features, in_features = csr.shape
    if values.dtype == torch.bfloat16 and path != "compiled":
        # bf16 storage (`inference_dtype`): the same rounded values on every path.
        values = values.float()
        if path == "dense":
            dense = csr.to_dense(values)
            return lambda x: F.linear(x, dense, bias)
    if path == "dense":
        # Masked training keeps pruned weights at exactly 0, so the weight itself is its masked
        # copy; checked once per runner (one pass), a masked copy is kept only if it differs.
        masked = zero_pruned_(weight.detach().clone(), mask)
        dense = weight.detach() if torch.equal(masked, weight) else masked
        del masked
        return lambda x: F.linear(x, dense, bias)
    bias = None if bias is None else bias.detach().contiguous()
    if path != "compiled":
        matmul = _BACKENDS[path].matmul
        crow, col = csr.crow_indices, csr.col_indices

        def run_backend(x: Tensor) -> Tensor:
            x2 = x.reshape(-1, in_features).contiguous()
            y2 = matmul(crow, col, values, x2, out_features, bias)
            return y2.reshape(*x.shape[:-1], out_features)

        return run_backend
    stored = values  # bf16 storage: the one-token kernel widens it, other token counts get fp32
    if values.dtype == torch.bfloat16:
        values = values.float()
    spmm = _native_function("ls_spmm", values.dtype)
    pointers = (csr.crow_indices.data_ptr(), csr.col_indices.data_ptr(), values.data_ptr())
    bias_pointer = None if bias is None else bias.data_ptr()
    spmv, one_token = None, None
    if values.dtype == torch.float32:
        spmv, one_token = _one_token_layout(csr, stored)
        if stored.dtype == torch.bfloat16:
            values = pointers = None  # type: ignore[assignment]  # built on a prefill call
    keep = [csr, stored, values, bias, one_token]  # the pointers stay valid while it lives

    def run(x: Tensor) -> Tensor:
        x2 = x.reshape(-1, in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        tokens = x2.shape[0]
        out = x2.new_empty(tokens, out_features)
        if tokens == 1 and spmv is not None:
            spmv(*one_token[0], x2.data_ptr(), bias_pointer, out_features, out.data_ptr(),
                 torch.get_num_threads())  # fmt: skip
        else:
            ptrs = pointers
            if ptrs is None:  # bf16 storage: widen per multi-token call (prefill), not kept
                wide = stored.float()
                ptrs = (csr.crow_indices.data_ptr(), csr.col_indices.data_ptr(), wide.data_ptr())
            spmm(*ptrs, x2.data_ptr(), bias_pointer, tokens, in_features, out_features,
                 out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return out.view(*x.shape[:-1], out_features)

    run.keep = keep  # type: ignore[attr-defined]
    return run


def _one_token_layout(
    csr: CSRWeight, values: Tensor
) -> tuple[Callable[..., None], tuple[tuple[int, int, int], tuple[Tensor, ...]]]:
    """The native one-token kernel for ``csr`` and its operands: column indices as 16-bit
    (unsigned, held as int16 bit patterns) when ``in <= 65536``, else the int32 ones; values
    fp32 or bf16 as given. Returns (kernel, ((crow, col, values) pointers, tensors to keep))."""
    in_features = csr.shape[1]
    if in_features <= _U16_COLUMNS:
        col = csr.col_indices.to(torch.int16)  # the low 16 bits: the column as uint16
        index_kind = "u16"
    else:
        col, index_kind = csr.col_indices, "i32"
    values_kind = "bf16" if values.dtype == torch.bfloat16 else "f32"
    lib, reason = _native_library()
    if lib is None:
        raise RuntimeError(f"the compiled path is unavailable: {reason}")
    kernel = getattr(lib, f"ls_spmv_{values_kind}_{index_kind}")
    pointers = (csr.crow_indices.data_ptr(), col.data_ptr(), values.data_ptr())
    return kernel, (pointers, (col, values))


_U16_COLUMNS = 1 << 16
"""Widest weight whose column indices the one-token kernel stores in 16 bits."""


def _check_inputs(x: Tensor, weight: Tensor, csr: CSRWeight, bias: Tensor | None) -> None:
    if tuple(weight.shape) != csr.shape:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} != CSRWeight shape {csr.shape}; rebuild the "
            "CSRWeight with CSRWeight.from_dense(weight, mask)"
        )
    if x.dim() == 0 or x.shape[-1] != csr.shape[1]:
        raise ValueError(f"x must be [..., {csr.shape[1]}], got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        bias_dtype = None if bias is None else bias.dtype
        raise ValueError(
            f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, {bias_dtype}"
        )
    if not x.device == weight.device == csr.device:
        raise ValueError(
            f"x, weight and CSRWeight must share a device, got {x.device}, {weight.device}, "
            f"{csr.device}"
        )
    if bias is not None and tuple(bias.shape) != (csr.shape[0],):
        raise ValueError(f"bias must be [{csr.shape[0]}], got shape {tuple(bias.shape)}")


# --- Path selection -------------------------------------------------------------------------------
def _unsupported_reason(path: str, x: Tensor) -> str | None:
    """Why `path` cannot run on `x` (None when it can)."""
    if path == "compiled":
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
            return (
                f"the compiled kernels need CPU float32/float64 tensors, got {x.device} {x.dtype}"
            )
        return native_unavailable_reason()
    if path == "torch" and x.device.type == "cpu" and x.dtype not in (torch.float32, torch.float64):
        return f"PyTorch's CPU CSR kernels need float32/float64 tensors, got {x.dtype}"
    return None


def _requested_path(path: str | None) -> str:
    requested = path if path is not None else os.environ.get(PATH_ENV, "auto")
    if requested != "auto" and requested not in PATHS:
        source = "path argument" if path is not None else f"{PATH_ENV} environment variable"
        raise ValueError(f"{source} must be 'auto' or one of {PATHS}, got {requested!r}")
    return requested


def resolve_path(
    x: Tensor,
    weight: Tensor,
    csr: CSRWeight,
    path: str | None = None,
    requires_grad: bool = True,
    zeros_kept: bool = False,
) -> str:
    """The concrete path ("compiled", "torch" or "dense") a `sparse_linear` call would take.

    Args:
        x: input `[..., in]`.
        weight: dense weight `[out, in]`.
        csr: structure of the mask.
        path: forced path, or "auto"/None to follow `LIGHTNING_SPARSE_WSE_PATH` (default "auto").
        requires_grad: whether the call will be differentiated (auto-tuning times fwd+bwd then).
        zeros_kept: the caller runs "dense" as plain ``F.linear(x, weight, bias)``, because an
            algorithm already keeps the pruned weights and gradients at exactly 0 (the device's
            executor under a sparsity algorithm); "auto" then times that as dense's cost.

    Returns:
        The path. "auto" measures the candidates on first use of a key and caches the winner.

    Raises:
        ValueError: if the path name is unknown or a forced path cannot run on these tensors.
    """
    requested = _requested_path(path)
    if requested != "auto":
        reason = _unsupported_reason(requested, x)
        if reason is not None:
            raise ValueError(f"path {requested!r} cannot run here: {reason}")
        return requested
    tokens = x.numel() // max(x.shape[-1], 1)
    key = (*_autotune_key(x, csr, tokens, requires_grad), zeros_kept and requires_grad)
    if key not in _AUTOTUNE_CACHE:
        candidates = [p for p in PATHS if _unsupported_reason(p, x) is None]
        # "dense" has no unsupported reason: it is always a candidate, the fallback.
        _AUTOTUNE_CACHE[key] = _autotune(
            candidates, x, weight, csr, key[-3], requires_grad, zeros_kept
        )
    return _AUTOTUNE_CACHE[key]


def _autotune_key(x: Tensor, csr: CSRWeight, tokens: int, requires_grad: bool) -> tuple:
    # Quarter-octave density buckets and power-of-two token buckets: a GMP schedule or a short
    # last batch reuses the choice instead of re-measuring.
    density = max(1.0 - csr.sparsity, 1e-9)
    density_bucket = round(4 * math.log2(density))
    token_bucket = 1 << max(tokens - 1, 0).bit_length()
    return (x.device.type, x.dtype, csr.shape, density_bucket, token_bucket, requires_grad)


def _autotune(
    candidates: list[str],
    x: Tensor,
    weight: Tensor,
    csr: CSRWeight,
    tokens: int,
    requires_grad: bool,
    zeros_kept: bool = False,
) -> str:
    """Fastest candidate on synthetic data of the real shapes and structure.

    Candidates run interleaved; each is scored by its best repeat, the least disturbed by other
    processes, which estimates its intrinsic cost better than the median on a shared machine.
    """
    if not requires_grad and tokens <= _FEW_TOKENS and "dense" in candidates:
        index_bytes = 2 if csr.shape[1] <= 65536 else 4  # the one-token kernel's column indices
        sparse_bytes = csr.nnz * (x.element_size() + index_bytes)
        if sparse_bytes > DECODE_BYTES_RATIO * math.prod(csr.shape) * x.element_size():
            return "dense"  # see DECODE_BYTES_RATIO
    if len(candidates) == 1:
        return candidates[0]
    generator = torch.Generator(device=x.device).manual_seed(0)
    kwargs = {"device": x.device, "dtype": x.dtype, "generator": generator}
    xs = torch.randn(tokens, csr.shape[1], **kwargs).requires_grad_(requires_grad)
    ws = torch.randn(csr.shape, **kwargs).requires_grad_(requires_grad)
    times: dict[str, list[float]] = {p: [] for p in candidates}
    if requires_grad:
        runs = {
            p: functools.partial(_time_once, p, xs, ws, csr, True, zeros_kept) for p in candidates
        }
    else:  # what inference runs: a runner on pre-gathered values (`inference_runner`)
        values = csr.gather_values(ws)
        mask = csr.to_mask()
        runners = {p: inference_runner(p, values, csr, ws, mask, None) for p in candidates}
        calls = _RUNNER_CALLS if tokens <= _FEW_TOKENS else 1
        runs = {p: functools.partial(_time_runner, runners[p], xs, calls) for p in candidates}
    for repeat in range(_AUTOTUNE_REPEATS + 1):
        for p in candidates:
            elapsed = runs[p]()
            if repeat:  # the first round is warm-up (allocator, caches, thread pool)
                times[p].append(elapsed)
    if _close_call({p: min(ts) for p, ts in times.items()}):
        # A sparse path near dense's time: a noisy round could decide it, so measure longer.
        for _ in range(_AUTOTUNE_CLOSE_REPEATS):
            for p in candidates:
                times[p].append(runs[p]())
    margin = AUTOTUNE_MARGIN_TRAINING if requires_grad else AUTOTUNE_MARGIN
    return choose_path({p: min(ts) for p, ts in times.items()}, margin)


_AUTOTUNE_CLOSE_REPEATS = 10
_AUTOTUNE_CLOSE = 0.2
"""A sparse path whose best time is within this share of dense's either way is re-measured with
`_AUTOTUNE_CLOSE_REPEATS` more rounds before "auto" chooses."""


def _close_call(best: dict[str, float]) -> bool:
    if "dense" not in best:
        return False
    dense = best["dense"]
    return any(
        abs(seconds - dense) <= _AUTOTUNE_CLOSE * dense
        for name, seconds in best.items()
        if name != "dense"
    )


def choose_path(best: dict[str, float], margin: float = AUTOTUNE_MARGIN) -> str:
    """The path "auto" picks from each candidate's best measured seconds: the fastest, except
    that "dense" (when measured) stays unless a sparse path beats it by more than ``margin``
    of its time."""
    fastest = min(best, key=lambda p: best[p])
    if "dense" in best and fastest != "dense" and best[fastest] >= (1.0 - margin) * best["dense"]:
        return "dense"
    return fastest


_RUNNER_CALLS, _FEW_TOKENS = 8, 16
"""Calls per timed inference sample for calls of at most `_FEW_TOKENS` tokens: a one-token call
takes microseconds, below timer and scheduler noise on a shared machine."""


def _time_runner(runner: Callable[[Tensor], Tensor], x: Tensor, calls: int = 1) -> float:
    _synchronize(x.device)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(calls):
            runner(x)
    _synchronize(x.device)
    return time.perf_counter() - start


def _time_once(
    path: str, x: Tensor, weight: Tensor, csr: CSRWeight, backward: bool, zeros_kept: bool = False
) -> float:
    x.grad = weight.grad = None
    _synchronize(x.device)
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if path == "dense" and zeros_kept:  # what the executor runs then: no masking passes
            y = F.linear(x, weight)
        else:
            y = _run_path(path, x, weight, csr, None)
        if backward:
            y.sum().backward()
    _synchronize(x.device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clear_autotune_cache() -> None:
    """Forgets every "auto" choice, e.g. after changing `torch.set_num_threads`."""
    _AUTOTUNE_CACHE.clear()


def autotune_choices() -> dict[tuple, str]:
    """A copy of the "auto" choices made so far, keyed by (device, dtype, shape, density bucket,
    token bucket, grad, zeros kept)."""
    return dict(_AUTOTUNE_CACHE)


# --- Autograd -------------------------------------------------------------------------------------
class _SparseLinearFunction(torch.autograd.Function):
    """Y = X W^T + b on CSR data; gradients equal those of `F.linear(X, W * mask, b)`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x2: Tensor, weight: Tensor, bias: Tensor | None, csr: CSRWeight, backend: _Backend
    ) -> Tensor:
        x2 = x2.contiguous()
        weight = weight.detach()
        values = csr.gather_values(weight)
        bias = None if bias is None else bias.detach().contiguous()
        y2 = backend.matmul(csr.crow_indices, csr.col_indices, values, x2, csr.shape[0], bias)
        # The weight itself is saved (no copy of its values): autograd's version check raises if
        # it is written in place before backward, which gathers W^T's values from it.
        ctx.save_for_backward(x2, weight)
        ctx.csr, ctx.backend, ctx.has_bias = csr, backend, bias is not None
        return y2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y2: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        csr, backend = ctx.csr, ctx.backend
        grad_y2 = grad_y2.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            t_values = csr.gather_values_t(weight)  # raises on a forward-only structure
            t_crow, t_col = csr.t_crow_indices, csr.t_col_indices
            assert t_crow is not None and t_col is not None
            grad_x = backend.matmul(t_crow, t_col, t_values, grad_y2, csr.shape[1], None)
        if ctx.needs_input_grad[1]:
            grad_w = backend.sampled_grad(csr, grad_y2, x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y2.sum(0)
        return grad_x, grad_w, grad_b, None, None


class _MaskedWeight(torch.autograd.Function):
    """``weight * mask`` for a bool mask, by the bit-pattern multiply of `masking.zero_pruned_`
    (a bool-times-float product takes a slow type-promoting loop on the CPU)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(mask)
        return _masked_copy(weight, mask)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return _masked_copy(grad, mask), None


_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _masked_copy(t: Tensor, mask: Tensor) -> Tensor:
    """A new tensor: ``t`` with pruned positions exactly 0, in one pass (the bit pattern times
    the mask, NaN/inf-safe as `masking.zero_pruned_`), without a clone first."""
    int_dtype = _INT_VIEW.get(t.dtype)
    if int_dtype is None or type(t) not in (Tensor, torch.nn.Parameter):
        return zero_pruned_(t.detach().clone(), mask)
    # uint8, not bool: an out-of-place integer-times-bool product takes a slow promoting loop on
    # the CPU (about 3x the time of this one, measured at 1024 x 1024).
    return (t.detach().view(int_dtype) * mask.view(torch.uint8)).view(t.dtype)


# The bool mask of each structure the "dense" path runs on, kept while the structure lives:
# rebuilding it from the indices every call cost the dense path up to a fifth of a dense step
# (1024 x 1024 at 50%), which "auto" must not pay where it falls back to dense. Only structures
# that run dense hold one (1 byte per weight, a quarter of the fp32 weight the path reads anyway).
_DENSE_MASKS: weakref.WeakKeyDictionary[CSRWeight, Tensor] = weakref.WeakKeyDictionary()


def _dense_mask(csr: CSRWeight) -> Tensor:
    """``csr.to_mask()``, cached per structure (an inference-mode one is not reused outside
    inference mode, where autograd could not save it)."""
    mask = _DENSE_MASKS.get(csr)
    if mask is None or (mask.is_inference() and not torch.is_inference_mode_enabled()):
        mask = csr.to_mask()
        _DENSE_MASKS[csr] = mask
    return mask


def _run_path(path: str, x: Tensor, weight: Tensor, csr: CSRWeight, bias: Tensor | None) -> Tensor:
    if path == "dense":
        return F.linear(x, _MaskedWeight.apply(weight, _dense_mask(csr)), bias)
    out_features, in_features = csr.shape
    y2 = _SparseLinearFunction.apply(x.reshape(-1, in_features), weight, bias, csr, _BACKENDS[path])
    return y2.reshape(*x.shape[:-1], out_features)


# --- Backends -------------------------------------------------------------------------------------
class _Backend(NamedTuple):
    # matmul(crow, col, values, x2 [N, K], rows, bias) -> x2 @ S^T (+ bias) [N, rows] for
    # S [rows, K] in CSR.
    matmul: Callable[[Tensor, Tensor, Tensor, Tensor, int, Tensor | None], Tensor]
    # sampled_grad(csr, grad_y2 [N, out], x2 [N, in]) -> dense [out, in], zero where pruned.
    sampled_grad: Callable[[CSRWeight, Tensor, Tensor], Tensor]


def _torch_csr(crow: Tensor, col: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta" is noise for our callers
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)


def _torch_matmul(
    crow: Tensor, col: Tensor, values: Tensor, x2: Tensor, rows: int, bias: Tensor | None
) -> Tensor:
    sparse = _torch_csr(crow, col, values, (rows, x2.shape[1]))
    out = torch.sparse.mm(sparse, x2.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


def _torch_sampled_grad(csr: CSRWeight, grad_y2: Tensor, x2: Tensor) -> Tensor:
    pattern = _torch_csr(csr.crow_indices, csr.col_indices, x2.new_zeros(csr.nnz), csr.shape)
    values = torch.sparse.sampled_addmm(pattern, grad_y2.t(), x2, beta=0.0).values()
    return csr.to_dense(values)


def _compiled_matmul(
    crow: Tensor, col: Tensor, values: Tensor, x2: Tensor, rows: int, bias: Tensor | None
) -> Tensor:
    out = x2.new_empty(x2.shape[0], rows)
    _native_spmm(crow, col, values, x2, bias, out)
    return out


def _compiled_sampled_grad(csr: CSRWeight, grad_y2: Tensor, x2: Tensor) -> Tensor:
    dense = x2.new_empty(csr.shape)
    _native_sddmm(csr.crow_indices, csr.col_indices, grad_y2, x2, dense)
    return dense


_BACKENDS = {
    "torch": _Backend(_torch_matmul, _torch_sampled_grad),
    "compiled": _Backend(_compiled_matmul, _compiled_sampled_grad),
}


# --- Native library: build, load, call ------------------------------------------------------------
_CXX_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-march=native")


@functools.cache
def _native_library() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) once built and loaded, else (None, reason). Built at most once a process."""
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return None, f"disabled by {COMPILE_ENV}=0"
    try:
        lib = ctypes.CDLL(str(_build_native()))
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"building the native kernels failed: {error}"
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.ls_csr_count.argtypes = [pointer, size, size, pointer, ctypes.c_int]
    lib.ls_csr_count.restype = size
    lib.ls_csr_fill.argtypes = [pointer, size, size] + [pointer] * 6 + [ctypes.c_int]
    lib.ls_csr_fill.restype = ctypes.c_int
    for suffix in ("f32", "f64"):
        spmm = getattr(lib, f"ls_spmm_{suffix}")
        spmm.argtypes = [pointer] * 5 + [size] * 3 + [pointer, ctypes.c_int]
        spmm.restype = None
        sddmm = getattr(lib, f"ls_sddmm_{suffix}")
        sddmm.argtypes = [pointer] * 4 + [size] * 3 + [pointer, ctypes.c_int]
        sddmm.restype = ctypes.c_int
        for name in ("ls_gather", "ls_gather_t"):
            function = getattr(lib, f"{name}_{suffix}")
            function.argtypes = [pointer] * 3 + [size] * 2 + [pointer, ctypes.c_int]
            function.restype = None
    for values_kind in ("f32", "bf16"):
        for index_kind in ("u16", "i32"):
            spmv = getattr(lib, f"ls_spmv_{values_kind}_{index_kind}")
            spmv.argtypes = [pointer] * 5 + [size, pointer, ctypes.c_int]
            spmv.restype = None
    return lib, None


def native_unavailable_reason() -> str | None:
    """Why the "compiled" path is unavailable (None when it is available); builds on first call."""
    return _native_library()[1]


def compiled_available() -> bool:
    """Whether the native kernels are built and loaded (builds them on first call)."""
    return _native_library()[0] is not None


def _build_native() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler found; install g++ or set CXX")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    # -march=native code is only valid on this CPU, so the CPU is part of the cache key.
    fingerprint = "\0".join([_CPP_SOURCE, compiler, version, *_CXX_FLAGS, _cpu_signature()])
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    target = _cache_dir() / f"wse_kernels_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source, built = Path(tmp) / "wse_kernels.cpp", Path(tmp) / target.name
        source.write_text(_CPP_SOURCE)
        result = subprocess.run(
            [compiler, *_CXX_FLAGS, str(source), "-o", str(built)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} exited with {result.returncode}: {result.stderr[-2000:]}")
        # Atomic rename: concurrent builders (DDP ranks, test workers) never load a partial file.
        os.replace(built, target)
    return target


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_sparse"


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(
        sorted({line for line in lines if line.split(":")[0].strip() in wanted})
    )


def _native_function(name: str, dtype: torch.dtype) -> Callable[..., int | None]:
    lib, reason = _native_library()
    if lib is None:
        raise RuntimeError(f"the compiled path is unavailable: {reason}")
    return getattr(lib, f"{name}_{'f32' if dtype == torch.float32 else 'f64'}")


def native_csr_indices(mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """CSR structure of a CPU bool mask `[M, K]` by the native builder.

    Returns:
        int32 `(crow [M+1], col [nnz], flat [nnz], t_crow [K+1], t_col [nnz], t_perm [nnz])` as
        documented on `CSRWeight`.

    Raises:
        RuntimeError: if the native library is unavailable.
    """
    lib, reason = _native_library()
    if lib is None:
        raise RuntimeError(f"the compiled path is unavailable: {reason}")
    mask = mask.contiguous()
    rows, cols = mask.shape
    threads = torch.get_num_threads()
    crow = torch.empty(rows + 1, dtype=torch.int32)
    nnz = lib.ls_csr_count(mask.data_ptr(), rows, cols, crow.data_ptr(), threads)
    col, flat, t_col, t_perm = (torch.empty(nnz, dtype=torch.int32) for _ in range(4))
    t_crow = torch.empty(cols + 1, dtype=torch.int32)
    status = lib.ls_csr_fill(
        mask.data_ptr(), rows, cols, crow.data_ptr(), col.data_ptr(), flat.data_ptr(),
        t_crow.data_ptr(), t_col.data_ptr(), t_perm.data_ptr(), threads,
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native CSR builder could not allocate its work buffer")
    return crow, col, flat, t_crow, t_col, t_perm


def native_gather(
    pointers: Tensor, indices: Tensor, weight: Tensor, transposed: bool, out: Tensor
) -> None:
    """``out [nnz]`` = kept values of the contiguous CPU ``weight [M, K]`` in CSR order
    (``pointers``/``indices`` = crow/col) or transposed-CSR order (t_crow/t_col)."""
    name = "ls_gather_t" if transposed else "ls_gather"
    rows, cols = weight.shape
    _native_function(name, weight.dtype)(
        pointers.data_ptr(), indices.data_ptr(), weight.data_ptr(), rows, cols, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip


def _native_spmm(
    crow: Tensor, col: Tensor, values: Tensor, x2: Tensor, bias: Tensor | None, out: Tensor
) -> None:
    # out [N, M] = x2 [N, K] @ S^T (+ bias) for S [M, K] in CSR; all contiguous on the CPU.
    _native_function("ls_spmm", x2.dtype)(
        crow.data_ptr(), col.data_ptr(), values.data_ptr(), x2.data_ptr(),
        None if bias is None else bias.data_ptr(),
        x2.shape[0], x2.shape[1], out.shape[1], out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip


def _native_sddmm(crow: Tensor, col: Tensor, grad_y2: Tensor, x2: Tensor, out: Tensor) -> None:
    # out [M, K] = (grad_y2^T @ x2) at kept positions, zero elsewhere.
    status = _native_function("ls_sddmm", x2.dtype)(
        crow.data_ptr(), col.data_ptr(), grad_y2.data_ptr(), x2.data_ptr(),
        x2.shape[0], x2.shape[1], grad_y2.shape[1], out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native SDDMM kernel could not allocate its work buffers")
