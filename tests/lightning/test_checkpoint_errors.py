"""A failed checkpoint write names the checkpoint, the cause and the fix, and keeps the old one.

Full disks and permission problems are simulated (the tests run as root, where a read-only
directory still takes writes); ``/dev/full`` gives a real ``ENOSPC`` from the kernel, and a target
that is a directory a real failing rename.
"""

from __future__ import annotations

import errno
import os
import pickle
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_sparse.lightning import checkpointing
from lightning_sparse.lightning.checkpointing import AtomicCheckpointIO
from tests.helpers import TinyLM, one_thread, token_loader, trainer  # noqa: F401  (autouse)

TORCH_FULL_DISK = "[enforce fail at inline_container.cc:664] . unexpected pos 123 vs 45"
OLD = {"step": 1, "w": torch.arange(6.0)}


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """``ckpts/last.ckpt`` holding a good checkpoint written before the failure."""
    path = tmp_path / "ckpts" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(OLD, path)
    return path


def assert_old_checkpoint_intact(target: Path) -> None:
    loaded = torch.load(target)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], OLD["w"])
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"], "a temporary file is left"


def save_failing(target: Path) -> OSError:
    with pytest.raises(OSError) as info:
        AtomicCheckpointIO().save_checkpoint({"step": 2, "w": torch.zeros(1000)}, target)
    return info.value


def torch_save_raising(error: BaseException) -> Any:
    """A ``torch.save`` that writes part of the file, then fails like torch's zip writer."""

    def fake(obj: object, f: Any, *args: object, **kwargs: object) -> None:
        f.write(b"PK\x03\x04 partial")
        raise error

    return fake


def no_free_space(path: object) -> SimpleNamespace:
    """``shutil.disk_usage`` of a full disk."""
    return SimpleNamespace(total=10 * 2**30, used=10 * 2**30, free=0)


def assert_names(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} missing from: {message}"


# ---------------------------------------------------------------- full disk


def test_torch_enforce_fail_on_a_full_disk(monkeypatch: pytest.MonkeyPatch, target: Path) -> None:
    monkeypatch.setattr(torch, "save", torch_save_raising(RuntimeError(TORCH_FULL_DISK)))
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", no_free_space)
    error = save_failing(target)
    assert error.errno == errno.ENOSPC
    assert isinstance(error.__cause__, RuntimeError)
    assert_names(
        str(error),
        repr(str(target)),
        "no space left on device",
        "0.0 MiB free",
        "free space",
        "dirpath",
        "previous checkpoint there is unchanged",
    )
    assert_old_checkpoint_intact(target)


def test_torch_enforce_fail_with_space_left_still_points_at_the_disk(
    monkeypatch: pytest.MonkeyPatch, target: Path
) -> None:
    """The partial file is deleted before the user looks: say what the message usually means."""
    monkeypatch.setattr(torch, "save", torch_save_raising(RuntimeError(TORCH_FULL_DISK)))
    error = save_failing(target)
    assert_names(
        str(error),
        repr(str(target)),
        "unexpected pos 123 vs 45",
        "no space left on device",
        "dirpath",
    )
    assert_old_checkpoint_intact(target)


@pytest.mark.parametrize(
    ("code", "cause"),
    [(errno.ENOSPC, "no space left on device"), (getattr(errno, "EDQUOT", errno.ENOSPC), "quota")],
)
def test_oserror_enospc_keeps_its_errno(
    monkeypatch: pytest.MonkeyPatch, target: Path, code: int, cause: str
) -> None:
    failure = OSError(code, os.strerror(code))
    monkeypatch.setattr(torch, "save", torch_save_raising(failure))
    error = save_failing(target)
    assert error.errno == code and error.__cause__ is failure
    assert_names(str(error), repr(str(target)), cause, "MiB free", "dirpath")
    assert_old_checkpoint_intact(target)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_real_enospc_from_the_kernel(monkeypatch: pytest.MonkeyPatch, target: Path) -> None:
    """The temporary file's writes go to /dev/full: torch and Python raise what they really do."""
    real_fdopen = os.fdopen

    def full_fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        os.close(fd)
        return real_fdopen(os.open("/dev/full", os.O_WRONLY), *args, **kwargs)

    monkeypatch.setattr(checkpointing.os, "fdopen", full_fdopen)
    error = save_failing(target)
    monkeypatch.undo()
    assert error.errno == errno.ENOSPC
    assert_names(str(error), repr(str(target)), "no space left on device", "dirpath")
    assert_old_checkpoint_intact(target)


# ---------------------------------------------------------------- permissions


def test_directory_not_writable(monkeypatch: pytest.MonkeyPatch, target: Path) -> None:
    def denied(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(errno.EACCES, "Permission denied", str(target.parent))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    error = save_failing(target)
    assert isinstance(error, PermissionError) and error.errno == errno.EACCES
    assert_names(
        str(error),
        repr(str(target)),
        "permission denied",
        repr(str(target.parent)),
        "chmod",
        "dirpath",
    )
    assert_old_checkpoint_intact(target)


def test_rename_denied_removes_the_temporary(monkeypatch: pytest.MonkeyPatch, target: Path) -> None:
    def denied(src: object, dst: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(src), None, str(dst))

    monkeypatch.setattr(checkpointing.os, "replace", denied)
    error = save_failing(target)
    monkeypatch.undo()
    assert error.errno == errno.EPERM
    assert_names(str(error), repr(str(target)), "permission denied", "chmod")
    assert_old_checkpoint_intact(target)


def test_directory_that_cannot_be_created(tmp_path: Path) -> None:
    """Real failure: a file stands where the checkpoint directory should be."""
    (tmp_path / "ckpts").write_text("not a directory")
    error = save_failing(tmp_path / "ckpts" / "last.ckpt")
    assert error.errno in (errno.EEXIST, errno.ENOTDIR)
    assert_names(
        str(error),
        repr(str(tmp_path / "ckpts" / "last.ckpt")),
        f"{str(tmp_path / 'ckpts')!r} is a file, not a directory",
        "dirpath",
    )
    assert (tmp_path / "ckpts").read_text() == "not a directory"


# ---------------------------------------------------------------- other causes


def test_target_is_a_directory_keeps_the_original_message(tmp_path: Path) -> None:
    """Real failure: ``os.replace`` of a file over a non-empty directory."""
    target = tmp_path / "last.ckpt"
    (target / "inside").mkdir(parents=True)
    error = save_failing(target)
    assert error.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert_names(str(error), repr(str(target)), os.strerror(error.errno), "dirpath")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary left
    assert [p.name for p in target.iterdir()] == ["inside"]


def test_unrelated_runtime_error_passes_through(
    monkeypatch: pytest.MonkeyPatch, target: Path
) -> None:
    """Only write failures become OSError; a serialisation bug keeps its own type."""
    monkeypatch.setattr(torch, "save", torch_save_raising(RuntimeError("cannot pickle 'Foo'")))
    with pytest.raises(RuntimeError, match="cannot pickle 'Foo'"):
        AtomicCheckpointIO().save_checkpoint({"step": 2}, target)
    assert_old_checkpoint_intact(target)


def test_interrupted_commit_is_not_converted(target: Path) -> None:
    """A kill (KeyboardInterrupt) is no write error: it propagates, the old file stays whole."""

    class Interrupted(AtomicCheckpointIO):
        def commit(self, temporary: Path, target: Path) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Interrupted().save_checkpoint({"step": 2}, target)
    assert torch.load(target)["step"] == 1


# ---------------------------------------------------------------- through a Trainer


def test_trainer_save_checkpoint_on_a_full_disk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fit = trainer(tmp_path, plugins=[AtomicCheckpointIO()], max_steps=1)
    fit.fit(TinyLM(), token_loader(n=8))
    path = tmp_path / "ckpts" / "last.ckpt"
    fit.save_checkpoint(path)
    before = path.read_bytes()
    monkeypatch.setattr(torch, "save", torch_save_raising(RuntimeError(TORCH_FULL_DISK)))
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", no_free_space)
    with pytest.raises(OSError) as info:
        fit.save_checkpoint(path)
    assert_names(str(info.value), repr(str(path)), "no space left on device", "dirpath")
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_failure_after_the_rename_does_not_claim_the_old_file(
    monkeypatch: pytest.MonkeyPatch, target: Path
) -> None:
    """Persisting the directory entry failed: the new file is in place, and the message says so."""

    def broken(directory: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpointing, "_fsync_directory", broken)
    error = save_failing(target)
    assert error.errno == errno.EIO
    assert_names(str(error), repr(str(target)), "written, but", "Input/output error")
    assert "previous checkpoint there is unchanged" not in str(error)
    monkeypatch.undo()
    assert torch.load(target)["step"] == 2


@pytest.mark.parametrize("unsaveable", ["lambda", "interrupt"])
def test_a_checkpoint_that_cannot_be_serialised_leaves_the_old_one_and_no_temporary(
    target: Path, monkeypatch: pytest.MonkeyPatch, unsaveable: str
) -> None:
    """A failure that is not about the file (a value pickle refuses; Ctrl-C mid-write) goes up
    as it is, with the old checkpoint intact and the partial temporary file removed."""
    if unsaveable == "lambda":
        with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
            AtomicCheckpointIO().save_checkpoint({"step": 2, "f": lambda: 0}, target)
    else:
        monkeypatch.setattr(torch, "save", torch_save_raising(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            AtomicCheckpointIO().save_checkpoint({"step": 2, "w": torch.zeros(1000)}, target)
    assert_old_checkpoint_intact(target)
