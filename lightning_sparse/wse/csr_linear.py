"""`CSRLinear`: a sparse linear layer held only in CSR, for inference on the device.

The executor (`executor.py`) runs a masked `nn.Linear` that still holds its dense weight, so
training can go on; serving a trained model needs none of that. A `CSRLinear` holds what the
decode kernels read and nothing else:

- ``crow_indices``: int32 `[out + 1]` row pointers;
- ``col_indices``: the column of each kept weight, `[nnz]`: 16-bit (int16 bit patterns of uint16
  columns) where ``in <= 65536``, which every compiled kernel reads directly, else int32;
- ``values``: the kept values `[nnz]` in CSR order (float32, bfloat16 storage of float32, or
  float64);
- ``bias`` `[out]` if any.

In fp32 with 16-bit columns that is 6 bytes per kept weight plus 4 per row: 0.15x the dense
weight at 90% sparsity (0.10x with bfloat16 values). Its forward is `ops.csr_runner`, the runner
the executor's inference path uses, on the compiled path (the "torch" path where the native
library is unavailable).

It is built from the compressed-tensors ``sparse-bitmask`` layout (`from_bitmask`: bit-packed
mask + kept values, never a dense float weight) or from a dense weight whose pruned entries are
exactly zero (`from_dense`). Both read the mask a block of rows at a time (at most `BLOCK`
entries: a transient bool block and its int64 nonzero positions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from lightning_sparse.wse import native, policy
from lightning_sparse.wse.ops import csr_runner

__all__ = ["BLOCK", "CSRLinear", "runs_in_csr", "unpack_bitmask"]

BLOCK = 1 << 20
"""Mask entries unpacked at once while building (a transient bool block of this many bytes)."""
_INT32_MAX = 2**31 - 1
_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def runs_in_csr(shape: tuple[int, int], nnz: int, element_size: int) -> bool:
    """Whether a weight `[out, in]` with ``nnz`` kept entries is served in CSR: the rule the
    executor applies to decode (`policy.decode_forces_dense`: values plus column indices at most
    ``TUNED["decode_bytes_ratio"]`` of the dense bytes, about 67% sparsity in fp32); a denser
    weight decodes faster dense."""
    return not policy.decode_forces_dense(shape, nnz, element_size, 1, False)


class CSRLinear(nn.Module):
    """``y = x W^T + b`` for a sparse ``W [out, in]`` held only in CSR; inference only.

    Build it with `from_bitmask` or `from_dense`. The index and value tensors are
    non-persistent buffers (listed by ``named_buffers``, absent from ``state_dict``).

    Args:
        shape: `(out, in)`.
        crow_indices, col_indices, values: the CSR arrays (see the module docstring).
        bias: optional `[out]`.
    """

    # The buffers registered in __init__.
    crow_indices: Tensor
    col_indices: Tensor
    values: Tensor
    bias: Tensor | None

    def __init__(
        self,
        shape: tuple[int, int],
        crow_indices: Tensor,
        col_indices: Tensor,
        values: Tensor,
        bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.register_buffer("crow_indices", crow_indices, persistent=False)
        self.register_buffer("col_indices", col_indices, persistent=False)
        self.register_buffer("values", values, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self._runner: Callable[[Tensor], Tensor] | None = None
        self._dtype = self.compute_dtype

    @classmethod
    def from_bitmask(
        cls,
        shape: tuple[int, int],
        bitmask: Tensor,
        values: Tensor,
        bias: Tensor | None = None,
        *,
        transposed: bool = False,
        value_dtype: torch.dtype | None = None,
        row_offsets: Tensor | None = None,
    ) -> CSRLinear:
        """The layer of a weight stored as compressed-tensors' ``sparse-bitmask`` layout.

        Args:
            shape: `(rows, cols)` of the stored weight: `(out, in)`, or `(in, out)` with
                ``transposed`` (an HF ``Conv1D``).
            bitmask: uint8 `[rows, ceil(cols / 8)]`, bit ``k`` of byte ``j`` = column
                ``8 j + k`` (little bit order), 1 = kept.
            values: `[nnz]` the kept values in row-major order of the stored weight.
            bias: optional `[out]`.
            transposed: the stored weight is ``W^T`` (`[in, out]`).
            value_dtype: dtype the values are held in (default: theirs; float16 becomes
                float32). They are copied: the layer never points into a file's pages.
            row_offsets: optional int64 `[rows]`, where each stored row starts in ``values``;
                checked against the bitmask.

        Raises:
            ValueError: the bitmask's shape or dtype does not fit ``shape``, its count of set
                bits differs from ``values.numel()``, or ``row_offsets`` disagrees with it (a
                corrupt or mismatched file).
        """
        _check_bitmask(bitmask, shape)
        dtype = _held_dtype(values.dtype, value_dtype)
        values = values.reshape(-1).to(dtype, copy=True)
        blocks = _bitmask_blocks(bitmask, shape[1])
        return cls._build(shape, blocks, values, bias, transposed, row_offsets)

    @classmethod
    def from_dense(
        cls,
        weight: Tensor,
        bias: Tensor | None = None,
        *,
        transposed: bool = False,
        value_dtype: torch.dtype | None = None,
        release: Callable[[Tensor], None] | None = None,
    ) -> CSRLinear:
        """The layer of a dense weight whose pruned entries are exactly zero: its nonzeros are
        kept (``weight`` itself is not held).

        Args:
            weight: `[out, in]`, or `[in, out]` with ``transposed`` (an HF ``Conv1D``).
            bias, value_dtype: as in `from_bitmask`.
            release: called with each row block of a contiguous ``[out, in]`` weight once a
                pass has read it (two passes: count, then values and columns): a reader whose
                weight is mapped from a file gives the block's pages back, so one block, not
                the whole weight, is resident at a time.
        """
        w = weight.detach().t() if transposed else weight.detach()  # [out, in]
        step = max(1, BLOCK // max(w.shape[1], 1))
        starts = range(0, w.shape[0], step)
        done = release if release is not None and w.is_contiguous() else (lambda block: None)
        nnz = 0
        for r in starts:
            nnz += int(torch.count_nonzero(w[r : r + step]))
            done(w[r : r + step])
        values = torch.empty(nnz, dtype=_held_dtype(w.dtype, value_dtype))

        def kept_blocks() -> Iterator[Tensor]:  # fills `values` as `_build` consumes the masks
            filled = 0
            for r in starts:
                block = w[r : r + step]
                kept = block != 0
                found = block[kept]
                values[filled : filled + found.numel()] = found[: max(nnz - filled, 0)]
                filled += found.numel()
                done(block)
                yield kept

        return cls._build((w.shape[0], w.shape[1]), kept_blocks(), values, bias, False, None)

    @classmethod
    def _build(
        cls,
        shape: tuple[int, int],
        blocks: Iterator[Tensor],
        values: Tensor,
        bias: Tensor | None,
        transposed: bool,
        row_offsets: Tensor | None,
    ) -> CSRLinear:
        """The layer from row blocks of the stored weight's bool mask and its kept values (held
        as given)."""
        rows, cols = shape
        nnz, dtype = values.numel(), values.dtype
        if max(rows * cols, rows + 1, cols + 1) > _INT32_MAX:
            raise ValueError(f"a {rows}x{cols} weight is too large for int32 CSR indices")
        out_features, in_features = (cols, rows) if transposed else (rows, cols)
        narrow = not transposed and policy.narrow_columns(in_features)
        crow, columns = _structure(blocks, rows, cols, nnz, narrow)
        if row_offsets is not None and not torch.equal(
            row_offsets.reshape(-1).long(), crow[:-1].long()
        ):
            raise ValueError(
                f"row_offsets of the {rows}x{cols} weight disagree with its bitmask's row counts"
            )
        if transposed:
            crow, columns, values = _transpose(crow, columns, values, cols)
            if policy.narrow_columns(in_features):
                columns = columns.to(torch.int16)
        if bias is not None:
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            bias = bias.detach().reshape(-1).to(wide, copy=True)
            if bias.numel() != out_features:
                raise ValueError(f"bias must be [{out_features}], got {bias.numel()} values")
        return cls((out_features, in_features), crow, columns, values, bias)

    @property
    def nnz(self) -> int:
        """Number of kept weights."""
        return self.values.numel()

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype inputs and outputs have (float32 for bfloat16 storage)."""
        return torch.float64 if self.values.dtype == torch.float64 else torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds (indices, values, bias)."""
        return sum(b.nbytes for b in self.buffers())

    def forward(self, input: Tensor) -> Tensor:
        """input `[..., in]` -> `[..., out]`, in `compute_dtype`, without autograd.

        Raises:
            ValueError: an input of another dtype or width, or one that requires a gradient
                (the layer is inference-only: it has no dense weight to train).
        """
        runner = self._runner
        if runner is None:
            runner = self._runner = self._make_runner()
        if input.dtype is not self._dtype or input.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"CSRLinear({self.in_features} -> {self.out_features}) takes "
                f"{self.compute_dtype} [..., {self.in_features}] inputs, got {input.dtype} "
                f"{list(input.shape)}"
            )
        if input.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "CSRLinear is inference-only (it holds no dense weight to train); call it "
                "under torch.no_grad() or train the model with its masks instead"
            )
        return runner(input)

    def _make_runner(self) -> Callable[[Tensor], Tensor]:
        """The layer's `csr_runner` (compiled path, "torch" without the native library); the
        pointers it holds stay valid until `_apply` replaces the buffers."""
        if self.values.device.type != "cpu":
            raise ValueError(
                f"CSRLinear runs on the CPU (the emulated device); its tensors are on "
                f"{self.values.device}"
            )
        self._dtype = self.compute_dtype
        path = "compiled" if native.unavailable_reason() is None else "torch"
        shape = (self.out_features, self.in_features)
        return csr_runner(path, self.crow_indices, self.col_indices, self.values, shape, self.bias)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> CSRLinear:
        # `.to()`, `.float()` ... may replace the buffers the runner points into.
        self._runner = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        numel = self.out_features * self.in_features
        sparsity = 1 - self.nnz / numel if numel else 0.0
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.nnz}, "
            f"sparsity={sparsity:.4f}, values={self.values.dtype}, "
            f"columns={self.col_indices.dtype}, bias={self.bias is not None}"
        )


def _held_dtype(dtype: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    dtype = wanted or (torch.float32 if dtype == torch.float16 else dtype)
    if dtype not in _VALUE_DTYPES:
        raise ValueError(f"values are held as float32, bfloat16 or float64, not {dtype}")
    return dtype


def unpack_bitmask(bitmask: Tensor, shape: tuple[int, int]) -> Tensor:
    """The bool mask `[rows, cols]` of a packed bitmask (see `CSRLinear.from_bitmask`), for a
    weight held dense."""
    _check_bitmask(bitmask, shape)
    return torch.cat(list(_bitmask_blocks(bitmask, shape[1]))) if shape[0] else bitmask.bool()


def _check_bitmask(bitmask: Tensor, shape: tuple[int, int]) -> None:
    rows, cols = shape
    if bitmask.dtype != torch.uint8 or tuple(bitmask.shape) != (rows, (cols + 7) // 8):
        raise ValueError(
            f"bitmask must be uint8 [{rows}, {(cols + 7) // 8}] for a {rows}x{cols} weight, "
            f"got {bitmask.dtype} {list(bitmask.shape)}"
        )


def _bitmask_blocks(bitmask: Tensor, cols: int) -> Iterator[Tensor]:
    """bool `[b, cols]` row blocks of a little-bit-order packed mask `[rows, ceil(cols / 8)]`."""
    shifts = torch.arange(8, dtype=torch.uint8)
    step = max(1, BLOCK // max(cols, 1))
    for r in range(0, bitmask.shape[0], step):
        packed = bitmask[r : r + step]
        bits = packed.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
        yield bits.reshape(packed.shape[0], -1)[:, :cols].bool()


def _structure(
    blocks: Iterator[Tensor], rows: int, cols: int, nnz: int, narrow: bool
) -> tuple[Tensor, Tensor]:
    """int32 row pointers `[rows + 1]` and column indices `[nnz]` (int16 bit patterns if
    ``narrow``) from bool row blocks, checking the blocks hold exactly ``nnz`` kept entries.

    Per block only its flat kept positions (int64) are made: a row-wise ``sum`` of a bool block
    would widen the whole block to int64 first (8 bytes per weight of the block)."""
    crow = torch.zeros(rows + 1, dtype=torch.int32)
    columns = torch.empty(nnz, dtype=torch.int16 if narrow else torch.int32)
    row = filled = 0
    for kept in blocks:
        flat = kept.reshape(-1).nonzero().squeeze(1)  # row-major = CSR order
        if filled + flat.numel() > nnz:
            break
        starts = torch.arange(1, kept.shape[0] + 1, dtype=torch.int64).mul_(cols)
        crow[row + 1 : row + 1 + kept.shape[0]] = torch.searchsorted(flat, starts).add_(filled)
        columns[filled : filled + flat.numel()] = flat.remainder_(cols)
        row, filled = row + kept.shape[0], filled + flat.numel()
    if row != rows or filled != nnz:
        found = "more" if row != rows else str(filled)
        raise ValueError(
            f"the mask of a {rows}x{cols} weight has {found} kept entries but {nnz} values "
            "were given; the bitmask and the values come from different weights"
        )
    return crow, columns


def _transpose(
    crow: Tensor, columns: Tensor, values: Tensor, cols: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The CSR of ``S^T`` from the CSR of ``S [rows, cols]`` (int32 columns): a stable sort of
    the entries by column keeps rows ascending within each (transient int64 ``[nnz]`` arrays)."""
    rows = crow.numel() - 1
    counts = (crow[1:] - crow[:-1]).long()
    entry_rows = torch.repeat_interleave(torch.arange(rows, dtype=torch.int32), counts)
    order = torch.sort(columns, stable=True).indices
    t_crow = torch.zeros(cols + 1, dtype=torch.int32)
    t_crow[1:] = torch.bincount(columns.long(), minlength=cols).cumsum(0)
    return t_crow, entry_rows[order], values[order]
