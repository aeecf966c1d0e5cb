"""The device's native extension: `csrc/wse_kernels.cpp`, built, loaded and called.

The C++/OpenMP source is compiled once per machine with the system C++ compiler (``$CXX``, else
``c++`` or ``g++``; ``-O3 -march=native -fopenmp``) into a cache directory and loaded with
ctypes: a few seconds to build, no dependency on torch's C++ headers or ABI; OpenMP resolves to
the runtime torch already loaded. The file name carries a hash of the source, compiler, flags and
CPU, so a changed source or another machine builds anew; concurrent builders (DDP ranks, test
workers) rename atomically, never loading a partial file.

Every call takes contiguous CPU tensors and passes raw pointers; shapes are the caller's
contract (`ops.py` checks them). The kernels' tiles are cut to this machine's caches
(`tile_budgets`: `policy.tile_budgets` of the sizes `caches.py` reads from sysfs), set once at
load. ``LIGHTNING_SPARSE_WSE_COMPILE=0`` (read once per process)
never builds the library; the "compiled" path is then absent (`unavailable_reason` says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from lightning_sparse.wse import policy
from lightning_sparse.wse.caches import cache_sizes
from lightning_sparse.wse.policy import TileBudgets, narrow_columns
from lightning_sparse.wse.threads import kernel_threads

__all__ = [
    "CACHE_ENV",
    "COMPILE_ENV",
    "compiled_available",
    "csr_indices",
    "gather",
    "library",
    "one_token_layout",
    "scatter",
    "sddmm",
    "set_tile_budgets",
    "spmm",
    "spmm_t",
    "tile_budgets",
    "unavailable_reason",
]

COMPILE_ENV = "LIGHTNING_SPARSE_WSE_COMPILE"
"""Set to "0" to never build or load the native library (the "compiled" path is then absent)."""
CACHE_ENV = "LIGHTNING_SPARSE_CACHE_DIR"
"""Directory for the built library; default `$XDG_CACHE_HOME/lightning_sparse` or `~/.cache/...`."""
_SOURCE = (Path(__file__).parent / "csrc" / "wse_kernels.cpp").read_text()
_CXX_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-march=native")


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) once built and loaded, else (None, reason). Built at most once a process."""
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return None, f"disabled by {COMPILE_ENV}=0"
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"building the native kernels failed: {error}"
    _declare(lib)
    budgets = tile_budgets()
    set_tile_budgets(budgets.spmm, budgets.sddmm, lib)
    return lib, None


@functools.cache
def tile_budgets() -> TileBudgets:
    """This machine's tile budgets: `policy.tile_budgets` of cpu0's cache sizes (sysfs)."""
    sizes = cache_sizes()
    return policy.tile_budgets(sizes.l1d, sizes.l2)


def set_tile_budgets(spmm: int, sddmm: int, lib: ctypes.CDLL | None = None) -> None:
    """Bytes the matmul (SpMM) and SDDMM kernels size their transposed token tiles for (set at
    load from `tile_budgets`; tests set others to reach every tiling path)."""
    (lib or _loaded()).ls_set_tile_budgets(spmm, sddmm)


def _declare(lib: ctypes.CDLL) -> None:
    """Argument and result types of every exported function."""
    pointer, size, integer = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ls_set_tile_budgets.argtypes = [size, size]
    lib.ls_set_tile_budgets.restype = None
    lib.ls_csr_count.argtypes = [pointer, size, size, pointer, integer]
    lib.ls_csr_count.restype = size
    for index_kind in ("i32", "u16"):
        cols = getattr(lib, f"ls_csr_cols_{index_kind}")
        cols.argtypes = [pointer, size, size, pointer, pointer, integer]
        cols.restype = None
        for suffix in ("f32", "f64"):
            kinds = f"{suffix}_{index_kind}"
            spmm_ = getattr(lib, f"ls_spmm_{kinds}")
            spmm_.argtypes = [pointer] * 5 + [size] * 3 + [pointer, integer]
            spmm_.restype = None
            for name in ("ls_spmm_t", "ls_sddmm", "ls_sddmm_values"):
                function_ = getattr(lib, f"{name}_{kinds}")
                function_.argtypes = [pointer] * 4 + [size] * 3 + [pointer, integer]
                function_.restype = integer
            # spmm_t's last argument: the accumulator's column block in bytes (0: whole).
            getattr(lib, f"ls_spmm_t_{kinds}").argtypes = (
                [pointer] * 4 + [size] * 3 + [pointer, integer, size]
            )
            for name in ("ls_gather", "ls_gather_t", "ls_scatter"):
                function_ = getattr(lib, f"{name}_{kinds}")
                function_.argtypes = [pointer] * 3 + [size] * 2 + [pointer, integer]
                function_.restype = None
    for values_kind in ("f32", "bf16"):
        for index_kind in ("u16", "i32"):
            spmv = getattr(lib, f"ls_spmv_{values_kind}_{index_kind}")
            spmv.argtypes = [pointer] * 5 + [size, pointer, integer]
            spmv.restype = None


def unavailable_reason() -> str | None:
    """Why the "compiled" path is unavailable (None when it is available); builds on first call."""
    return library()[1]


def compiled_available() -> bool:
    """Whether the native kernels are built and loaded (builds them on first call)."""
    return library()[0] is not None


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler found; install g++ or set CXX")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    # -march=native code is only valid on this CPU, so the CPU is part of the cache key.
    fingerprint = "\0".join([_SOURCE, compiler, version, *_CXX_FLAGS, _cpu_signature()])
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    target = _cache_dir() / f"wse_kernels_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source, built = Path(tmp) / "wse_kernels.cpp", Path(tmp) / target.name
        source.write_text(_SOURCE)
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


def _loaded() -> ctypes.CDLL:
    lib, reason = library()
    if lib is None:
        raise RuntimeError(f"the compiled path is unavailable: {reason}")
    return lib


def function(name: str, dtype: torch.dtype, columns: Tensor) -> Callable[..., int | None]:
    """The exported ``<name>_<values>_<indices>`` for values of ``dtype`` (float32: f32, float64:
    f64) and the ``columns``' index type (int16 bit patterns of uint16: u16, int32: i32)."""
    values_kind = "f32" if dtype == torch.float32 else "f64"
    index_kind = "u16" if columns.dtype == torch.int16 else "i32"
    return getattr(_loaded(), f"{name}_{values_kind}_{index_kind}")


def csr_indices(mask: Tensor) -> tuple[Tensor, Tensor]:
    """CSR structure of a CPU bool mask `[M, K]` by the native builder.

    Returns:
        ``(crow, col)``: int32 row pointers `[M+1]` and the column of each kept entry `[nnz]`,
        ascending within a row: int16 bit patterns of uint16 columns where ``K <= 65536``
        (`narrow_columns`), else int32.

    Raises:
        RuntimeError: if the native library is unavailable.
    """
    lib = _loaded()
    mask = mask.contiguous()
    rows, cols = mask.shape
    threads = kernel_threads()
    crow = torch.empty(rows + 1, dtype=torch.int32)
    nnz = lib.ls_csr_count(mask.data_ptr(), rows, cols, crow.data_ptr(), threads)
    narrow = narrow_columns(cols)
    col = torch.empty(nnz, dtype=torch.int16 if narrow else torch.int32)
    fill = lib.ls_csr_cols_u16 if narrow else lib.ls_csr_cols_i32
    fill(mask.data_ptr(), rows, cols, crow.data_ptr(), col.data_ptr(), threads)
    return crow, col


def gather(
    pointers: Tensor, indices: Tensor, weight: Tensor, transposed: bool, out: Tensor
) -> None:
    """``out [nnz]`` = kept values of the contiguous CPU ``weight [M, K]`` in CSR order
    (``pointers``/``indices`` = crow/col), or, with ``transposed``, the values of ``weight^T``'s
    CSR (crow/col of ``[K, M]``) read from ``weight`` (an HF Conv1D's ``[in, out]`` weight)."""
    name = "ls_gather_t" if transposed else "ls_gather"
    rows, cols = weight.shape
    function(name, weight.dtype, indices)(
        pointers.data_ptr(), indices.data_ptr(), weight.data_ptr(), rows, cols, out.data_ptr(),
        kernel_threads(),
    )  # fmt: skip


def scatter(crow: Tensor, col: Tensor, values: Tensor, out: Tensor) -> None:
    """``out [M, K]`` = the kept ``values [nnz]`` (CSR order) at their positions, zero elsewhere."""
    rows, cols = out.shape
    function("ls_scatter", values.dtype, col)(
        crow.data_ptr(), col.data_ptr(), values.data_ptr(), rows, cols, out.data_ptr(),
        kernel_threads(),
    )  # fmt: skip


def spmm(
    crow: Tensor, col: Tensor, values: Tensor, x2: Tensor, bias: Tensor | None, out: Tensor
) -> None:
    """``out [N, M] = x2 [N, K] @ S^T (+ bias)`` for ``S [M, K]`` in CSR; all contiguous."""
    function("ls_spmm", x2.dtype, col)(
        crow.data_ptr(), col.data_ptr(), values.data_ptr(), x2.data_ptr(),
        None if bias is None else bias.data_ptr(),
        x2.shape[0], x2.shape[1], out.shape[1], out.data_ptr(), kernel_threads(),
    )  # fmt: skip


def spmm_t(
    crow: Tensor, col: Tensor, values: Tensor, grad_y2: Tensor, out: Tensor, block_bytes: int = 0
) -> None:
    """``out [N, K] = grad_y2 [N, M] @ S`` for ``S [M, K]`` in CSR (the input gradient of
    ``x2 @ S^T``, on S's own structure); all contiguous. ``block_bytes`` > 0 runs the
    accumulator by column blocks of that size (`tile_budgets().scatter_block` fits L1): the same
    bits, another speed (`kernel_variants.spmm_t` measures which is faster per shape)."""
    status = function("ls_spmm_t", grad_y2.dtype, col)(
        crow.data_ptr(), col.data_ptr(), values.data_ptr(), grad_y2.data_ptr(),
        grad_y2.shape[0], grad_y2.shape[1], out.shape[1], out.data_ptr(), kernel_threads(),
        block_bytes,
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native input-gradient kernel could not allocate its work buffers")


def sddmm(crow: Tensor, col: Tensor, grad_y2: Tensor, x2: Tensor, out: Tensor) -> None:
    """``(grad_y2 [N, M]^T @ x2 [N, K])`` at the kept positions of (crow, col): ``out`` is dense
    ``[M, K]`` (zero elsewhere), or the kept values ``[nnz]`` in CSR order."""
    name = "ls_sddmm" if out.dim() == 2 else "ls_sddmm_values"
    status = function(name, x2.dtype, col)(
        crow.data_ptr(), col.data_ptr(), grad_y2.data_ptr(), x2.data_ptr(),
        x2.shape[0], x2.shape[1], grad_y2.shape[1], out.data_ptr(), kernel_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the native SDDMM kernel could not allocate its work buffers")


def one_token_layout(
    crow: Tensor, col: Tensor, in_features: int, values: Tensor
) -> tuple[Callable[..., None], tuple[tuple[int, int, int], tuple[Tensor, ...]]]:
    """The one-token (GEMV) kernel for a CSR structure and its operands: column indices as 16-bit
    (unsigned, held as int16 bit patterns) when ``in_features <= 65536``, else the int32 ones;
    values fp32 or bf16 as given. Returns (kernel, ((crow, col, values) pointers, tensors to
    keep alive))."""
    if narrow_columns(in_features):
        col = col.to(torch.int16)  # the low 16 bits: the column as uint16
        index_kind = "u16"
    else:
        index_kind = "i32"
    values_kind = "bf16" if values.dtype == torch.bfloat16 else "f32"
    kernel = getattr(_loaded(), f"ls_spmv_{values_kind}_{index_kind}")
    pointers = (crow.data_ptr(), col.data_ptr(), values.data_ptr())
    return kernel, (pointers, (col, values))
