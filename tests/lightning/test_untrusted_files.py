"""No file a user hands in is unpickled with arbitrary globals: a crafted checkpoint whose
``__reduce__`` runs code is refused by every loader of the package (``LoadWeights``,
``FlopCounter(previous=...)``, ``export`` of a checkpoint, ``lightning-sparse export``), the
message names the file and the opt-in, and no code ran. ``trust_file=True`` opts in.
"""

from __future__ import annotations

import builtins
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sparse import FlopCounter, LoadWeights
from lightning_sparse.core.safe_load import UntrustedFileError, load_torch_file


class RunsCode:
    """Unpickling this runs ``open(marker, "w")``: the shape of a malicious checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",))


def crafted_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """(a checkpoint that runs code when unpickled, the file that code creates)."""
    marker = tmp_path / "code_ran"
    path = tmp_path / "downloaded.ckpt"
    state = {"weight": torch.zeros(2, 2)}
    torch.save(
        {
            "state_dict": state,
            "hyper_parameters": {"vocab_size": 16},
            "callbacks": {"FlopCounter": {"segments": [], "payload": RunsCode(marker)}},
            "payload": RunsCode(marker),
        },
        path,
    )
    return path, marker


def _load_weights(path: Path, **kw: Any) -> None:
    trainer = SimpleNamespace(is_global_zero=False, accelerator=None)  # what setup reads
    LoadWeights(str(path), **kw).setup(trainer, nn.Linear(2, 2), "fit")  # type: ignore[arg-type]


def _flop_counter(path: Path, **kw: Any) -> None:
    FlopCounter(previous=str(path), **kw).setup(None, nn.Linear(2, 2), "fit")  # type: ignore[arg-type]


def _export(path: Path, **kw: Any) -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("export needs transformers")
    from lightning_sparse import export

    export(path, path.parent / "out", **kw)


def _export_cli(path: Path, **kw: Any) -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("export needs transformers")
    from lightning_sparse.app import export_cmd

    export_cmd.main(["--ckpt_path", str(path), "--output", str(path.parent / "out")])


LOADERS: dict[str, tuple[Callable[..., None], str]] = {
    "load_torch_file": (lambda p, **kw: load_torch_file(p, **kw), r"trust_file=True"),
    "LoadWeights": (_load_weights, r"LoadWeights\(trust_file=True\)"),
    "FlopCounter": (_flop_counter, r"FlopCounter\(trust_file=True\)"),
    "export": (_export, r"trust_file=True \(CLI: --trust-file\)"),
}


def test_the_crafted_checkpoint_does_run_code_when_unpickled(tmp_path: Path) -> None:
    """The control: the file is live (so the refusals below are what keep the code from running)."""
    path, marker = crafted_checkpoint(tmp_path)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_loader_refuses_a_crafted_pickle_and_runs_no_code(
    tmp_path: Path, loader: str
) -> None:
    path, marker = crafted_checkpoint(tmp_path)
    load, opt_in = LOADERS[loader]
    with pytest.raises(UntrustedFileError) as refused:
        load(path)
    message = str(refused.value)
    assert f"'{path}'" in message and "GLOBAL exec" in message
    assert "would run code" in message and re.search(opt_in, message), message
    assert not marker.exists()


def test_the_cli_refuses_it_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, marker = crafted_checkpoint(tmp_path)
    with pytest.raises(SystemExit) as exited:
        _export_cli(path)
    err = capsys.readouterr().err
    assert exited.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert f"'{path}'" in err and "--trust-file" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_trust_file_opts_in(tmp_path: Path) -> None:
    path, marker = crafted_checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match="Missing key"):  # loaded, then the keys differ
        _load_weights(path, trust_file=True)
    assert marker.exists()


def test_plain_checkpoints_load_and_other_files_are_named(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    torch.save({"state_dict": model.state_dict(), "betas": (0.9, 0.95)}, tmp_path / "ok.ckpt")
    target = nn.Linear(2, 2)
    trainer = SimpleNamespace(is_global_zero=False, accelerator=None)
    LoadWeights(str(tmp_path / "ok.ckpt")).setup(trainer, target, "fit")  # type: ignore[arg-type]
    assert torch.equal(target.weight, model.weight)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"'.*notes.txt' is not a file torch.load reads") as text:
        load_torch_file(tmp_path / "notes.txt", opt_in="--trust-file")
    # Loading it with objects allowed would not help: the opt-in is not offered for it.
    assert "--trust-file" not in str(text.value) and "trust" not in str(text.value)
    good = (tmp_path / "ok.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="truncated file") as cut:
        load_torch_file(tmp_path / "cut.ckpt", opt_in="--trust-file")
    assert "trust" not in str(cut.value) and len(str(cut.value)) < 500
    with pytest.raises(FileNotFoundError, match=r"'.*missing.ckpt' is not a file"):
        load_torch_file(tmp_path / "missing.ckpt")


@pytest.mark.parametrize("trust_file", [False, True])
def test_a_checkpoint_saved_on_a_gpu_loads_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trust_file: bool
) -> None:
    """A file written on a GPU machine records its tensors' device (``cuda:0``); read without
    ``map_location`` it fails here (no CUDA) or lands on the GPU. `load_torch_file` reads it onto
    the CPU. The file is made as a GPU run writes it: torch.save, with every storage's location
    tag saying ``cuda:0``."""
    import torch.serialization as serialization

    monkeypatch.setattr(serialization, "location_tag", lambda storage: "cuda:0")
    path = tmp_path / "gpu.ckpt"
    state = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}
    torch.save(state, path)
    monkeypatch.undo()
    assert b"cuda:0" in path.read_bytes()  # the file says where its tensors were
    loaded = load_torch_file(path, trust_file=trust_file)
    weight = loaded["state_dict"]["w"]
    assert weight.device.type == "cpu" and torch.equal(weight, state["state_dict"]["w"])
    assert loaded["step"] == 3
