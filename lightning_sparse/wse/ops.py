"""The device's operations: the sparse linear layer's autograd ops, its backends, the inference
runner.

`run_path(path, x, weight, csr, bias)` computes ``F.linear(x, weight * mask, bias)`` with the
structure ``csr`` on one path, in value and in gradients (``grad_weight`` is dense with zeros at
pruned positions, so optimizers see exactly what masked dense training gives them), while only
kept weights cost FLOPs:

- forward        Y = X W^T                     walks the CSR of W
- input grad     grad_X = grad_Y W             scatters into input columns along the CSR of W
- weight grad    grad_W[i, j] = sum_t grad_Y[t, i] X[t, j] at kept (i, j) only (SDDMM)

Backends: "compiled" (the native kernels, `native.py`; tokens are the vector dimension, threads
take tiles of tokens), "torch" (PyTorch's CSR ops, `torch.sparse.mm`,
`torch.sparse.sampled_addmm`; any device), "dense" (`F.linear` on a masked copy, the reference).
`inference_runner` is the forward without autograd on pre-gathered values, which the executor
keeps while nothing changes. Which path runs is `autotune.resolve_path`'s decision.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_sparse.core.masking import zero_pruned_
from lightning_sparse.wse import kernel_variants, native
from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.threads import kernel_threads

__all__ = [
    "CompactDenseWeightGrad",
    "DenseWeightGrad",
    "csr_runner",
    "inference_runner",
    "run_compact_path",
    "run_path",
]


def inference_runner(
    path: str,
    values: Tensor,
    csr: CSRWeight,
    weight: Tensor | None,
    mask: Tensor | None,
    bias: Tensor | None,
) -> Callable[[Tensor], Tensor]:
    """A function ``x [..., in] -> [..., out]`` running `sparse_linear`'s forward without autograd
    on fixed ``values`` (the executor's decode fast path: per call only the output allocation and
    one native call, nothing re-checked; build a new runner when values, mask or path change).

    Args:
        path: "compiled", "torch" or "dense" (`resolve_path`).
        values: `[nnz]` kept values in CSR order (float32/float64, or bfloat16 storage of
            float32 values: every path computes in float32 with the rounded values; the
            compiled one-token kernel reads the bf16 values directly); csr: their structure.
        weight, mask: the live dense weight and its bool mask (used by the "dense" path); None
            for a compact layer, whose "dense" path builds the weight from ``values``.
        bias: optional `[out]`.
    """
    out_features, in_features = csr.shape
    if values.dtype == torch.bfloat16 and path != "compiled":
        # bf16 storage (`inference_dtype`): the same rounded values on every path.
        values = values.float()
        if path == "dense":
            return functools.partial(F.linear, weight=csr.to_dense(values), bias=bias)
    if path == "dense":
        if weight is None or mask is None:  # a compact layer: no weight
            return functools.partial(F.linear, weight=csr.to_dense(values), bias=bias)
        # Masked training keeps pruned weights at exactly 0, so the weight itself is its masked
        # copy; checked once per runner (one pass), a masked copy is kept only if it differs.
        masked = zero_pruned_(weight.detach().clone(), mask)
        dense = weight.detach() if torch.equal(masked, weight) else masked
        del masked
        return functools.partial(F.linear, weight=dense, bias=bias)  # no Python frame per call
    bias = None if bias is None else bias.detach().contiguous()
    run = csr_runner(path, csr.crow_indices, csr.col_indices, values, csr.shape, bias)
    # Tensors the runner's kernels read, kept alive by the runner (a function attribute).
    run.keep.append(csr)  # type: ignore[attr-defined]
    return run


def csr_runner(
    path: str,
    crow: Tensor,
    columns: Tensor,
    values: Tensor,
    shape: tuple[int, int],
    bias: Tensor | None,
) -> Callable[[Tensor], Tensor]:
    """A function ``x [..., in] -> [..., out]`` computing ``x W^T + b`` for ``W [out, in]`` held
    in CSR, without autograd: the forward `inference_runner` runs, on raw CSR arrays (what a
    layer held only in CSR, `csr_linear.CSRLinear`, has).

    Args:
        path: "compiled" (the native kernels; one token: the GEMV kernel) or "torch".
        crow: int32 `[out + 1]` row pointers.
        columns: `[nnz]` column indices: int32, or 16-bit (int16 bit patterns of uint16
            columns, ``in <= 65536``), which every compiled kernel reads directly (the "torch"
            path widens them per call).
        values: `[nnz]` kept values in CSR order (float32/float64, or bfloat16 storage of
            float32 values, widened per multi-token call).
        shape: `(out, in)`.
        bias: optional contiguous `[out]`.
    """
    out_features, in_features = shape
    if path != "compiled":
        matmul = _BACKENDS[path].matmul

        def run_backend(x: Tensor) -> Tensor:
            x2 = x.reshape(-1, in_features).contiguous()
            wide = values.float() if values.dtype == torch.bfloat16 else values
            y2 = matmul(crow, columns, wide, x2, out_features, bias)
            return y2.reshape(*x.shape[:-1], out_features)

        # Tensors the runner's kernels read, kept alive by the runner (a function attribute).
        run_backend.keep = [crow, columns, values, bias]  # type: ignore[attr-defined]
        return run_backend
    stored = values  # bf16 storage: the one-token kernel widens it, other token counts get fp32
    if values.dtype == torch.bfloat16:
        values = values.float()
    spmm = native.function("ls_spmm", values.dtype, columns)
    pointers = (crow.data_ptr(), columns.data_ptr(), values.data_ptr())
    bias_pointer = None if bias is None else bias.data_ptr()
    spmv, one_token = None, None
    if values.dtype == torch.float32:
        spmv, one_token = native.one_token_layout(crow, columns, in_features, stored)
        if stored.dtype == torch.bfloat16:
            values = pointers = None  # type: ignore[assignment]  # built on a prefill call
    keep = [crow, columns, stored, values, bias, one_token]  # keeps the pointers valid

    def run(x: Tensor) -> Tensor:
        x2 = x.reshape(-1, in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        tokens = x2.shape[0]
        out = x2.new_empty(tokens, out_features)
        if tokens == 1 and spmv is not None and one_token is not None:
            spmv(*one_token[0], x2.data_ptr(), bias_pointer, out_features, out.data_ptr(),
                 kernel_threads())  # fmt: skip
        else:
            ptrs = pointers
            if ptrs is None:  # bf16 values: widened per multi-token call
                wide = stored.float()
                ptrs = (crow.data_ptr(), columns.data_ptr(), wide.data_ptr())
            spmm(*ptrs, x2.data_ptr(), bias_pointer, tokens, in_features, out_features,
                 out.data_ptr(), kernel_threads())  # fmt: skip
        return out.view(*x.shape[:-1], out_features)

    # Tensors the runner's kernels read, kept alive by the runner (a function attribute).
    run.keep = keep  # type: ignore[attr-defined]
    return run


def _widen(columns: Tensor) -> Tensor:
    """int32 `[nnz]` columns from 16-bit ones (int16 bit patterns of uint16 values)."""
    return columns.to(torch.int32).bitwise_and_(0xFFFF)


# --- Autograd -------------------------------------------------------------------------------------
def _csr_backward(
    ctx: Any,
    csr: CSRWeight,
    grad_y2: Tensor,
    x2: Tensor,
    values: Callable[[], Tensor],
    second_grad: Callable[[CSRWeight, Tensor, Tensor], Tensor],
) -> tuple[Tensor | None, ...]:
    """The backward of a CSR linear ``Y2 [N, out] = X2 [N, in] S^T + b``: the input gradient
    ``grad_Y2 S`` on S's own CSR (its values, CSR order, from ``values``), the gradient of the
    second input (the dense weight's, zero where pruned, or the kept values') from
    ``second_grad``, and the bias gradient; each only where autograd needs it."""
    backend = ctx.backend
    grad_y2 = grad_y2.contiguous()
    grad_x = grad_second = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = backend.matmul_t(csr, values(), grad_y2)
    if ctx.needs_input_grad[1]:
        grad_second = second_grad(csr, grad_y2, x2)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = grad_y2.sum(0)
    return grad_x, grad_second, grad_b, None, None


class _SparseLinearFunction(torch.autograd.Function):
    """Y = X W^T + b on CSR data; gradients equal those of `F.linear(X, W * mask, b)`."""

    @staticmethod
    def forward(
        ctx, x2: Tensor, weight: Tensor, bias: Tensor | None, csr: CSRWeight, backend: _Backend
    ) -> Tensor:
        x2 = x2.contiguous()
        weight = weight.detach()
        values = csr.gather_values(weight)
        bias = None if bias is None else bias.detach().contiguous()
        y2 = backend.matmul(csr.crow_indices, csr.col_indices, values, x2, csr.shape[0], bias)
        # The weight itself is saved (no copy of its values): autograd's version check raises if
        # it is written in place before backward, which gathers the values from it again.
        ctx.save_for_backward(x2, weight)
        ctx.csr, ctx.backend, ctx.has_bias = csr, backend, bias is not None
        return y2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y2: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        csr = ctx.csr
        return _csr_backward(
            ctx, csr, grad_y2, x2, lambda: csr.gather_values(weight), ctx.backend.sampled_grad
        )


class _MaskedWeight(torch.autograd.Function):
    """``weight * mask`` for a bool mask, by the bit-pattern multiply of `masking.zero_pruned_`
    (a bool-times-float product takes a slow type-promoting loop on the CPU)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, mask: Tensor) -> Tensor:
        ctx.save_for_backward(mask)
        return _masked_copy(weight, mask)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
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
    # uint8, not bool: an out-of-place integer-times-bool product may take a promoting loop on
    # the CPU (benchmarks/README.md, "Figures behind the code", for what it costs).
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


def run_path(path: str, x: Tensor, weight: Tensor, csr: CSRWeight, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight * mask, bias)`` for the mask of ``csr`` on ``path``, differentiable
    in ``x``, ``weight`` (dense gradient, zero where pruned) and ``bias``."""
    if path == "dense":
        return F.linear(x, _MaskedWeight.apply(weight, _dense_mask(csr)), bias)
    out_features, in_features = csr.shape
    y2 = _SparseLinearFunction.apply(x.reshape(-1, in_features), weight, bias, csr, _BACKENDS[path])
    return y2.reshape(*x.shape[:-1], out_features)


# --- Compact layers: the weight is its kept values ----------------------------------------------
class _CSRLinearFunction(torch.autograd.Function):
    """Y = X W^T + b for W held as its kept values ``[nnz]`` (CSR order of ``csr``); the value
    gradient is ``[nnz]``: no dense weight or gradient exists."""

    @staticmethod
    def forward(
        ctx: Any, x2: Tensor, values: Tensor, bias: Tensor | None, csr: CSRWeight, backend: Any
    ) -> Tensor:
        x2 = x2.contiguous()
        bias = None if bias is None else bias.detach().contiguous()
        y2 = backend.matmul(
            csr.crow_indices, csr.col_indices, values.detach(), x2, csr.shape[0], bias
        )
        # The values themselves are saved: writing them in place before backward (an optimizer
        # step) is autograd's version error, as for nn.Linear's weight.
        ctx.save_for_backward(x2, values)
        ctx.csr_ref, ctx.backend, ctx.has_bias = weakref.ref(csr), backend, bias is not None
        return y2

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y2: Tensor) -> tuple[Tensor | None, ...]:
        x2, values = ctx.saved_tensors
        csr = _held_structure(ctx)
        return _csr_backward(ctx, csr, grad_y2, x2, values.detach, ctx.backend.sampled_values)


def _held_structure(ctx: Any) -> CSRWeight:
    """The structure a compact layer's forward ran on. Its ops hold it weakly (the layer holds
    it), so a graph kept after its backward (a plain loop's ``loss`` until the next step) does
    not keep alive the indices a mask update replaced.

    Raises:
        RuntimeError: the layer's structure was replaced between the forward and its backward.
    """
    csr = ctx.csr_ref()
    if csr is None:
        raise RuntimeError(
            "a compact layer's CSR structure was replaced (a mask update) between a forward and "
            "its backward; run backward before the masks change"
        )
    return csr


class _Densify(torch.autograd.Function):
    """The dense ``[out, in]`` weight of kept ``values`` (zeros elsewhere); its gradient is the
    dense gradient's kept values."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, csr: CSRWeight) -> Tensor:
        ctx.csr_ref = weakref.ref(csr)
        return csr.to_dense(values.detach())

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _held_structure(ctx).gather_values(grad), None


def run_compact_path(
    path: str, x: Tensor, values: Tensor, csr: CSRWeight, bias: Tensor | None
) -> Tensor:
    """``F.linear(x, W, bias)`` for W given by its kept ``values [nnz]`` under ``csr`` on
    ``path``; differentiable in ``x``, ``values`` and ``bias``.
    "dense" builds W for the call (a transient ``[out, in]``) and gathers its gradient."""
    if path == "dense":
        return F.linear(x, _Densify.apply(values, csr), bias)
    out_features, in_features = csr.shape
    x2 = x.reshape(-1, in_features)
    y2 = _CSRLinearFunction.apply(x2, values, bias, csr, _BACKENDS[path])
    return y2.reshape(*x.shape[:-1], out_features)


class DenseWeightGrad(torch.autograd.Function):
    """Identity on a layer's output ``y`` whose backward also gives ``weight`` the dense gradient
    ``grad_Y^T X`` (what `nn.Linear` computes), while ``y`` itself came from the sparse kernels."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[2]:
            grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return grad_y, None, grad_w


class CompactDenseWeightGrad(torch.autograd.Function):
    """`DenseWeightGrad` for a compact layer (a RigL/GraNet update step): identity on ``y``
    (computed from the detached ``values``), whose backward makes the dense gradient
    ``dW = grad_Y^T X`` ``[out, in]`` (one dense matmul, no sampled one beside it) and gives
    ``values`` that gradient at its kept positions, ``[nnz]`` in ``csr``'s order, exactly the
    cpu path's masked dense gradient. The dense gradient goes to the weight parameter (which
    holds no values), or, with ``keep``, to ``keep(dW)`` only (the layer takes what the update
    reads of it, `compact.grow_candidates`) and is dropped when the backward leaves the layer."""

    @staticmethod
    def forward(
        ctx: Any,
        y: Tensor,
        x: Tensor,
        weight: Tensor,
        values: Tensor,
        csr: CSRWeight,
        keep: Callable[[Tensor], None] | None = None,
    ) -> Tensor:
        ctx.save_for_backward(x)
        ctx.csr_ref, ctx.keep = weakref.ref(csr), keep
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        csr = _held_structure(ctx)
        grad_values = csr.gather_values(grad_w) if ctx.needs_input_grad[3] else None
        to_weight = ctx.needs_input_grad[2]
        if ctx.keep is not None:
            ctx.keep(grad_w)
            to_weight = False
        return grad_y, None, grad_w if to_weight else None, grad_values, None, None


# --- Backends -------------------------------------------------------------------------------------
class _Backend(NamedTuple):
    # matmul(crow, col, values, x2 [N, K], rows, bias) -> x2 @ S^T (+ bias) [N, rows] for
    # S [rows, K] in CSR.
    matmul: Callable[[Tensor, Tensor, Tensor, Tensor, int, Tensor | None], Tensor]
    # matmul_t(csr, values, grad_y2 [N, out]) -> grad_y2 @ S [N, in] for S = (csr, values).
    matmul_t: Callable[[CSRWeight, Tensor, Tensor], Tensor]
    # sampled_grad(csr, grad_y2 [N, out], x2 [N, in]) -> dense [out, in], zero where pruned.
    sampled_grad: Callable[[CSRWeight, Tensor, Tensor], Tensor]
    # sampled_values(csr, grad_y2, x2) -> the same at kept positions only, [nnz] in CSR order.
    sampled_values: Callable[[CSRWeight, Tensor, Tensor], Tensor]


def _torch_csr(crow: Tensor, col: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta" is noise for our callers
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)


def _torch_matmul(
    crow: Tensor, col: Tensor, values: Tensor, x2: Tensor, rows: int, bias: Tensor | None
) -> Tensor:
    if col.dtype == torch.int16:  # 16-bit columns: PyTorch's CSR wants int32 like crow
        col = _widen(col)
    sparse = _torch_csr(crow, col, values, (rows, x2.shape[1]))
    out = torch.sparse.mm(sparse, x2.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


def _torch_matmul_t(csr: CSRWeight, values: Tensor, grad_y2: Tensor) -> Tensor:
    sparse = _torch_csr(csr.crow_indices, csr.columns(torch.int32), values, csr.shape)
    # (S^T grad_Y^T)^T, S^T being a CSC view of the same arrays (what PyTorch does with it
    # inside is its own affair: the "torch" path is the fallback, not the fast one).
    return torch.sparse.mm(sparse.t(), grad_y2.t()).t().contiguous()


def _torch_sampled_values(csr: CSRWeight, grad_y2: Tensor, x2: Tensor) -> Tensor:
    pattern = _torch_csr(
        csr.crow_indices, csr.columns(torch.int32), x2.new_zeros(csr.nnz), csr.shape
    )
    return torch.sparse.sampled_addmm(pattern, grad_y2.t(), x2, beta=0.0).values()


def _torch_sampled_grad(csr: CSRWeight, grad_y2: Tensor, x2: Tensor) -> Tensor:
    return csr.to_dense(_torch_sampled_values(csr, grad_y2, x2))


def _compiled_matmul(
    crow: Tensor, col: Tensor, values: Tensor, x2: Tensor, rows: int, bias: Tensor | None
) -> Tensor:
    out = x2.new_empty(x2.shape[0], rows)
    native.spmm(crow, col, values, x2, bias, out)
    return out


def _compiled_matmul_t(csr: CSRWeight, values: Tensor, grad_y2: Tensor) -> Tensor:
    out = grad_y2.new_empty(grad_y2.shape[0], csr.shape[1])
    kernel_variants.spmm_t(csr.crow_indices, csr.col_indices, values, grad_y2, out)
    return out


def _compiled_sampled_grad(csr: CSRWeight, grad_y2: Tensor, x2: Tensor) -> Tensor:
    dense = x2.new_empty(csr.shape)
    native.sddmm(csr.crow_indices, csr.col_indices, grad_y2, x2, dense)
    return dense


def _compiled_sampled_values(csr: CSRWeight, grad_y2: Tensor, x2: Tensor) -> Tensor:
    values = x2.new_empty(csr.nnz)
    native.sddmm(csr.crow_indices, csr.col_indices, grad_y2, x2, values)
    return values


_BACKENDS = {
    "torch": _Backend(_torch_matmul, _torch_matmul_t, _torch_sampled_grad, _torch_sampled_values),
    "compiled": _Backend(
        _compiled_matmul, _compiled_matmul_t, _compiled_sampled_grad, _compiled_sampled_values
    ),
}
