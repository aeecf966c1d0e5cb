"""Messages that do not apply to `lightning-sparse` runs, filtered out (`quiet`).

Lightning's litlogger / litmodels tips, its model summary's FLOPs column (0 without
``example_input_array``; the run summary reports the sparse FLOPs) and the pytree deprecation
warning Lightning gives on newer torch. (W&B's "anonymous setting" warning is avoided where the
logger is built, in `lightning_sparse.app.fit.SparseCLI`.)
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["drop_zero_flops", "plain_model_summary", "quiet"]


class _DropRecords(logging.Filter):
    """Drops log records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


class _NoZeroFlops(logging.Filter):
    """Lightning's model summary without its FLOPs column and "0 Total Flops" line, which only
    count with ``example_input_array`` set (the parameter counts stay)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = drop_zero_flops(str(record.msg))
        return True


def plain_model_summary(callbacks: list[Any]) -> None:
    """Swap Lightning's rich model summary (chosen when ``rich`` is installed) for the plain one,
    in place: the rich table always shows a FLOPs column, 0 here (`drop_zero_flops` filters the
    plain one; the run summary reports the sparse FLOPs)."""
    # Imported here: `quiet` wraps every subcommand, and ``--help`` should not load Lightning.
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    for i, callback in enumerate(callbacks):
        if type(callback) is RichModelSummary:
            callbacks[i] = ModelSummary(max_depth=callback._max_depth)


def drop_zero_flops(table: str) -> str:
    """``table`` (Lightning's model summary) without the FLOPs column if the total is 0."""
    lines = table.split("\n")
    if not any(re.fullmatch(r"0\s+Total Flops", line) for line in lines):
        return table
    header = next((i for i, line in enumerate(lines) if " | FLOPs" in line), None)
    lines = [line for line in lines if not re.fullmatch(r"0\s+Total Flops", line)]
    if header is None:
        return "\n".join(lines)
    start = lines[header].index(" | FLOPs")
    end = lines[header].find(" | ", start + 3)
    end = len(lines[header]) if end < 0 else end
    for i in range(header, len(lines)):
        line = lines[i]
        if "Trainable params" in line:
            break  # the totals below the table
        if line and set(line) == {"-"}:
            lines[i] = "-" * (len(line) - (end - start))
        else:
            lines[i] = (line[:start] + line[end:]).rstrip()
    return "\n".join(lines)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Filters, for the duration, the messages that do not apply to this package's runs:
    Lightning's litlogger / litmodels tips, its FLOPs-less model summary column, the pytree
    deprecation warning of Lightning on newer torch."""
    tips = _DropRecords("💡 Tip:")
    flops = _NoZeroFlops()
    rank_zero = [
        logging.getLogger(n)
        for n in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
    ]
    summary = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    for logger in rank_zero:
        logger.addFilter(tips)
    summary.addFilter(flops)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
            yield
    finally:
        for logger in rank_zero:
            logger.removeFilter(tips)
        summary.removeFilter(flops)
