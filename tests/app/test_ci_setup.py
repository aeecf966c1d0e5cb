"""`.ci/setup` picks torch's build from the machine: it keeps a torch already installed, installs a
CUDA build where an NVIDIA GPU answers ``nvidia-smi -L`` and the CPU build elsewhere, and says
which build it has (`.ci/torch_report.py`).

The set-up runs for real, in a copy of ``.ci/`` with fakes first on ``PATH``: a ``python3`` that
makes a fake ``.venv`` and records every command given to it (``pip install`` of torch makes
``import torch`` succeed), and an ``nvidia-smi`` that lists a GPU or fails as it does without a
driver. Nothing is installed. ``.ci/torch_choice`` alone is run the same way, with an
``nvidia-smi`` that says "No devices were found" and exits 0.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Records its arguments. Copied to .venv/bin/python by "-m venv"; there, "import torch" works
# once pip installed torch, or when the venv sees the system's packages and they hold torch.
echo "$*" >> "$FAKE_LOG"
has_torch() {
    if [[ "$0" == *bin/python ]]; then
        [ -e "$FAKE_STATE/torch-in-venv" ] && return 0
        [ -e "$FAKE_STATE/system-site" ] || return 1
    fi
    [ -e "$FAKE_STATE/torch-in-system" ]
}
case "$1" in
    -m)
        if [ "$2" = venv ]; then
            mkdir -p "${@: -1}/bin"; cp "$0" "${@: -1}/bin/python"
            [ "$3" = --system-site-packages ] && touch "$FAKE_STATE/system-site"
        elif [ "$2" = pip ] && [[ " $* " == *" torch"* ]]; then
            touch "$FAKE_STATE/torch-in-venv"
        fi ;;
    -c) [[ "$2" == *"import torch"* ]] && { has_torch; exit $?; } ;;
    *) echo "REPORT from $1" ;;
esac
exit 0
"""

GPU_LIST = "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
    "that the latest NVIDIA driver is installed and running."
)


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def run_setup(tmp_path: Path, gpu: bool, torch_in: str | None) -> tuple[str, list[str]]:
    """``bash .ci/setup`` in a copy of ``.ci/`` with fakes: ``gpu`` says whether ``nvidia-smi
    -L`` lists one; ``torch_in`` is where torch is installed before ("venv", "system" or None).
    Returns the set-up's output and the commands the fake Pythons were given."""
    checkout, bin_dir, state = tmp_path / "checkout", tmp_path / "bin", tmp_path / "state"
    for folder in (bin_dir, state):
        folder.mkdir()
    shutil.copytree(REPO / ".ci", checkout / ".ci")
    _executable(bin_dir / "python3", FAKE_PYTHON)
    smi = f"echo '{GPU_LIST}'" if gpu else f'echo "{NO_DRIVER}"; exit 9'
    _executable(bin_dir / "nvidia-smi", f"#!/usr/bin/env bash\n{smi}\n")
    if torch_in == "venv":
        (checkout / ".venv" / "bin").mkdir(parents=True)
        shutil.copy(bin_dir / "python3", checkout / ".venv" / "bin" / "python")
        (state / "torch-in-venv").touch()
    elif torch_in == "system":
        (state / "torch-in-system").touch()
    log = tmp_path / "commands.log"
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHON"},
        "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
        "FAKE_LOG": str(log),
        "FAKE_STATE": str(state),
    }
    done = subprocess.run(
        ["bash", str(checkout / ".ci" / "setup")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, log.read_text().splitlines()


def torch_installs(commands: list[str]) -> list[str]:
    return [c for c in commands if c.startswith("-m pip install") and " torch" in f" {c}"]


def test_an_nvidia_gpu_gets_a_cuda_build(tmp_path: Path) -> None:
    out, commands = run_setup(tmp_path, gpu=True, torch_in=None)
    assert torch_installs(commands) == ["-m pip install --quiet torch>=2.4"]
    assert "CUDA build" in out
    assert commands[-1] == ".ci/torch_report.py"  # it says which build it installed
    assert "REPORT from .ci/torch_report.py" in out


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-machine", "gpu-machine"])
def test_an_installed_torch_is_kept(tmp_path: Path, gpu: bool) -> None:
    out, commands = run_setup(tmp_path, gpu=gpu, torch_in="venv")
    assert torch_installs(commands) == []
    assert "kept" in out and "REPORT from .ci/torch_report.py" in out


def test_a_gpu_images_torch_is_kept_through_the_system_packages(tmp_path: Path) -> None:
    out, commands = run_setup(tmp_path, gpu=True, torch_in="system")
    venv = [c for c in commands if c.startswith("-m venv")]
    assert venv == ["-m venv --system-site-packages .venv"]
    assert torch_installs(commands) == []
    assert "kept" in out


def test_without_a_gpu_the_cpu_build(tmp_path: Path) -> None:
    out, commands = run_setup(tmp_path, gpu=False, torch_in=None)
    assert [c for c in commands if c.startswith("-m venv")] == ["-m venv .venv"]
    assert torch_installs(commands) == ["-m pip install --quiet torch==2.13.0"]
    assert "no NVIDIA GPU" in out


@pytest.mark.parametrize(
    ("smi_output", "smi_status", "has_torch", "choice"),
    [
        ("No devices were found", 0, False, "cpu"),  # the driver answers, with no GPU: status 0
        ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1b2c3d4e-0000-0000-0000-000000000000)", 0, False,
         "cuda"),
        (NO_DRIVER, 9, False, "cpu"),
        (GPU_LIST, 0, True, "keep"),
    ],
    ids=["no-devices", "h100", "no-driver", "torch-installed"],
)  # fmt: skip
def test_torch_choice_reads_the_gpu_list_not_the_exit_status(
    tmp_path: Path, smi_output: str, smi_status: int, has_torch: bool, choice: str
) -> None:
    """``.ci/torch_choice`` with a fake ``nvidia-smi`` first on ``PATH`` and a fake Python whose
    ``import torch`` fails (or works): ``nvidia-smi -L`` exits 0 with "No devices were found" on
    a machine whose driver sees no GPU, so only a listed ``GPU N:`` line means a GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(
        bin_dir / "nvidia-smi", f"#!/usr/bin/env bash\necho '{smi_output}'\nexit {smi_status}\n"
    )
    _executable(bin_dir / "python", f"#!/usr/bin/env bash\nexit {0 if has_torch else 1}\n")
    done = subprocess.run(
        ["bash", str(REPO / ".ci" / "torch_choice"), str(bin_dir / "python")],
        env={**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]])},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{choice}\n"


def test_the_report_names_this_torch() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "torch_report.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    assert done.stdout.startswith(f"setup: torch {torch.__version__} ({build});")
