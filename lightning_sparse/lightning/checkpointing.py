"""`AtomicCheckpointIO`: checkpoint files are complete or absent, never truncated.

A process killed while ``torch.save`` writes ``last.ckpt`` in place leaves a truncated file that
``--ckpt_path last`` then fails to load. This plugin writes to a temporary file in the same
directory, flushes it to disk, and renames it over the target with ``os.replace`` (atomic on POSIX
and Windows within one file system): a kill at any moment leaves either the previous checkpoint or
the new one. Use it in a recipe::

    trainer:
      plugins:
        - class_path: lightning_sparse.AtomicCheckpointIO
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO"]

_TEMP_SUFFIX = ".tmp"


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local writes are write-temporary, fsync, rename.

    Remote paths (``s3://...``) go through Lightning's own writer unchanged.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically.

        Raises:
            TypeError: ``storage_options`` given (nothing here uses them).
        """
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r}); "
                "call trainer.save_checkpoint without them"
            )
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(target)
        temporary = self.write_temporary(checkpoint, target)
        self.commit(temporary, target)

    def write_temporary(self, checkpoint: dict[str, Any], target: Path) -> Path:
        """Save to a new hidden file beside ``target`` and flush it to disk; return its path."""
        fd, name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=_TEMP_SUFFIX
        )
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
        return Path(name)

    def commit(self, temporary: Path, target: Path) -> None:
        """Rename ``temporary`` over ``target`` (atomic), then persist the directory entry."""
        os.replace(temporary, target)
        _fsync_directory(target.parent)


def _remove_stale_temporaries(target: Path) -> None:
    """Delete temporaries of ``target`` left by a writer that was killed before its rename."""
    for stale in target.parent.glob(f".{target.name}.*{_TEMP_SUFFIX}"):
        stale.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":  # Windows cannot open a directory; its rename is durable enough
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
