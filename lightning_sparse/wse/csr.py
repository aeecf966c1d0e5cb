"""CSR layout of a masked weight, the storage format of the emulated wafer-scale device.

A `CSRWeight` holds the compressed-sparse-row structure of a weight `W [out, in]` under a bool mask
(True = kept): row pointers and the column of each kept weight, as the device would store them.
Every kernel walks this one orientation: the forward `Y = X W^T` gathers input columns, the input
gradient `grad_X = grad_Y W` scatters into them (`native.spmm_t`), the weight gradient samples
them (SDDMM), so no transposed structure is kept. Column indices are 16-bit (int16 bit patterns of
uint16) on the CPU where ``in <= 65536``, else int32: 2 bytes per kept weight plus 4 per row, half
the bytes of the kept fp32 values (0.05x a dense fp32 weight at 90% sparsity). Values are gathered
from the live weight when a kernel needs them (`gather_values`), so an optimizer step never
invalidates a `CSRWeight`, only a mask change does. Building is one native pass over the mask when
the compiled kernels are available (see `native.py`), else a handful of vectorised tensor ops;
never a Python loop over elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.wse.policy import narrow_columns

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, eq=False)
class CSRWeight:
    """Compressed sparse row structure of a masked `[out, in]` weight.

    Build it with `CSRWeight.from_dense(weight, mask)`; the fields are read-only tensors.

    Attributes:
        shape: `(out, in)` of the dense weight.
        crow_indices: int32 `[out + 1]`; row `i` owns entries `crow_indices[i]:crow_indices[i+1]`.
        col_indices: `[nnz]`; input column of each entry, ascending within a row: int16 bit
            patterns of uint16 columns on the CPU where ``in <= 65536`` (`columns()` widens
            them), else int32.
    """

    shape: tuple[int, int]
    crow_indices: Tensor
    col_indices: Tensor

    @classmethod
    def from_dense(cls, weight: Tensor, mask: Tensor, *, compiled: bool | None = None) -> CSRWeight:
        """Builds the CSR structure of `mask` for `weight`.

        Entries are exactly the True positions of the mask, even where the weight value is 0
        (unlike `Tensor.to_sparse_csr`, which drops zeros and would lose their gradients).

        Args:
            weight: dense weight `[out, in]` (its shape and device are checked; no values kept).
            mask: bool `[out, in]`, True = kept.
            compiled: use the native builder (True), PyTorch ops (False), or the native builder
                whenever it is available for this device (None). Both give identical results.

        Returns:
            The structure. Cost: one O(out * in) pass over the mask plus O(nnz) work.

        Raises:
            ValueError: if the shapes differ, the mask is not bool, the weight does not fit int32
                indices, or `compiled=True` where the native builder is unavailable.
        """
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a torch.bool tensor (True = kept), got {mask.dtype}")
        if mask.shape != weight.shape:
            raise ValueError(
                f"mask shape {tuple(mask.shape)} must equal weight shape {tuple(weight.shape)}"
            )
        if mask.device != weight.device:
            raise ValueError(f"mask is on {mask.device} but weight is on {weight.device}")
        out_features, in_features = weight.shape
        if max(mask.numel(), out_features + 1, in_features + 1) > _INT32_MAX:
            raise ValueError(
                f"a {out_features}x{in_features} weight is too large for int32 CSR indices"
            )
        crow, cols = _indices(mask.detach(), compiled)
        return cls((out_features, in_features), crow, cols)

    @property
    def nnz(self) -> int:
        """Number of kept entries."""
        return self.col_indices.numel()

    @property
    def sparsity(self) -> float:
        """Fraction of zeros in [0, 1]; 0 for an empty weight."""
        numel = self.shape[0] * self.shape[1]
        return 1.0 - self.nnz / numel if numel else 0.0

    @property
    def device(self) -> torch.device:
        """Device of the index tensors."""
        return self.col_indices.device

    @property
    def nbytes(self) -> int:
        """Bytes this structure holds (its index tensors)."""
        return self.crow_indices.nbytes + self.col_indices.nbytes

    @property
    def narrow(self) -> bool:
        """Whether the column indices are 16-bit (int16 bit patterns of uint16 columns)."""
        return self.col_indices.dtype == torch.int16

    def columns(self, dtype: torch.dtype = torch.int64) -> Tensor:
        """The column of each entry `[nnz]` as ``dtype`` (int32 or int64): a new tensor where the
        indices are 16-bit, else ``col_indices`` itself (int32) or its int64 copy."""
        if self.narrow:
            return self.col_indices.to(dtype).bitwise_and_(0xFFFF)
        return self.col_indices.to(dtype)

    def same_structure(self, other: CSRWeight) -> bool:
        """Whether ``other`` has exactly this structure (same shape and kept positions)."""
        return (
            self.shape == other.shape
            and self.device == other.device
            and torch.equal(self.crow_indices, other.crow_indices)
            and torch.equal(self.col_indices, other.col_indices)
        )

    def gather_values(self, weight: Tensor) -> Tensor:
        """Kept values of a (live) dense `weight` in CSR order, shape `[nnz]`.

        Raises:
            ValueError: if `weight` does not have this structure's shape.
        """
        if tuple(weight.shape) != self.shape:
            raise ValueError(
                f"weight shape {tuple(weight.shape)} does not match CSRWeight shape {self.shape}; "
                "rebuild the CSRWeight after changing the layer"
            )
        if _native_gather_ok(weight):
            from lightning_sparse.wse import native  # deferred: native.py is loaded on first use

            out = weight.new_empty(self.nnz)
            if not weight.is_contiguous() and weight.t().is_contiguous():
                # W = V^T of a contiguous V (an HF Conv1D's [in, out] weight): W's CSR walks V by
                # columns, so gather from V without a copy.
                native.gather(self.crow_indices, self.col_indices, weight.t(), True, out)
                return out
            native.gather(self.crow_indices, self.col_indices, weight.contiguous(), False, out)
            return out
        return weight.reshape(-1).index_select(0, self.flat_indices())

    def flat_indices(self) -> Tensor:
        """int64 `[nnz]` positions `row * in + col` in the flattened weight of each entry, in CSR
        order; computed, not stored."""
        rows, cols = self.shape
        return _entry_rows(self.crow_indices, rows).mul_(cols).add_(self.columns())

    def to_mask(self) -> Tensor:
        """The bool mask `[out, in]` of this structure."""
        mask = torch.zeros(self.shape[0] * self.shape[1], dtype=torch.bool, device=self.device)
        mask[self.flat_indices()] = True
        return mask.view(self.shape)

    def to_dense(self, values: Tensor) -> Tensor:
        """Dense `[out, in]` tensor with `values` (`[nnz]`, CSR order) at kept positions."""
        differentiable = values.requires_grad and torch.is_grad_enabled()
        if _native_gather_ok(values) and values.is_contiguous() and not differentiable:
            from lightning_sparse.wse import native

            dense = values.new_empty(self.shape)
            native.scatter(self.crow_indices, self.col_indices, values, dense)
            return dense
        dense = values.new_zeros(self.shape[0] * self.shape[1])
        dense.index_put_((self.flat_indices(),), values)
        return dense.view(self.shape)

    def as_torch_csr(self, values: Tensor) -> Tensor:
        """PyTorch sparse CSR tensor of ``values`` (``[nnz]``, CSR order; not copied) under this
        structure, int32 indices (16-bit columns widened into a new tensor)."""
        columns = self.columns(torch.int32) if self.narrow else self.col_indices
        # Valid by construction (ascending columns in each row), so not checked again.
        return torch.sparse_csr_tensor(
            self.crow_indices, columns, values, self.shape, check_invariants=False
        )

    def to_torch_csr(self, weight: Tensor) -> Tensor:
        """PyTorch sparse CSR tensor of `weight`'s kept values (int32 indices; 16-bit columns
        are widened into a new tensor)."""
        columns = self.columns(torch.int32) if self.narrow else self.col_indices
        return torch.sparse_csr_tensor(
            self.crow_indices, columns, self.gather_values(weight), self.shape
        )

    def __repr__(self) -> str:
        return (
            f"CSRWeight(shape={self.shape}, nnz={self.nnz}, sparsity={self.sparsity:.4f}, "
            f"device={self.device})"
        )


def _native_gather_ok(weight: Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.float64):
        return False
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return False
    from lightning_sparse.wse import native

    return native.unavailable_reason() is None


def _entry_rows(pointers: Tensor, num_rows: int) -> Tensor:
    """int64 `[nnz]` row of each entry from int32 row pointers `[num_rows + 1]`."""
    counts = (pointers[1:] - pointers[:-1]).long()
    return torch.repeat_interleave(torch.arange(num_rows, device=pointers.device), counts)


def _indices(mask: Tensor, compiled: bool | None) -> tuple[Tensor, Tensor]:
    """`(crow, col)` of a bool mask (see `CSRWeight`), natively or in PyTorch."""
    if compiled is not False and mask.device.type == "cpu":
        # Deferred import: the native library is built on first use.
        from lightning_sparse.wse import native

        reason = native.unavailable_reason()
        if reason is None:
            return native.csr_indices(mask)
        if compiled:
            raise ValueError(f"compiled=True but the native CSR builder is unavailable: {reason}")
    elif compiled:
        raise ValueError(f"compiled=True needs a CPU mask, got one on {mask.device}")
    out_features, in_features = mask.shape
    # nonzero() yields kept positions in row-major order, i.e. already in CSR order.
    flat = mask.reshape(-1).nonzero().squeeze(1)
    rows = torch.div(flat, max(in_features, 1), rounding_mode="floor")
    narrow = mask.device.type == "cpu" and narrow_columns(in_features)
    # int16 keeps the low 16 bits: the column as uint16.
    cols = (flat - rows * in_features).to(torch.int16 if narrow else torch.int32)
    return _row_pointers(rows, out_features), cols


def _row_pointers(row_of_entry: Tensor, num_rows: int) -> Tensor:
    """int32 `[num_rows + 1]` pointers from the row index of each entry (entries grouped by row)."""
    counts = torch.bincount(row_of_entry, minlength=num_rows)
    pointers = torch.zeros(num_rows + 1, dtype=torch.int32, device=row_of_entry.device)
    pointers[1:] = counts.cumsum(0)
    return pointers
