"""Files this package writes get the permissions of any file the user creates: ``0o666`` less
the process's umask (``-rw-r--r--`` under the usual umask 022).

`tempfile.mkstemp`, which atomic writes use (a checkpoint's temporary file, then renamed over
``last.ckpt``; safetensors' own writes in an export), creates ``0o600`` files whatever the
umask, so a teammate on a shared machine could not read a checkpoint or an export.
`give_default_mode` puts the umask's mode back on them.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_file_mode", "give_default_mode", "umask"]


def umask() -> int:
    """The process's umask: read from ``/proc/self/status`` where the kernel lists it (reading
    it otherwise means setting it, which another thread creating a file at that moment sees)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666 & ~umask``."""
    return 0o666 & ~umask()


def give_default_mode(target: int | str | os.PathLike[str]) -> None:
    """Set ``target`` (an open descriptor or a path) to `default_file_mode`; directories keep
    theirs, as do files whose mode was not the owner-only one of `tempfile.mkstemp`.

    Raises:
        OSError: the mode cannot be changed (not the owner, a read-only file system).
    """
    mode = default_file_mode()
    if isinstance(target, int):
        os.fchmod(target, mode)
        return
    if Path(target).is_file() and (os.stat(target).st_mode & 0o777) == 0o600:
        os.chmod(target, mode)
