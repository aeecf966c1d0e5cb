"""`DataError`: a data module's settings that give no data, with the settings to change."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DataError"]


class DataError(ValueError):
    """The data a module's settings select cannot be used (no files, an empty split, a corpus
    shorter than one window); found while reading it (``setup``), not when built.

    Args:
        message: what is wrong and the fix, naming the settings as the module's arguments.
        keys: those settings (``"paths"``, ``"val_paths"``, ...): the command line names them
            ``--data.<key>``.
    """

    def __init__(self, message: str, keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)
