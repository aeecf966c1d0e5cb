"""Native kernel variants that give the same bits, chosen by timing them where they run.

The input-gradient kernel (`native.spmm_t`) scatters every kept weight into an accumulator of
the token tile's features; run whole, its read-modify-writes go to L2 once the tile outgrows
L1, and run by column blocks (`policy.tile_budgets`'s ``scatter_block`` of L1) each block's pass
over the rows costs a resumed row. Which wins depends on the core (its L2's bandwidth against
the cost of resuming a row) and on the shape (kept weights per row and block), not on the
caches' sizes alone (benchmarks/README.md, "Roofline per layer", has the figures).
Both sum every output in the same order, so the choice changes time only: `spmm_t` times both on
the first call of each `policy.variant_key` (on the call's own operands, interleaved, the best of
``TUNED["variant_rounds"]`` each) and keeps the faster for the process.
"""

from __future__ import annotations

import time

from torch import Tensor

from lightning_sparse.wse import native, policy
from lightning_sparse.wse.policy import TUNED

__all__ = ["clear_variant_cache", "spmm_t", "variant_choices"]

_CHOICES: dict[tuple, int] = {}
_BLOCK_COLUMNS = 32
"""The kernel's smallest column block (kColBlock): no narrower accumulator is ever split."""


def spmm_t(crow: Tensor, col: Tensor, values: Tensor, grad_y2: Tensor, out: Tensor) -> None:
    """`native.spmm_t` on the faster accumulator layout for this shape (whole or by L1 column
    blocks), measured on the first call of its key; ``out [N, K]`` as `native.spmm_t`."""
    tokens, rows = grad_y2.shape
    columns = out.shape[1]
    block = native.tile_budgets().scatter_block
    if columns <= _BLOCK_COLUMNS:  # one block at most: the two layouts are one
        native.spmm_t(crow, col, values, grad_y2, out)
        return
    key = policy.variant_key("spmm_t", grad_y2.dtype, (rows, columns), col.numel(), tokens)
    chosen = _CHOICES.get(key)
    if chosen is not None:
        native.spmm_t(crow, col, values, grad_y2, out, chosen)
        return
    best = {0: float("inf"), block: float("inf")}
    for _ in range(int(TUNED["variant_rounds"].value)):
        for candidate in best:  # each run writes the same bits into `out`
            start = time.perf_counter()
            native.spmm_t(crow, col, values, grad_y2, out, candidate)
            best[candidate] = min(best[candidate], time.perf_counter() - start)
    _CHOICES[key] = min(best, key=lambda b: best[b])


def variant_choices() -> dict[tuple, int]:
    """A copy of the choices made so far: key -> block bytes (0: whole accumulator)."""
    return dict(_CHOICES)


def clear_variant_cache() -> None:
    """Forgets every measured choice (e.g. after changing the thread count)."""
    _CHOICES.clear()
