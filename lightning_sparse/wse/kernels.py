"""Sparse linear layer over a `CSRWeight`, with autograd, on three interchangeable execution paths.

`sparse_linear(x, weight, mask_or_csr, bias)` equals masked dense training,
`F.linear(x, weight * mask, bias)`, in value and in gradients (`grad_weight` is dense with zeros at
pruned positions, so optimizers see exactly what masked dense training gives them), while only
kept weights cost FLOPs:

- forward        Y = X W^T                     walks the CSR of W
- input grad     grad_X = grad_Y W             same kernel on the CSR of W^T (`t_*` fields)
- weight grad    grad_W[i, j] = sum_t grad_Y[t, i] X[t, j] at kept (i, j) only (SDDMM)

Paths (see `PATHS`):
- "compiled": the C++/OpenMP kernels in `_CPP_SOURCE` (last section), compiled once per machine
  with the system C++ compiler into a cache directory and loaded with ctypes: a few seconds to
  build, no dependency on torch's C++ headers or ABI; OpenMP resolves to the runtime torch already
  loaded. CPU, float32/float64. Tokens are the vector dimension; each thread owns a token range.
- "torch": PyTorch's own CSR ops (`torch.sparse.mm`, `torch.sparse.sampled_addmm`); any device.
- "dense": `F.linear(x, weight * mask, bias)`, the reference and the winner for tiny layers.
- "auto" (default) times every available path once per (device, dtype, shape, density bucket,
  token bucket, grad) key on synthetic data of that shape and structure, then keeps the fastest,
  so the device is never slower than dense by more than timing noise.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_sparse.masking import zero_pruned_
from lightning_sparse.wse.csr import CSRWeight

PATHS = ("compiled", "torch", "dense")
PATH_ENV = "LIGHTNING_SPARSE_WSE_PATH"
"""Environment variable forcing a path: "auto" (default), "compiled", "torch" or "dense"."""

_AUTOTUNE_REPEATS = 5
_AUTOTUNE_CACHE: dict[tuple, str] = {}

# Native library settings (see the last section).
COMPILE_ENV = "LIGHTNING_SPARSE_WSE_COMPILE"
"""Set to "0" to never build or load the native library (the "compiled" path is then absent)."""
CACHE_ENV = "LIGHTNING_SPARSE_CACHE_DIR"
"""Directory for the built library; default `$XDG_CACHE_HOME/lightning_sparse` or `~/.cache/...`."""


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
        values: `[nnz]` kept values in CSR order; csr: their structure.
        weight, mask: the live dense weight and its bool mask (used by the "dense" path).
        bias: optional `[out]`.
    """
    out_features, in_features = csr.shape
    if path == "dense":
        # Masked training keeps pruned weights at exactly 0, so the weight itself is its masked
        # copy; checked once per runner (one pass), a masked copy is kept only if it differs.
        masked = zero_pruned_(weight.detach().clone(), mask)
        dense = weight.detach() if torch.equal(masked, weight) else masked
        del masked
        return lambda x: F.linear(x, dense, bias)
    if path != "compiled":
        return lambda x: sparse_linear_inference(x, values, csr, bias, path)
    spmm = _native_function("ls_spmm", values.dtype)
    bias = None if bias is None else bias.detach().contiguous()
    pointers = (csr.crow_indices.data_ptr(), csr.col_indices.data_ptr(), values.data_ptr())
    bias_pointer = None if bias is None else bias.data_ptr()
    keep = (csr, values, bias)  # the pointers stay valid while the runner lives

    def run(x: Tensor) -> Tensor:
        x2 = x.reshape(-1, in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        tokens = x2.shape[0]
        out = x2.new_empty(tokens, out_features)
        spmm(*pointers, x2.data_ptr(), bias_pointer, tokens, in_features, out_features,
             out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return out.view(*x.shape[:-1], out_features)

    run.keep = keep  # type: ignore[attr-defined]
    return run


def sparse_linear_inference(
    x: Tensor, values: Tensor, csr: CSRWeight, bias: Tensor | None, path: str
) -> Tensor:
    """`sparse_linear`'s forward without autograd, on prebuilt values: the decode fast path.

    No graph, no input checks and no gather of the kept values from the dense weight: the caller
    (the device's executor) has checked the shapes and keeps ``values`` current.

    Args:
        x: input `[..., in]`, float32/float64, on ``values``' device.
        values: `[nnz]` kept weight values in CSR order (`CSRWeight.gather_values`).
        csr: the structure; bias: optional `[out]`.
        path: a concrete path, "compiled", "torch" or "dense" (`resolve_path`).

    Returns:
        `[..., out]`, the forward of `sparse_linear` on the same weight.
    """
    out_features, in_features = csr.shape
    x2 = x.reshape(-1, in_features)
    if path == "dense":
        y2 = F.linear(x2, csr.to_dense(values), bias)
    else:
        y2 = _BACKENDS[path].matmul(
            csr.crow_indices, csr.col_indices, values, x2.contiguous(), out_features,
            None if bias is None else bias.contiguous(),
        )  # fmt: skip
    return y2.reshape(*x.shape[:-1], out_features)


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
    x: Tensor, weight: Tensor, csr: CSRWeight, path: str | None = None, requires_grad: bool = True
) -> str:
    """The concrete path ("compiled", "torch" or "dense") a `sparse_linear` call would take.

    Args:
        x: input `[..., in]`.
        weight: dense weight `[out, in]`.
        csr: structure of the mask.
        path: forced path, or "auto"/None to follow `LIGHTNING_SPARSE_WSE_PATH` (default "auto").
        requires_grad: whether the call will be differentiated (auto-tuning times fwd+bwd then).

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
    key = _autotune_key(x, csr, tokens, requires_grad)
    if key not in _AUTOTUNE_CACHE:
        candidates = [p for p in PATHS if _unsupported_reason(p, x) is None]
        _AUTOTUNE_CACHE[key] = _autotune(candidates, x, weight, csr, key[-2], requires_grad)
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
) -> str:
    """Fastest candidate on synthetic data of the real shapes and structure.

    Candidates run interleaved; each is scored by its best repeat, the least disturbed by other
    processes, which estimates its intrinsic cost better than the median on a shared machine.
    """
    if len(candidates) == 1:
        return candidates[0]
    generator = torch.Generator(device=x.device).manual_seed(0)
    kwargs = {"device": x.device, "dtype": x.dtype, "generator": generator}
    xs = torch.randn(tokens, csr.shape[1], **kwargs).requires_grad_(requires_grad)
    ws = torch.randn(csr.shape, **kwargs).requires_grad_(requires_grad)
    times: dict[str, list[float]] = {p: [] for p in candidates}
    if requires_grad:
        runs = {p: functools.partial(_time_once, p, xs, ws, csr, True) for p in candidates}
    else:  # what inference runs: a runner on pre-gathered values (`inference_runner`)
        values = csr.gather_values(ws)
        mask = csr.to_mask()
        runners = {p: inference_runner(p, values, csr, ws, mask, None) for p in candidates}
        runs = {p: functools.partial(_time_runner, runners[p], xs) for p in candidates}
    for repeat in range(_AUTOTUNE_REPEATS + 1):
        for p in candidates:
            elapsed = runs[p]()
            if repeat:  # the first round is warm-up (allocator, caches, thread pool)
                times[p].append(elapsed)
    return min(candidates, key=lambda p: min(times[p]))


def _time_runner(runner: Callable[[Tensor], Tensor], x: Tensor) -> float:
    _synchronize(x.device)
    start = time.perf_counter()
    with torch.no_grad():
        runner(x)
    _synchronize(x.device)
    return time.perf_counter() - start


def _time_once(path: str, x: Tensor, weight: Tensor, csr: CSRWeight, backward: bool) -> float:
    x.grad = weight.grad = None
    _synchronize(x.device)
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
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
    token bucket, grad)."""
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
        return zero_pruned_(weight.detach().clone(), mask)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return zero_pruned_(grad.clone(), mask), None


def _run_path(path: str, x: Tensor, weight: Tensor, csr: CSRWeight, bias: Tensor | None) -> Tensor:
    if path == "dense":
        return F.linear(x, _MaskedWeight.apply(weight, csr.to_mask()), bias)
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


# Tokens are the vector dimension: each kernel transposes a tile of T tokens of its token-major
# input into a feature-major buffer (row j = T contiguous tokens), so every kept weight costs T/L
# fused multiply-adds on contiguous vectors, and writes its output back token-major.
_CPP_SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include <omp.h>

// GCC/Clang vector extensions: one register = 64 bytes with AVX-512, else 32 (AVX2/NEON pairs).
#if defined(__AVX512F__)
#define LS_VECTOR_BYTES 64
#else
#define LS_VECTOR_BYTES 32
#endif

namespace {

template <typename S> struct VecOf;
template <> struct VecOf<float> {
  typedef float type __attribute__((vector_size(LS_VECTOR_BYTES)));
};
template <> struct VecOf<double> {
  typedef double type __attribute__((vector_size(LS_VECTOR_BYTES)));
};
template <typename S> using Vec = typename VecOf<S>::type;
template <typename S> constexpr int kLanes = LS_VECTOR_BYTES / sizeof(S);

template <typename S> inline Vec<S> load(const S* p) {
  Vec<S> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename S> inline void store(S* p, Vec<S> v) { std::memcpy(p, &v, sizeof v); }
template <typename S> inline S horizontal_sum(Vec<S> v) {
  S s = 0;
  for (int l = 0; l < kLanes<S>; ++l) s += v[l];
  return s;
}

// out[0..3] = horizontal sums of a0..a3, sharing shuffles across the four (a transpose-reduce).
template <typename S>
inline void reduce4(Vec<S> a0, Vec<S> a1, Vec<S> a2, Vec<S> a3, S* out) {
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector
  if constexpr (kLanes<S> == 16) {
    // Halves of (a0, a1) and of (a2, a3) added: 8 partial sums of each input.
    const Vec<S> s01 =
        __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15,
                                24, 25, 26, 27, 28, 29, 30, 31);
    const Vec<S> s23 =
        __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15,
                                24, 25, 26, 27, 28, 29, 30, 31);
    // 4 partial sums of each input, then pairs and neighbours within each group of 4 lanes.
    const Vec<S> s =
        __builtin_shufflevector(s01, s23, 0, 1, 2, 3, 8, 9, 10, 11,
                                16, 17, 18, 19, 24, 25, 26, 27) +
        __builtin_shufflevector(s01, s23, 4, 5, 6, 7, 12, 13, 14, 15,
                                20, 21, 22, 23, 28, 29, 30, 31);
    const Vec<S> t =
        s + __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const Vec<S> u =
        t + __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] += u[0]; out[1] += u[4]; out[2] += u[8]; out[3] += u[12];
    return;
  } else if constexpr (kLanes<S> == 8) {
    const Vec<S> s01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    const Vec<S> s23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    const Vec<S> s = __builtin_shufflevector(s01, s23, 0, 1, 4, 5, 8, 9, 12, 13) +
                     __builtin_shufflevector(s01, s23, 2, 3, 6, 7, 10, 11, 14, 15);
    const Vec<S> u = s + __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] += u[0]; out[1] += u[2]; out[2] += u[4]; out[3] += u[6];
    return;
  } else if constexpr (kLanes<S> == 4) {
    const Vec<S> s01 =
        __builtin_shufflevector(a0, a1, 0, 1, 4, 5) + __builtin_shufflevector(a0, a1, 2, 3, 6, 7);
    const Vec<S> s23 =
        __builtin_shufflevector(a2, a3, 0, 1, 4, 5) + __builtin_shufflevector(a2, a3, 2, 3, 6, 7);
    const Vec<S> s = __builtin_shufflevector(s01, s23, 0, 2, 4, 6) +
                     __builtin_shufflevector(s01, s23, 1, 3, 5, 7);
    out[0] += s[0]; out[1] += s[1]; out[2] += s[2]; out[3] += s[3];
    return;
  }
#endif
  out[0] += horizontal_sum<S>(a0); out[1] += horizontal_sum<S>(a1);
  out[2] += horizontal_sum<S>(a2); out[3] += horizontal_sum<S>(a3);
}

struct Buffer {  // 64-byte aligned scratch memory, freed on scope exit
  void* ptr;
  explicit Buffer(size_t bytes)
      : ptr(std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64))) {}
  ~Buffer() { std::free(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

constexpr int64_t kRowBlock = 16;  // output rows per work item (one cache line of floats)
constexpr int64_t kColBlock = 32;  // features per transpose work item
// The kernels are bound by L2 bandwidth (one vector load per FMA), so the randomly accessed
// transposed tile (K features x T tokens) is sized to stay in a 512 KiB share of L2. SDDMM streams
// its gradient tile row by row, so only its X tile counts.
constexpr int64_t kTileBudget = 512 << 10;
constexpr int64_t kMinTokensPerThread = 32;

// One thread for small problems: a parallel region costs microseconds, and when the cores are
// oversubscribed a descheduled team member stalls the team for a whole time slice.
inline int threads_for(int64_t nnz, int64_t N, int64_t features, int threads) {
  const int64_t work = (nnz + features) * std::max<int64_t>(N, 1);
  return work < (int64_t{1} << 18) ? 1 : std::max(threads, 1);
}

// Largest vectors-per-tile (1, 2, 4 or 8) whose transposed tile of `features` rows fits the budget.
template <typename S>
int max_vectors(int64_t features) {
  int nv = 8;
  const int64_t bytes_per_vector = static_cast<int64_t>(sizeof(S)) * features * kLanes<S>;
  while (nv > 1 && bytes_per_vector * nv > kTileBudget) nv /= 2;
  return nv;
}

// Smallest power of two vectors covering tn tokens, at most cap: a short last tile stays cheap.
template <typename S>
int vectors_for(int64_t tn, int cap) {
  int nv = 1;
  while (nv < cap && nv * kLanes<S> < tn) nv *= 2;
  return nv;
}

// Calls f(std::integral_constant<int, NV>) for the runtime nv in {1, 2, 4, 8}.
template <typename F>
inline auto with_vectors(int nv, F&& f) {
  switch (nv) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector
#define LS_REGISTER_TRANSPOSE 1
// Lane e of the lo (HI=false) or hi output of one level of an L x L register transpose that swaps
// off-diagonal blocks of size B between rows i and i + B (indices into the concatenation a:b).
template <int L, int B, bool HI>
constexpr int transpose_index(int e) {
  return ((e / B) / 2 * 2 + (HI ? 1 : 0)) * B + e % B + ((e / B) % 2 ? L : 0);
}
template <typename S, int B, bool HI, size_t... I>
inline Vec<S> transpose_shuffle(Vec<S> a, Vec<S> b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, transpose_index<kLanes<S>, B, HI>(I)...);
}
// Transposes the L x L block held in r[0..L) (row i = r[i]) in registers.
template <typename S, int B = kLanes<S> / 2>
inline void transpose_block(Vec<S>* r) {
  constexpr int L = kLanes<S>;
  for (int g = 0; g < L; g += 2 * B) {
    for (int i = g; i < g + B; ++i) {
      constexpr auto lanes = std::make_index_sequence<L>{};
      const Vec<S> lo = transpose_shuffle<S, B, false>(r[i], r[i + B], lanes);
      const Vec<S> hi = transpose_shuffle<S, B, true>(r[i], r[i + B], lanes);
      r[i] = lo;
      r[i + B] = hi;
    }
  }
  if constexpr (B > 1) transpose_block<S, B / 2>(r);
}
#else
#define LS_REGISTER_TRANSPOSE 0
#endif

// dst[k * T + t] = src[(n0 + t) * ld + k] for k in [k0, k1), t < tn; zero-pads tokens tn..T-1 so
// the kernels always run full-width vectors. Full L x L blocks go through registers (about twice
// as fast as strided scalar copies); the output side stays scalar, where register transposes
// lost to 4 KiB-strided vector stores.
template <typename S, int T>
inline void transpose_tile(const S* src, int64_t ld, int64_t n0, int64_t tn, int64_t k0, int64_t k1,
                           S* dst) {
  constexpr int L = kLanes<S>;
  for (int64_t kb = k0; kb < k1; kb += kColBlock) {
    const int64_t ke = std::min(kb + kColBlock, k1);
    int64_t t = 0;
#if LS_REGISTER_TRANSPOSE
    if (ke - kb == kColBlock) {
      for (; t + L <= tn; t += L) {
        for (int64_t k = kb; k < ke; k += L) {
          Vec<S> r[L];
          for (int i = 0; i < L; ++i) r[i] = load<S>(src + (n0 + t + i) * ld + k);
          transpose_block<S>(r);
          for (int i = 0; i < L; ++i) store<S>(dst + (k + i) * T + t, r[i]);
        }
      }
    }
#endif
    for (; t < tn; ++t) {
      const S* s = src + (n0 + t) * ld;
      for (int64_t k = kb; k < ke; ++k) dst[k * T + t] = s[k];
    }
    for (int64_t k = kb; k < ke; ++k)
      for (int64_t u = tn; u < T; ++u) dst[k * T + u] = S(0);
  }
}

// --- Y [N, M] = X [N, K] @ S^T (+ bias) for S [M, K] in CSR (crow, col, val) ---------------------

// Rows [i0, i1) of the output tile of tokens [n0, n0 + tn), from the transposed input tile xt.
template <typename S, int NV>
void spmm_rows(const int32_t* crow, const int32_t* col, const S* val, const S* bias, const S* xt,
               int64_t i0, int64_t i1, int64_t n0, int64_t tn, int64_t M, S* Y) {
  constexpr int L = kLanes<S>;
  constexpr int T = NV * L;
  constexpr int U = NV >= 8 ? 1 : 8 / NV;  // accumulator sets: 8 independent FMA chains in flight
  alignas(64) S block[kRowBlock * T];
  for (int64_t ib = i0; ib < i1; ib += kRowBlock) {
    const int64_t ie = std::min(ib + kRowBlock, i1);
    for (int64_t i = ib; i < ie; ++i) {
      Vec<S> acc[U][NV];
      for (int u = 0; u < U; ++u)
        for (int v = 0; v < NV; ++v) acc[u][v] = Vec<S>{};
      int32_t k = crow[i];
      const int32_t end = crow[i + 1];
      for (; k + U <= end; k += U) {
        for (int u = 0; u < U; ++u) {
          const Vec<S> w = Vec<S>{} + val[k + u];
          const S* xr = xt + static_cast<int64_t>(col[k + u]) * T;
          for (int v = 0; v < NV; ++v) acc[u][v] += w * load<S>(xr + v * L);
        }
      }
      for (; k < end; ++k) {
        const Vec<S> w = Vec<S>{} + val[k];
        const S* xr = xt + static_cast<int64_t>(col[k]) * T;
        for (int v = 0; v < NV; ++v) acc[0][v] += w * load<S>(xr + v * L);
      }
      const Vec<S> b = Vec<S>{} + (bias != nullptr ? bias[i] : S(0));
      for (int v = 0; v < NV; ++v) {
        for (int u = 1; u < U; ++u) acc[0][v] += acc[u][v];
        store<S>(block + (i - ib) * T + v * L, acc[0][v] + b);
      }
    }
    for (int64_t t = 0; t < tn; ++t) {  // back to token-major, one cache line per token
      S* yr = Y + (n0 + t) * M + ib;
      for (int64_t r = 0; r < ie - ib; ++r) yr[r] = block[r * T + t];
    }
  }
}

template <typename S>
void spmm(const int32_t* crow, const int32_t* col, const S* val, const S* X, const S* bias,
          int64_t N, int64_t K, int64_t M, S* Y, int threads) {
  const int cap = max_vectors<S>(K);
  const int64_t T_cap = cap * kLanes<S>;
  threads = threads_for(crow[M], N, K + M, threads);
  if (threads == 1 || N >= threads * kMinTokensPerThread) {
    // Token-parallel: threads take tiles of tokens one at a time (each tile is independent, so
    // the result does not depend on who computes it), each into a private transposed buffer; a
    // thread the OS deschedules on a busy machine then simply takes fewer tiles.
    const int64_t tiles = (N + T_cap - 1) / T_cap;
#pragma omp parallel num_threads(threads)
    {
      Buffer xbuf(sizeof(S) * K * T_cap);
      S* xt = static_cast<S*>(xbuf.ptr);
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t n0 = tile * T_cap;
        const int64_t tn = std::min(T_cap, N - n0);
        with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
          constexpr int T = decltype(nv)::value * kLanes<S>;
          transpose_tile<S, T>(X, K, n0, tn, 0, K, xt);
          spmm_rows<S, decltype(nv)::value>(crow, col, val, bias, xt, 0, M, n0, tn, M, Y);
        });
      }
    }
    return;
  }
  // Few tokens: threads share each tile and split its rows (two barriers per tile).
  Buffer xbuf(sizeof(S) * K * T_cap);
  S* xt = static_cast<S*>(xbuf.ptr);
#pragma omp parallel num_threads(threads)
  for (int64_t n0 = 0; n0 < N; n0 += T_cap) {
    const int64_t tn = std::min(T_cap, N - n0);
    with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
      constexpr int T = decltype(nv)::value * kLanes<S>;
#pragma omp for schedule(static)
      for (int64_t kb = 0; kb < K; kb += kColBlock)
        transpose_tile<S, T>(X, K, n0, tn, kb, std::min(kb + kColBlock, K), xt);
#pragma omp for schedule(dynamic, 1)
      for (int64_t ib = 0; ib < M; ib += kRowBlock)
        spmm_rows<S, decltype(nv)::value>(crow, col, val, bias, xt, ib, std::min(ib + kRowBlock, M),
                                          n0, tn, M, Y);
    });
  }
}

// --- D [M, K] = (G^T @ X) at the kept positions of (crow, col), zero elsewhere ------------------

// vals[k] += dot over the tile's tokens of G column i and X column col[k], for rows [i0, i1).
template <typename S, int NV>
void sddmm_rows(const int32_t* crow, const int32_t* col, const S* gt, const S* xt, int64_t i0,
                int64_t i1, S* vals) {
  constexpr int L = kLanes<S>;
  constexpr int T = NV * L;
  for (int64_t i = i0; i < i1; ++i) {
    Vec<S> g[NV];
    for (int v = 0; v < NV; ++v) g[v] = load<S>(gt + i * T + v * L);
    int32_t k = crow[i];
    const int32_t end = crow[i + 1];
    // Four dot products at a time: four independent FMA chains sharing g, one shared reduction.
    for (; k + 4 <= end; k += 4) {
      const S* x0 = xt + static_cast<int64_t>(col[k]) * T;
      const S* x1 = xt + static_cast<int64_t>(col[k + 1]) * T;
      const S* x2 = xt + static_cast<int64_t>(col[k + 2]) * T;
      const S* x3 = xt + static_cast<int64_t>(col[k + 3]) * T;
      Vec<S> a0{}, a1{}, a2{}, a3{};
      for (int v = 0; v < NV; ++v) {
        a0 += g[v] * load<S>(x0 + v * L);
        a1 += g[v] * load<S>(x1 + v * L);
        a2 += g[v] * load<S>(x2 + v * L);
        a3 += g[v] * load<S>(x3 + v * L);
      }
      reduce4<S>(a0, a1, a2, a3, vals + k);
    }
    for (; k < end; ++k) {
      const S* x0 = xt + static_cast<int64_t>(col[k]) * T;
      Vec<S> a0{};
      for (int v = 0; v < NV; ++v) a0 += g[v] * load<S>(x0 + v * L);
      vals[k] += horizontal_sum<S>(a0);
    }
  }
}

template <typename S>
int sddmm(const int32_t* crow, const int32_t* col, const S* G, const S* X, int64_t N, int64_t K,
          int64_t M, S* D, int threads) {
  const int cap = max_vectors<S>(K);
  const int64_t T_cap = cap * kLanes<S>;
  const int64_t nnz = crow[M];
  threads = threads_for(nnz, N, K + M, threads);
  const bool token_parallel = threads == 1 || N >= threads * kMinTokensPerThread;
  // Token-parallel threads each sum their own tokens into a private copy of the values.
  Buffer vbuf(sizeof(S) * nnz * (token_parallel ? threads : 1));
  Buffer gshared(token_parallel ? 0 : sizeof(S) * M * T_cap);
  Buffer xshared(token_parallel ? 0 : sizeof(S) * K * T_cap);
  if (!vbuf.ptr || !gshared.ptr || !xshared.ptr) return 1;
  S* partial = static_cast<S*>(vbuf.ptr);
  int team = 1;
#pragma omp parallel num_threads(threads)
  {
    if (token_parallel) {
      const int me = omp_get_thread_num();
#pragma omp single
      team = omp_get_num_threads();
      const int64_t a = N * me / team, b = N * (me + 1) / team;
      S* vals = partial + nnz * me;
      std::memset(vals, 0, sizeof(S) * nnz);
      Buffer gbuf(sizeof(S) * M * T_cap), xbuf(sizeof(S) * K * T_cap);
      S* gt = static_cast<S*>(gbuf.ptr);
      S* xt = static_cast<S*>(xbuf.ptr);
      for (int64_t n0 = a; n0 < b; n0 += T_cap) {
        const int64_t tn = std::min(T_cap, b - n0);
        with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
          constexpr int T = decltype(nv)::value * kLanes<S>;
          transpose_tile<S, T>(X, K, n0, tn, 0, K, xt);
          transpose_tile<S, T>(G, M, n0, tn, 0, M, gt);
          sddmm_rows<S, decltype(nv)::value>(crow, col, gt, xt, 0, M, vals);
        });
      }
#pragma omp barrier
    } else {
      S* gt = static_cast<S*>(gshared.ptr);
      S* xt = static_cast<S*>(xshared.ptr);
#pragma omp for schedule(static)
      for (int64_t k = 0; k < nnz; ++k) partial[k] = S(0);
      for (int64_t n0 = 0; n0 < N; n0 += T_cap) {
        const int64_t tn = std::min(T_cap, N - n0);
        with_vectors(vectors_for<S>(tn, cap), [&](auto nv) {
          constexpr int T = decltype(nv)::value * kLanes<S>;
#pragma omp for schedule(static) nowait
          for (int64_t kb = 0; kb < K; kb += kColBlock)
            transpose_tile<S, T>(X, K, n0, tn, kb, std::min(kb + kColBlock, K), xt);
#pragma omp for schedule(static)
          for (int64_t mb = 0; mb < M; mb += kColBlock)
            transpose_tile<S, T>(G, M, n0, tn, mb, std::min(mb + kColBlock, M), gt);
#pragma omp for schedule(dynamic, 1)
          for (int64_t ib = 0; ib < M; ib += kRowBlock)
            sddmm_rows<S, decltype(nv)::value>(crow, col, gt, xt, ib, std::min(ib + kRowBlock, M),
                                               partial);
        });
      }
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      S* row = D + i * K;
      std::memset(row, 0, sizeof(S) * K);
      for (int32_t k = crow[i]; k < crow[i + 1]; ++k) {
        S sum = partial[k];
        for (int t = 1; t < team; ++t) sum += partial[nnz * t + k];
        row[col[k]] = sum;
      }
    }
  }
  return 0;
}

// --- CSR structure of a bool mask ---------------------------------------------------------------

// Bit k of the result is byte k of w, for bytes that are 0 or 1 (torch.bool): the multiply moves
// byte k's low bit to bit 56 + k without carries.
inline uint32_t byte_bits(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return static_cast<uint32_t>((w * 0x0102040810204080ULL) >> 56);
}

// Row pointers crow [M + 1] of the kept (nonzero) bytes of mask [M, K]; returns nnz.
// Masks below this many entries are built on one thread: a parallel region costs microseconds,
// and on a busy machine a descheduled team member stalls it for a whole time slice.
constexpr int64_t kParallelMaskMin = int64_t{1} << 18;
inline int mask_threads(int64_t M, int64_t K, int threads) {
  return M * K < kParallelMaskMin ? 1 : std::max(1, threads);
}
int64_t csr_count(const uint8_t* mask, int64_t M, int64_t K, int32_t* crow, int threads) {
  threads = mask_threads(M, K, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < M; ++i) {
    const uint8_t* row = mask + i * K;
    int32_t count = 0;
    for (int64_t j = 0; j < K; ++j) count += row[j];
    crow[i + 1] = count;
  }
  crow[0] = 0;
  for (int64_t i = 0; i < M; ++i) crow[i + 1] += crow[i];
  return crow[M];
}

// Given crow: col and flat (= i * K + j) in CSR order, then the transposed structure: t_crow
// [K + 1], t_col (row of W) and t_perm (CSR position) in CSC order, rows ascending per column.
int csr_fill(const uint8_t* mask, int64_t M, int64_t K, const int32_t* crow, int32_t* col,
             int32_t* flat, int32_t* t_crow, int32_t* t_col, int32_t* t_perm, int threads) {
  threads = mask_threads(M, K, threads);
  Buffer hbuf(sizeof(int32_t) * K * threads), rbuf(sizeof(int32_t) * M * threads);
  if (!hbuf.ptr || !rbuf.ptr) return 1;
  int32_t* hist = static_cast<int32_t*>(hbuf.ptr);
  constexpr int64_t kCols = 64;   // columns per CSC block: 2 x 64 write streams stay in L1
  constexpr int64_t kBand = 128;  // rows per band: the band's CSR indices stay in L2
#pragma omp parallel num_threads(threads)
  {
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
    int32_t* counts = hist + K * me;
    std::memset(counts, 0, sizeof(int32_t) * K);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      const uint8_t* row = mask + i * K;
      int32_t p = crow[i];
      const auto emit = [&](int64_t j) {
        col[p] = static_cast<int32_t>(j);
        flat[p++] = static_cast<int32_t>(i * K + j);
        ++counts[j];
      };
      int64_t j = 0;
      for (; j + 64 <= K; j += 64) {  // one unpredictable loop exit per 64 columns
        uint64_t bits = 0;
        for (int b = 0; b < 8; ++b)
          bits |= static_cast<uint64_t>(byte_bits(row + j + 8 * b)) << (8 * b);
        for (; bits != 0; bits &= bits - 1) emit(j + __builtin_ctzll(bits));
      }
      for (; j < K; ++j)
        if (row[j]) emit(j);
    }  // implicit barrier: all column counts are in
#pragma omp single
    {
      int32_t start = 0;
      for (int64_t j = 0; j < K; ++j) {
        t_crow[j] = start;
        for (int t = 0; t < team; ++t) start += hist[K * t + j];
      }
      t_crow[K] = start;
    }  // implicit barrier: t_crow is complete
    // Each thread owns a contiguous range of column blocks, so its CSC output ranges are private.
    const int64_t blocks = (K + kCols - 1) / kCols;
    const int64_t c0 = std::min(K, blocks * me / team * kCols);
    const int64_t c1 = std::min(K, blocks * (me + 1) / team * kCols);
    int32_t* next = static_cast<int32_t*>(rbuf.ptr) + M * me;  // per-row CSR read cursor
    for (int64_t i = 0; i < M; ++i)
      next[i] = static_cast<int32_t>(std::lower_bound(col + crow[i], col + crow[i + 1], c0) - col);
    int32_t* cursor = counts;  // reused as the CSC write cursor of each of this thread's columns
    for (int64_t j = c0; j < c1; ++j) cursor[j] = t_crow[j];
    for (int64_t i0 = 0; i0 < M; i0 += kBand) {
      const int64_t i1 = std::min(i0 + kBand, M);
      for (int64_t cb = c0; cb < c1; cb += kCols) {
        const int32_t ce = static_cast<int32_t>(std::min(cb + kCols, c1));
        for (int64_t i = i0; i < i1; ++i) {
          int32_t p = next[i];
          for (const int32_t end = crow[i + 1]; p < end && col[p] < ce; ++p) {
            const int32_t d = cursor[col[p]]++;
            t_col[d] = static_cast<int32_t>(i);
            t_perm[d] = p;
          }
          next[i] = p;
        }
      }
    }
  }
  return 0;
}

}  // namespace

// --- Kept values of a dense W [M, K] in CSR order (rows) or in transposed-CSR order (columns) ---
template <typename S>
void gather(const int32_t* crow, const int32_t* col, const S* W, int64_t M, int64_t K, S* out,
            int threads) {
  const int team = threads_for(crow[M], 1, M, threads);
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int64_t i = 0; i < M; ++i) {
    const S* w = W + i * K;
    for (int32_t k = crow[i]; k < crow[i + 1]; ++k) out[k] = w[col[k]];
  }
}
template <typename S>
void gather_t(const int32_t* t_crow, const int32_t* t_col, const S* W, int64_t M, int64_t K,
              S* out, int threads) {
  const int team = threads_for(t_crow[K], 1, K, threads);
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int64_t j = 0; j < K; ++j)
    for (int32_t k = t_crow[j]; k < t_crow[j + 1]; ++k) out[k] = W[int64_t{t_col[k]} * K + j];
}
extern "C" {
void ls_gather_f32(const int32_t* crow, const int32_t* col, const float* W, int64_t M, int64_t K,
                   float* out, int threads) {
  gather<float>(crow, col, W, M, K, out, threads);
}
void ls_gather_f64(const int32_t* crow, const int32_t* col, const double* W, int64_t M, int64_t K,
                   double* out, int threads) {
  gather<double>(crow, col, W, M, K, out, threads);
}
void ls_gather_t_f32(const int32_t* t_crow, const int32_t* t_col, const float* W, int64_t M,
                     int64_t K, float* out, int threads) {
  gather_t<float>(t_crow, t_col, W, M, K, out, threads);
}
void ls_gather_t_f64(const int32_t* t_crow, const int32_t* t_col, const double* W, int64_t M,
                     int64_t K, double* out, int threads) {
  gather_t<double>(t_crow, t_col, W, M, K, out, threads);
}
int64_t ls_csr_count(const uint8_t* mask, int64_t M, int64_t K, int32_t* crow, int threads) {
  return csr_count(mask, M, K, crow, threads);
}
int ls_csr_fill(const uint8_t* mask, int64_t M, int64_t K, const int32_t* crow, int32_t* col,
                int32_t* flat, int32_t* t_crow, int32_t* t_col, int32_t* t_perm, int threads) {
  return csr_fill(mask, M, K, crow, col, flat, t_crow, t_col, t_perm, threads);
}
void ls_spmm_f32(const int32_t* crow, const int32_t* col, const float* val, const float* X,
                 const float* bias, int64_t N, int64_t K, int64_t M, float* Y, int threads) {
  spmm<float>(crow, col, val, X, bias, N, K, M, Y, threads);
}
void ls_spmm_f64(const int32_t* crow, const int32_t* col, const double* val, const double* X,
                 const double* bias, int64_t N, int64_t K, int64_t M, double* Y, int threads) {
  spmm<double>(crow, col, val, X, bias, N, K, M, Y, threads);
}
int ls_sddmm_f32(const int32_t* crow, const int32_t* col, const float* G, const float* X,
                 int64_t N, int64_t K, int64_t M, float* D, int threads) {
  return sddmm<float>(crow, col, G, X, N, K, M, D, threads);
}
int ls_sddmm_f64(const int32_t* crow, const int32_t* col, const double* G, const double* X,
                 int64_t N, int64_t K, int64_t M, double* D, int threads) {
  return sddmm<double>(crow, col, G, X, N, K, M, D, threads);
}
}
"""
