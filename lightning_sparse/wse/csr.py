"""CSR layout of a masked weight, the storage format of the emulated wafer-scale device.

A `CSRWeight` holds the compressed-sparse-row structure of a weight `W [out, in]` under a bool mask
(True = kept) together with the same structure transposed (the CSR of `W^T`, i.e. the CSC of `W`),
which the input gradient `grad_X = grad_Y W` walks. Indices are compact int32, as the device would
store them. The structure depends only on the mask; values are re-gathered from the live weight on
every call (`gather_values`), so an optimizer step never invalidates a `CSRWeight`, only a mask
change does. Rebuilding is one native pass over the mask when the compiled kernels are available
(see `kernels.py`), else a handful of vectorised tensor ops; never a Python loop over elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, eq=False)
class CSRWeight:
    """Compressed sparse row structure of a masked `[out, in]` weight, plus its transpose.

    Build it with `CSRWeight.from_dense(weight, mask)`; the fields are read-only tensors.

    Attributes:
        shape: `(out, in)` of the dense weight.
        crow_indices: int32 `[out + 1]`; row `i` owns entries `crow_indices[i]:crow_indices[i+1]`.
        col_indices: int32 `[nnz]`; input column of each entry, ascending within a row.
        values: `[nnz]` weight values in CSR order, a detached snapshot taken at build time.
        flat_indices: int32 `[nnz]`; `row * in + col` of each entry, for gathering live values.
        t_crow_indices: int32 `[in + 1]`; row pointers of `W^T` (column pointers of `W`).
        t_col_indices: int32 `[nnz]`; the `W` row of each entry in transposed order.
        t_perm: int32 `[nnz]`; CSR position of each transposed entry, so the values of `W^T` in
            its own CSR order are `values[t_perm]`.
        mask: bool `[out, in]` snapshot of the mask (used by the dense execution path).
    """

    shape: tuple[int, int]
    crow_indices: Tensor
    col_indices: Tensor
    values: Tensor
    flat_indices: Tensor
    t_crow_indices: Tensor
    t_col_indices: Tensor
    t_perm: Tensor
    mask: Tensor

    @classmethod
    def from_dense(cls, weight: Tensor, mask: Tensor, *, compiled: bool | None = None) -> CSRWeight:
        """Builds the CSR and transposed-CSR structure of `weight` under `mask`.

        Entries are exactly the True positions of the mask, even where the weight value is 0
        (unlike `Tensor.to_sparse_csr`, which drops zeros and would lose their gradients).

        Args:
            weight: dense weight `[out, in]`; only its kept values are copied.
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
        mask = mask.detach().clone()
        crow, cols, flat, t_crow, t_col, t_perm = _indices(mask, compiled)
        return cls(
            shape=(out_features, in_features),
            crow_indices=crow,
            col_indices=cols,
            values=weight.detach().reshape(-1).index_select(0, flat),
            flat_indices=flat,
            t_crow_indices=t_crow,
            t_col_indices=t_col,
            t_perm=t_perm,
            mask=mask,
        )

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
        return weight.reshape(-1).index_select(0, self.flat_indices)

    def to_dense(self, values: Tensor | None = None) -> Tensor:
        """Dense `[out, in]` tensor with `values` (default: the snapshot) at kept positions."""
        values = self.values if values is None else values
        dense = values.new_zeros(self.shape[0] * self.shape[1])
        dense.index_put_((self.flat_indices,), values)
        return dense.view(self.shape)

    def to_torch_csr(self, values: Tensor | None = None, transposed: bool = False) -> Tensor:
        """PyTorch sparse CSR tensor of `W` (or `W^T` with `transposed=True`), sharing indices."""
        values = self.values if values is None else values
        if transposed:
            return torch.sparse_csr_tensor(
                self.t_crow_indices,
                self.t_col_indices,
                values.index_select(0, self.t_perm),
                (self.shape[1], self.shape[0]),
            )
        return torch.sparse_csr_tensor(self.crow_indices, self.col_indices, values, self.shape)

    def __repr__(self) -> str:
        return (
            f"CSRWeight(shape={self.shape}, nnz={self.nnz}, sparsity={self.sparsity:.4f}, "
            f"device={self.device})"
        )


def _indices(mask: Tensor, compiled: bool | None) -> tuple[Tensor, ...]:
    """int32 `(crow, col, flat, t_crow, t_col, t_perm)` of a bool mask, natively or in PyTorch."""
    if compiled is not False and mask.device.type == "cpu":
        # Deferred import: kernels.py builds on this module, and owns the native library.
        from lightning_sparse.wse import kernels

        reason = kernels.native_unavailable_reason()
        if reason is None:
            return kernels.native_csr_indices(mask)
        if compiled:
            raise ValueError(f"compiled=True but the native CSR builder is unavailable: {reason}")
    elif compiled:
        raise ValueError(f"compiled=True needs a CPU mask, got one on {mask.device}")
    out_features, in_features = mask.shape
    # nonzero() yields kept positions in row-major order, i.e. already in CSR order.
    flat = mask.reshape(-1).nonzero().squeeze(1)
    rows = torch.div(flat, max(in_features, 1), rounding_mode="floor")
    cols = (flat - rows * in_features).to(torch.int32)
    # A stable sort by column keeps rows ascending within each column: the CSC order of W.
    # int32 keys matter: torch's stable int64 sort is orders of magnitude slower on CPU.
    t_perm = torch.sort(cols, stable=True).indices.to(torch.int32)
    return (
        _row_pointers(rows, out_features),
        cols,
        flat.to(torch.int32),
        _row_pointers(cols, in_features),
        rows.to(torch.int32).index_select(0, t_perm),
        t_perm,
    )


def _row_pointers(row_of_entry: Tensor, num_rows: int) -> Tensor:
    """int32 `[num_rows + 1]` pointers from the row index of each entry (entries grouped by row)."""
    counts = torch.bincount(row_of_entry, minlength=num_rows)
    pointers = torch.zeros(num_rows + 1, dtype=torch.int32, device=row_of_entry.device)
    pointers[1:] = counts.cumsum(0)
    return pointers
