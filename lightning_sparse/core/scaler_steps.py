"""Optimizer steps a ``GradScaler`` skips inside a fused optimizer, counted without a host sync.

``GradScaler.step(optimizer)`` does not call ``optimizer.step()`` when the scaled gradients hold
inf or NaN, so the algorithm's step hooks do not run and the step is not counted. An optimizer
that unscales in its own kernel (``_step_supports_amp_scaling``: fused Adam, AdamW, SGD) is
different: the scaler calls its ``step()`` on every step, with ``optimizer.found_inf`` (a 0-d
float tensor, nonzero on overflow) and ``optimizer.grad_scale`` set, and the kernel then leaves
weights and state as they were. Such a step must not count either, nor run a mask update on
the overflowed gradients: the update is retried at the next step, as with any other optimizer.

The flag lives on the device. Reading it at once would stall the host every step, so
`SkippedSteps` copies it to the host asynchronously (pinned memory, an event) and reads the
copies that have arrived (`settle` without waiting); the step count is then known to lie in a
small range (`pending` steps unsettled), and the algorithm waits for the rest only when an
update may be due within that range, or when the exact count is asked for. On the CPU the flag
is read at once (there is no queue to drain).
"""

from __future__ import annotations

import torch

__all__ = ["SkippedSteps", "found_inf"]


def found_inf(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The overflow flag a ``GradScaler`` gave ``optimizer`` for the step in progress (0-d,
    nonzero: the fused kernel skips the step), or None when no scaler is stepping it."""
    flag = getattr(optimizer, "found_inf", None)
    return flag if isinstance(flag, torch.Tensor) else None


class SkippedSteps:
    """Flags of fused steps taken under a ``GradScaler``, settled into a count when asked."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, torch.Event]] = []
        self._skipped = 0  # read on the CPU already

    def note(self, flag: torch.Tensor) -> None:
        """A step ran with ``flag`` (`found_inf`): start reading it to the host."""
        if flag.device.type == "cpu":
            self._skipped += int(bool(flag))
            return
        host = torch.empty((), dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.Event(device=flag.device)
        event.record()
        self._pending.append((host, event))

    @property
    def pending(self) -> int:
        """Noted steps whose flag has not been read yet."""
        return len(self._pending)

    def settle(self, wait: bool = True) -> int:
        """How many of the noted steps the scaler skipped, forgetting them: all of them
        (``wait``: waits for the copies, usually long done), or those whose copy has arrived."""
        skipped, self._skipped = self._skipped, 0
        while self._pending:
            host, event = self._pending[0]
            if not event.query():
                if not wait:
                    break
                event.synchronize()
            skipped += int(bool(host))
            self._pending.pop(0)
        return skipped

    def clear(self) -> None:
        """Forget the noted steps (the step count was set)."""
        self._pending, self._skipped = [], 0
