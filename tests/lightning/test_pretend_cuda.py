"""``LIGHTNING_SPARSE_PRETEND_CUDA=1`` (docs/gpu.md) runs tests as Lightning sees a GPU machine,
and the tests that mean the CPU pass there.

On the H200 of issue 26, tests that left the accelerator to Lightning ran on CUDA, and a test that
turned every warning into an error failed on "GPU available but not used". These run such tests
here in a pytest of their own under the pretended GPU, and check the pretence took hold.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, nested_pytest_env

PRETEND = {"LIGHTNING_SPARSE_PRETEND_CUDA": "1", "OMP_NUM_THREADS": "1"}
CHECK = """
import warnings
import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

assert isinstance(pl.Trainer(logger=False).accelerator, CUDAAccelerator)  # "auto"
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert isinstance(pl.Trainer(accelerator="cpu", logger=False).accelerator, CPUAccelerator)
assert any("GPU available but not used" in str(w.message) for w in seen)
assert not torch.cuda.is_available()  # torch itself is not fooled: cuda tests stay skipped
print("pretended")
"""


def test_every_process_a_test_starts_counts_the_pretended_gpu() -> None:
    """Through ``sitecustomize`` on ``PYTHONPATH``, as ``tests/conftest.py`` sets it up."""
    env = {
        **os.environ,
        **PRETEND,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "pretend_cuda"), str(REPO)]),
    }
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "pretended", done.stderr[-3000:]


def test_cpu_tests_pass_as_on_a_gpu_machine(tmp_path: Path) -> None:
    """A test that makes every warning an error, and one that runs the default recipe (which says
    ``accelerator: auto``) through the CLI and validates its checkpoint, both pinned to the CPU."""
    pytest.importorskip("jsonargparse")  # the command's (an optional package)
    tests = [
        "tests/lightning/test_loading.py::test_ckpt_path_into_a_plain_module_without_the_callback"
        "[static-validate]",
        "tests/lightning/test_loading.py::"
        "test_cli_checkpoint_loads_with_load_from_checkpoint_and_validate",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "log_cli=true",
         "--log-cli-level=INFO", f"--basetemp={tmp_path / 'base'}", *tests],
        cwd=REPO,
        env=nested_pytest_env(**PRETEND),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    assert "2 passed" in done.stdout
    # The pretence held: Lightning saw a GPU and the tests' Trainers did not use it.
    assert "GPU available: True (cuda), used: False" in done.stdout
