"""Prints which torch build .ci/setup installed or kept, and whether it can use the GPU here."""

import shutil
import subprocess

import torch

build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"setup: torch {torch.__version__} ({build}); GPU used by torch: {gpu}")
smi = shutil.which("nvidia-smi")
listed = smi and subprocess.run([smi, "-L"], capture_output=True, text=True).stdout
if listed and listed.startswith("GPU") and not torch.version.cuda:
    print(
        "setup: this machine has an NVIDIA GPU but torch is a CPU build, so runs train on the "
        "CPU; for the GPU: .venv/bin/python -m pip uninstall -y torch && bash .ci/setup"
    )
