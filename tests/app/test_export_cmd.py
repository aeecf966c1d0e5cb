"""`lightning-sparse export` failures: a read-only directory, a full disk (an ``OSError`` or
safetensors' own error), a missing checkpoint, a bad option, an existing folder. Each is one line
on stderr naming the file and the fix, a non-zero exit status, no traceback, nothing written.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import SafetensorError  # noqa: E402

from lightning_sparse import Static  # noqa: E402
from lightning_sparse.app import cli  # noqa: E402
from lightning_sparse.models import LitCausalLM  # noqa: E402
from tests.helpers import one_thread, repo_pythonpath  # noqa: E402, F401  (autouse: one torch thread)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A tiny ``fit``-style checkpoint in ``run/checkpoints/last.ckpt``."""
    torch.manual_seed(0)
    lit = LitCausalLM(vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=32)
    lit.apply(Static(0.8))
    path = tmp_path / "run/checkpoints/last.ckpt"
    path.parent.mkdir(parents=True)
    hparams = {"_class_path": "lightning_sparse.models.LitCausalLM", **lit.hparams}
    torch.save({"hyper_parameters": hparams, "state_dict": lit.state_dict()}, path)
    return path


def export_fails(args: list[str], capsys: pytest.CaptureFixture[str], status: int = 1) -> str:
    """Run ``lightning-sparse export ARGS``; return its one stderr line (checked)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main(["export", *args])
    captured = capsys.readouterr()
    assert exited.value.code == status
    assert captured.err.startswith("lightning-sparse export: ") and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err and not captured.out
    return captured.err


def test_a_read_only_directory(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    if os.access(readonly, os.W_OK):  # root ignores the mode: refuse as the kernel would
        real = Path.mkdir

        def mkdir(self: Path, *args: object, **kwargs: object) -> None:
            if self.parent == readonly:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            real(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "mkdir", mkdir)
    err = export_fails(["--ckpt_path", str(ckpt), "--output", str(readonly / "model")], capsys)
    assert f"export to '{readonly / 'model'}' failed" in err and "Permission denied" in err
    assert "choose an output in a directory you can write to" in err
    readonly.chmod(0o755)
    assert list(readonly.iterdir()) == []


@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_a_full_disk(
    tmp_path: Path,
    ckpt: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: str,
) -> None:
    import transformers.modeling_utils as modeling_utils

    def full(tensors: object, filename: str, metadata: object = None) -> None:
        if error == "OSError":
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
            'space left on device" })'
        )

    monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    out = tmp_path / "model"
    err = export_fails(["--ckpt_path", str(ckpt), "--output", str(out)], capsys)
    assert f"export to '{out}' failed" in err and "free space on that disk" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging directory left


def test_a_missing_checkpoint_a_bad_format_and_an_existing_folder(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "run/checkpoints/nope.ckpt"
    err = export_fails(["--ckpt_path", str(missing), "--output", str(tmp_path / "m")], capsys)
    assert f"checkpoint '{missing}' is not a file; fix the path" in err
    err = export_fails(
        ["--ckpt_path", str(ckpt), "--output", str(tmp_path / "m"), "--format", "onnx"],
        capsys,
        status=2,
    )
    assert "invalid choice: 'onnx'" in err and "lightning-sparse export --help" in err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    err = export_fails(["--ckpt_path", str(ckpt), "--output", str(mine), "--overwrite"], capsys)
    # The command names its flags, not export()'s keyword arguments.
    assert f"--output '{mine}' exists and has no valid lightning_sparse_export.json" in err
    assert "overwrite=True" not in err and "--overwrite replaces only an export" in err
    assert (mine / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run"]


def test_the_real_entry_point_prints_one_line(tmp_path: Path) -> None:
    """The installed command's path (``python -m lightning_sparse.app.cli``), end to end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath()}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_sparse.app.cli", "export", "--ckpt_path",
         str(tmp_path / "gone.ckpt"), "--output", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and not done.stdout
    assert done.stderr == (
        f"lightning-sparse export: checkpoint '{tmp_path / 'gone.ckpt'}' is not a file; "
        "fix the path\n"
    )
