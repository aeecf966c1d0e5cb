"""A model built sparse on the device: made from the meta device one module at a time
(`core.materialize`), each masked layer compact as soon as it is made.

A masked `nn.Linear` the device runs goes compact at once (`LayerState.try_compact`: its kept
values ``[nnz]`` take the weight's place in the optimizer that holds it, the weight holds no
values), or, before any optimizer holds it (Lightning makes the optimizers after the model),
parked (`LayerState.park`: the values wait for the first training forward to find their
optimizer). So no dense weight of the whole model ever exists: at most one layer's, while it
is made. The process returns freed blocks of 1 MiB or more to the system from then on
(`allocator`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_sparse.core import materialize as core
from lightning_sparse.core.materialize import Init
from lightning_sparse.core.sparse_parameter import mask_buffer_name
from lightning_sparse.wse.allocator import return_freed_blocks
from lightning_sparse.wse.layer import STATE

__all__ = ["Init", "materialize"]


def materialize(
    model: nn.Module,
    init: Init,
    optimizers: Sequence[torch.optim.Optimizer],
    device: torch.device | str = "cpu",
) -> None:
    """`core.materialize.materialize` with each masked layer of the device compact as it is
    made (module docstring). Arguments and errors: those of `core.materialize.materialize`."""
    return_freed_blocks()  # trains near the machine's memory: freed blocks leave the process
    core.materialize(model, init, optimizers, device, made=_compact)


def _compact(module: nn.Module) -> None:
    state = STATE.get(module)
    mask = module._buffers.get(mask_buffer_name("weight"))
    if state is None or mask is None or mask.is_meta:
        return
    state.try_compact(module, mask)
    if state.compact is None:  # no optimizer holds the weight yet (Lightning)
        state.park(module, mask)
    state.built_sparse = state.compact is not None
