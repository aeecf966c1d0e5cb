"""CSR layout of a masked weight, the storage format of the emulated wafer-scale device.

A `CSRWeight` holds the compressed-sparse-row structure of a weight `W [out, in]` under a bool mask
(True = kept) together with the same structure transposed (the CSR of `W^T`, i.e. the CSC of `W`),
which the input gradient `grad_X = grad_Y W` walks. It holds indices only, compact int32 as the
device would store them: two index sets of `nnz` entries plus two row-pointer arrays, 8 bytes per
kept weight (0.2x a dense fp32 weight at 90% sparsity). Values are gathered from the live weight
when a kernel needs them (`gather_values`, `gather_values_t`), so an optimizer step never
invalidates a `CSRWeight`, only a mask change does. Building is one native pass over the mask when
the compiled kernels are available (see `native.py`), else a handful of vectorised tensor ops;
never a Python loop over elements.
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
        t_crow_indices: int32 `[in + 1]`; row pointers of `W^T` (column pointers of `W`); None
            in a forward-only structure (``transpose=False``: inference needs no input gradient).
        t_col_indices: int32 `[nnz]`; the `W` row of each entry in transposed order, ascending
            within each column; None in a forward-only structure.
        t_perm: int32 `[nnz]`; the CSR position of each entry in transposed order, so
            ``values[t_perm]`` are `W^T`'s values (a compact layer holds values, not a dense
            weight to gather from); None unless built with ``permutation=True``.
    """

    shape: tuple[int, int]
    crow_indices: Tensor
    col_indices: Tensor
    t_crow_indices: Tensor | None
    t_col_indices: Tensor | None
    t_perm: Tensor | None = None

    @classmethod
    def from_dense(
        cls,
        weight: Tensor,
        mask: Tensor,
        *,
        compiled: bool | None = None,
        transpose: bool = True,
        permutation: bool = False,
    ) -> CSRWeight:
        """Builds the CSR and transposed-CSR structure of `mask` for `weight`.

        Entries are exactly the True positions of the mask, even where the weight value is 0
        (unlike `Tensor.to_sparse_csr`, which drops zeros and would lose their gradients).

        Args:
            weight: dense weight `[out, in]` (its shape and device are checked; no values kept).
            mask: bool `[out, in]`, True = kept.
            compiled: use the native builder (True), PyTorch ops (False), or the native builder
                whenever it is available for this device (None). Both give identical results.
            transpose: also build the transposed structure (what the input gradient walks);
                False halves the indices held, for inference.
            permutation: also keep ``t_perm`` (with ``transpose``): a compact layer's input
                gradient reads `W^T`'s values from its value vector.

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
        crow, cols, t_crow, t_col, t_perm = _indices(mask.detach(), compiled)
        return cls(
            (out_features, in_features),
            crow,
            cols,
            t_crow if transpose else None,
            t_col if transpose else None,
            t_perm if transpose and permutation else None,
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

    @property
    def has_transpose(self) -> bool:
        """Whether the transposed structure (for the input gradient) was built."""
        return self.t_col_indices is not None

    @property
    def nbytes(self) -> int:
        """Bytes this structure holds (its index tensors)."""
        fields = (
            self.crow_indices, self.col_indices, self.t_crow_indices, self.t_col_indices,
            self.t_perm,
        )  # fmt: skip
        return sum(t.nbytes for t in fields if t is not None)

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
        return self._gather(weight, transposed=False)

    def gather_values_t(self, weight: Tensor) -> Tensor:
        """Kept values of `weight` in the transposed structure's order (the CSR values of
        `W^T`), shape `[nnz]`."""
        return self._gather(weight, transposed=True)

    def _gather(self, weight: Tensor, transposed: bool) -> Tensor:
        if tuple(weight.shape) != self.shape:
            raise ValueError(
                f"weight shape {tuple(weight.shape)} does not match CSRWeight shape {self.shape}; "
                "rebuild the CSRWeight after changing the layer"
            )
        pointers, indices = (
            self._transposed() if transposed else (self.crow_indices, self.col_indices)
        )
        if _native_gather_ok(weight):
            from lightning_sparse.wse import native  # deferred: native.py is loaded on first use

            out = weight.new_empty(self.nnz)
            if not weight.is_contiguous() and weight.t().is_contiguous():
                # W = V^T of a contiguous V (an HF Conv1D's [in, out] weight): W's CSR order is
                # V's transposed-CSR order and vice versa, so gather from V without a copy.
                native.gather(pointers, indices, weight.t(), not transposed, out)
                return out
            native.gather(pointers, indices, weight.contiguous(), transposed, out)
            return out
        return weight.reshape(-1).index_select(0, self.flat_indices(transposed))

    def flat_indices(self, transposed: bool = False) -> Tensor:
        """int64 `[nnz]` positions `row * in + col` in the flattened weight of each entry, in CSR
        order (or transposed-CSR order); computed, not stored."""
        rows, cols = self.shape
        if transposed:
            t_crow, t_col = self._transposed()
            return t_col.long() * cols + _entry_rows(t_crow, cols)
        return _entry_rows(self.crow_indices, rows) * cols + self.col_indices.long()

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

    def transposed_values(self, values: Tensor) -> Tensor:
        """``values`` (`[nnz]`, CSR order) in the transposed structure's order: `W^T`'s values.

        Raises:
            ValueError: if the structure was built without ``permutation=True``.
        """
        if self.t_perm is None:
            raise ValueError(
                "this CSRWeight has no transposed permutation; build it with "
                "CSRWeight.from_dense(weight, mask, permutation=True)"
            )
        return values.index_select(0, self.t_perm)

    def to_torch_csr(self, weight: Tensor, transposed: bool = False) -> Tensor:
        """PyTorch sparse CSR tensor of `weight`'s kept values (of `W^T` with `transposed=True`),
        sharing this structure's indices."""
        if transposed:
            t_crow, t_col = self._transposed()
            return torch.sparse_csr_tensor(
                t_crow, t_col, self.gather_values_t(weight), (self.shape[1], self.shape[0])
            )
        return torch.sparse_csr_tensor(
            self.crow_indices, self.col_indices, self.gather_values(weight), self.shape
        )

    def _transposed(self) -> tuple[Tensor, Tensor]:
        if self.t_crow_indices is None or self.t_col_indices is None:
            raise ValueError(
                "this CSRWeight was built forward-only (transpose=False); build it with "
                "CSRWeight.from_dense(weight, mask) to walk W^T (the input gradient)"
            )
        return self.t_crow_indices, self.t_col_indices

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


def _indices(mask: Tensor, compiled: bool | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """int32 `(crow, col, t_crow, t_col, t_perm)` of a bool mask, natively or in PyTorch."""
    if compiled is not False and mask.device.type == "cpu":
        # Deferred import: the native library is built on first use.
        from lightning_sparse.wse import native

        reason = native.unavailable_reason()
        if reason is None:
            crow, col, _, t_crow, t_col, t_perm = native.csr_indices(mask)
            return crow, col, t_crow, t_col, t_perm
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
