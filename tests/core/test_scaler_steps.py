"""Fused steps under a ``GradScaler`` (`lightning_sparse.core.scaler_steps`): the overflow flag
read without waiting where the step count is not needed exactly, and waited for where it is.

A GPU's flag arrives through pinned memory and an event; here the events are stand-ins whose
arrival the test decides (`Arrival`), so the bookkeeping is checked on the CPU. The whole path
on a GPU is ``tests/core/test_cuda.py``; fused and plain Adam giving the same masks is
``tests/lightning/test_amp_fused.py``.
"""

from __future__ import annotations

import torch

from lightning_sparse import RigL
from lightning_sparse.core.scaler_steps import SkippedSteps, found_inf
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)


class Arrival:
    """A stand-in for a ``torch.Event``: arrived or not, and whether anyone waited on it."""

    def __init__(self, arrived: bool) -> None:
        self.arrived, self.waited = arrived, False

    def query(self) -> bool:
        return self.arrived

    def synchronize(self) -> None:
        self.waited, self.arrived = True, True


def pending(skips: SkippedSteps, *flags: tuple[float, Arrival]) -> None:
    for value, event in flags:
        skips._pending.append((torch.tensor(value), event))  # as `note` leaves a GPU's flag


def test_found_inf_is_the_scalers_tensor_or_none() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert found_inf(optimizer) is None
    optimizer.found_inf = 1.0  # type: ignore[attr-defined]  # not a tensor: not the scaler's
    assert found_inf(optimizer) is None
    optimizer.found_inf = flag = torch.ones(())  # type: ignore[attr-defined]
    assert found_inf(optimizer) is flag


def test_a_cpu_flag_is_read_at_once() -> None:
    skips = SkippedSteps()
    skips.note(torch.tensor(1.0))
    skips.note(torch.tensor(0.0))
    assert skips.pending == 0
    assert skips.settle(wait=False) == 1
    assert skips.settle() == 0


def test_settle_without_waiting_reads_the_arrived_flags_in_order() -> None:
    skips = SkippedSteps()
    first, second, third = Arrival(True), Arrival(False), Arrival(True)
    pending(skips, (1.0, first), (1.0, second), (0.0, third))
    assert skips.settle(wait=False) == 1  # the third arrived, but after the second: in order
    assert skips.pending == 2 and not second.waited
    assert skips.settle() == 1
    assert second.waited and skips.pending == 0


def test_an_update_waits_only_when_one_may_be_due() -> None:
    """RigL updating every 4 steps, 5 steps taken by the count, the last one's flag on its way:
    the step is 4 or 5. At 4 an update may be due, so the flag is waited for; it says the step
    was skipped, so the step is 4 and the update is due. At 6 or 7 nothing is due: no wait."""
    sparsity = RigL(0.5, update={"freq": 4})
    sparsity._step = 5
    event = Arrival(False)
    pending(sparsity._skips, (1.0, event))
    assert sparsity._update_may_be_due() and not event.waited
    assert sparsity.step == 4 and event.waited
    assert sparsity.is_update_step()

    sparsity._step = 7
    later = Arrival(False)
    pending(sparsity._skips, (1.0, later))
    assert not sparsity._update_may_be_due() and not later.waited
    assert not sparsity.dense_grad_needed and not later.waited


def test_setting_the_step_forgets_the_flags() -> None:
    sparsity = RigL(0.5, update={"freq": 4})
    pending(sparsity._skips, (1.0, Arrival(False)))
    sparsity.step = 3
    assert sparsity.step == 3 and sparsity._skips.pending == 0
