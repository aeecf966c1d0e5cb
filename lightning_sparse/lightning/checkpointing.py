"""`AtomicCheckpointIO`: checkpoint files are complete or absent, never truncated.

A process killed while ``torch.save`` writes ``last.ckpt`` in place leaves a truncated file that
``--ckpt_path last`` then fails to load. This plugin writes to a temporary file in the same
directory, flushes it to disk, and renames it over the target with ``os.replace`` (atomic on POSIX
and Windows within one file system): a kill at any moment leaves either the previous checkpoint or
the new one. A failed write (full disk, no permission) removes its temporary file, leaves the
previous checkpoint intact and raises an ``OSError`` naming the checkpoint, the cause and the fix.

A writer killed before its rename leaves its temporary file behind
(``.last.ckpt.<random>.partial.tmp``). Each save first removes such leftovers in its directory
(`remove_stale_temporaries`; the ``lightning-sparse`` command also sweeps its run directories when
a run starts): only files of this writer's naming pattern, and only those no live writer holds. A
writer holds an exclusive ``flock`` on its temporary file from creation until after the rename
(POSIX; the kernel drops it when the process dies), so two processes writing into one directory
never remove each other's file. Use it in a recipe::

    trainer:
      plugins:
        - class_path: lightning_sparse.AtomicCheckpointIO
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_sparse.core.file_modes import give_default_mode

try:
    import fcntl
except ImportError:  # Windows: an open file cannot be deleted, which protects a live writer
    fcntl = None  # type: ignore[assignment]  # the module's absence, checked where it is used

__all__ = ["AtomicCheckpointIO", "remove_stale_temporaries"]

_TEMP_SUFFIX = ".partial.tmp"
# The temporary files this writer creates (`tempfile.mkstemp`: 8 random characters), and those of
# earlier versions of it (``.<name>.ckpt.<random>.tmp``): nothing else is ever removed.
_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.partial\.tmp")
_EARLIER_TEMPORARY = re.compile(r"\..+\.ckpt\.[a-z0-9_]{8}\.tmp")
_LOW_SPACE = 1 << 20  # bytes: below this much free space a failed write is a full disk
_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)  # not defined on Windows
# Messages of torch's zip writer (inline_container.cc) when the file stops taking bytes.
_TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed", "inline_container")


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local writes are write-temporary, fsync, rename.

    Remote paths (``s3://...``) go through Lightning's own writer unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[Path, int] = {}  # temporary file -> descriptor holding its lock

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically.

        Raises:
            TypeError: ``storage_options`` given (nothing here uses them).
            OSError: the write or the rename failed (errno kept where known), naming ``path``,
                the cause (no space left, permission denied, ...) and the fix; the previous
                checkpoint at ``path`` is left as it was and no temporary file remains.
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
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(target.parent)
        except OSError as err:
            raise _save_error(err, target) from err
        temporary = self.write_temporary(checkpoint, target)
        try:
            self.commit(temporary, target)
        except OSError as err:
            renamed = not temporary.exists()  # the rename went through; a later step failed
            error = _save_error(err, target, renamed)
            temporary.unlink(missing_ok=True)
            raise error from err
        finally:
            self._release(temporary)

    def write_temporary(self, checkpoint: dict[str, Any], target: Path) -> Path:
        """Save to a new hidden file beside ``target`` and flush it to disk; return its path.

        The file stays locked (`flock`, exclusive) until `save_checkpoint` has renamed it, so that
        `remove_stale_temporaries` in another process leaves it alone.

        Raises:
            OSError: the file could not be created or written, from `_save_error`; the temporary
                file is removed.
        """
        fd, name = self._create_locked(target)
        try:
            with os.fdopen(os.dup(fd), "wb") as f:  # the lock stays with ``fd``
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as err:
            if isinstance(err, RuntimeError) and not _is_write_failure(err):
                self._discard(name)
                raise  # not about the file (e.g. a tensor that cannot be serialised)
            error = _save_error(err, target)  # before the unlink: the partial file holds the space
            self._discard(name)
            raise error from err
        except BaseException:
            self._discard(name)
            raise
        return name

    def _create_locked(self, target: Path) -> tuple[int, Path]:
        """A new temporary file beside ``target``, locked; retried if a cleaner removed it between
        its creation and the lock."""
        while True:
            try:
                fd, name = tempfile.mkstemp(
                    dir=target.parent, prefix=f".{target.name}.", suffix=_TEMP_SUFFIX
                )
            except OSError as err:
                raise _save_error(err, target) from err
            try:  # mkstemp's 0o600 would outlive the rename: the umask's mode, as any file
                give_default_mode(fd)
            except OSError:  # a file system without modes: the checkpoint is still written
                pass
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError:  # no locks on this file system: written unprotected
                    pass
                if os.fstat(fd).st_nlink == 0:  # removed before we held it: make another
                    os.close(fd)
                    continue
            self._held[Path(name)] = fd
            return fd, Path(name)

    def _discard(self, temporary: Path) -> None:
        temporary.unlink(missing_ok=True)
        self._release(temporary)

    def _release(self, temporary: Path) -> None:
        """Drop the lock on ``temporary`` (renamed, removed, or left by an interrupted save)."""
        fd = self._held.pop(temporary, None)
        if fd is not None:
            os.close(fd)

    def commit(self, temporary: Path, target: Path) -> None:
        """Rename ``temporary`` over ``target`` (atomic), then persist the directory entry."""
        os.replace(temporary, target)
        _fsync_directory(target.parent)


def _save_error(err: OSError | RuntimeError, target: Path, renamed: bool = False) -> OSError:
    """The error for a failed checkpoint write: the path, the cause and the fix, errno kept.

    The cause is "no space left on device" (``ENOSPC`` / ``EDQUOT``, or the directory's file
    system has less than 1 MiB free), "permission denied" (``EACCES`` / ``EPERM``), "read-only
    file system" (``EROFS``), or the original message. ``renamed``: the new file already
    replaced ``target`` (only persisting the directory entry failed).
    """
    code = getattr(err, "errno", None)
    directory = _existing_ancestor(target.parent)
    free = _free_bytes(directory)
    free_text = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    inconclusive = code is None or code == errno.EIO  # torch's writer gives no errno
    if code in (errno.ENOSPC, _EDQUOT) or (inconclusive and free is not None and free < _LOW_SPACE):
        code = code or errno.ENOSPC
        cause = "disk quota exceeded" if code == _EDQUOT else "no space left on device"
        cause = f"{cause} ({free_text} in {str(directory)!r})"
        fix = (
            "free space there, or point ModelCheckpoint(dirpath=...) / the trainer's "
            "default_root_dir at a disk with room"
        )
    elif code in (errno.EACCES, errno.EPERM) or isinstance(err, PermissionError):
        cause = f"permission denied in {str(directory)!r}"
        fix = (
            "make the directory writable for this user (chmod / chown), or choose another "
            "ModelCheckpoint(dirpath=...)"
        )
    elif directory.exists() and not directory.is_dir():
        cause = f"{str(directory)!r} is a file, not a directory"
        fix = "move it away, or choose another ModelCheckpoint(dirpath=...)"
    elif code == errno.EROFS:
        cause = f"{str(directory)!r} is on a read-only file system"
        fix = "choose a ModelCheckpoint(dirpath=...) on a writable disk"
    elif isinstance(err, RuntimeError):
        cause = (
            f"the write stopped short ({_first_line(err)}), which usually means no space left on "
            f"device or a quota reached ({free_text} in {str(directory)!r} now)"
        )
        fix = "free space or choose another ModelCheckpoint(dirpath=...)"
    else:
        cause = _first_line(err)
        fix = f"check {str(directory)!r} (disk, mount, permissions) or choose another dirpath"
    kept = " (the previous checkpoint there is unchanged)" if target.is_file() else ""
    if renamed:
        kept = " (written, but its directory entry may not be on disk yet)"
    message = f"could not save checkpoint {str(target)!r}{kept}: {cause}; {fix}"
    return OSError(code, message) if code is not None else OSError(message)


def _is_write_failure(err: RuntimeError) -> bool:
    return any(part in str(err) for part in _TORCH_WRITE_FAILURES)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _existing_ancestor(directory: Path) -> Path:
    """``directory`` or its nearest existing parent (a failed mkdir leaves it missing)."""
    while not directory.exists() and directory.parent != directory:
        directory = directory.parent
    return directory


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def remove_stale_temporaries(directory: str | os.PathLike, recursive: bool = False) -> list[Path]:
    """Delete the temporary files an `AtomicCheckpointIO` writer left in ``directory`` (and its
    subdirectories if ``recursive``) when it was killed before its rename; return their paths.

    Only files named as this writer names them (``.<target>.<8 random>.partial.tmp``, or the
    ``.<name>.ckpt.<8 random>.tmp`` of earlier versions) are considered, and only those that no
    live writer holds locked: another process's checkpoint being written is never touched.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    candidates = directory.rglob(".*.tmp") if recursive else directory.glob(".*.tmp")
    removed = []
    for path in sorted(candidates):
        own = _TEMPORARY.fullmatch(path.name) or _EARLIER_TEMPORARY.fullmatch(path.name)
        if own and not path.is_symlink() and path.is_file() and _remove_if_unheld(path):
            removed.append(path)
    return removed


def _remove_if_unheld(path: Path) -> bool:
    """Remove ``path`` unless a live writer holds its lock (checked while holding it)."""
    if fcntl is None:
        try:
            path.unlink()  # Windows refuses while the writer has it open
        except OSError:
            return False
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # gone already, or not ours to read
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live writer holds it
        try:
            path.unlink()
        except OSError:
            return False  # renamed by its writer just now, or not removable
        return True
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":  # Windows cannot open a directory; its rename is durable enough
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
