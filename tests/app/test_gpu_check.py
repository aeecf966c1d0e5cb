"""`benchmarks/gpu_check.sh` (docs/gpu.md): its dry run passes on any machine, a wheel missing
from the folder skips only the parts that need its package, the test parts collect without the
optional packages the GPU image lacks, and the wheel folder it installs on a GPU machine without a
package index is checked complete and closed (`benchmarks/gpu_wheels.py`)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import nested_pytest_env

REPO = Path(__file__).resolve().parents[2]


def _wheels_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_wheels", REPO / "benchmarks/gpu_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_wheels = _wheels_module()


def run_check(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), *args, "--out", str(tmp_path / "logs")],
        env=nested_pytest_env(PYTHON=sys.executable, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_dry_run_checks_every_part_in_a_cpu_form(tmp_path: Path) -> None:
    done = run_check("--dry-run", "--wheels", str(tmp_path / "none"), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    table = (tmp_path / "logs" / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in table] == [
        ["setup", "ok"], ["cuda", "ok"], ["suite", "ok"], ["fit", "ok"], ["bench", "ok"]
    ]  # fmt: skip
    logs = tmp_path / "logs"
    assert "tests collected" in (logs / "suite.log").read_text()
    assert "class_path: lightning.pytorch.loggers.WandbLogger" in (logs / "fit.log").read_text()
    bench = (logs / "bench.log").read_text()  # the benchmark's own loop, small, on the CPU
    assert "sparsity check: rigl update 0.800" in bench and "timed round 3/3" in bench


def test_a_failing_part_is_reported_and_the_rest_still_run(tmp_path: Path) -> None:
    """A part that fails (here: the CUDA tests' collection, given 10 ms) is in the table and the
    exit status, and the parts after it still run (the suite's collection)."""
    args = ("--dry-run", "--parts", "cuda,suite", "--timeout", "cuda=0.01")
    done = run_check(*args, tmp_path=tmp_path)
    table = (tmp_path / "logs" / "summary.txt").read_text()
    assert done.returncode == 1, done.stdout
    assert [line.split()[:2] for line in table.splitlines()] == [
        ["setup", "ok"], ["cuda", "TIMEOUT"], ["suite", "ok"]
    ]  # fmt: skip


def complete_folder(folder: Path) -> Path:
    """A wheel for every pin of benchmarks/gpu_wheels.txt (empty ones): `check` finds it ready;
    jsonargparse's ``signatures`` extra needs docstring-parser, as the real wheel says."""
    folder.mkdir()
    for pin in gpu_wheels.names(gpu_wheels.PINS):
        name, version = pin.split("==")
        requires = (
            ['docstring-parser>=0.17; extra == "signatures"'] if name == "jsonargparse" else []
        )
        _wheel(folder, name, version, requires)
    assert gpu_wheels.problems(folder, gpu_wheels.names(gpu_wheels.PINS), []) == []
    return folder


def table_of(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """``{part: (status, note)}`` of the dry run's summary table."""
    rows = (tmp_path / "logs" / "summary.txt").read_text().splitlines()
    return {r.split()[0]: (r.split()[1], r.split(maxsplit=3)[3]) for r in rows if "s  " in r}


def test_a_missing_wheel_skips_only_the_parts_that_need_it(tmp_path: Path) -> None:
    """No wandb wheel and none of jsonargparse's docstring-parser: the command (fit) cannot run
    and is skipped, naming both; the CUDA tests, the suite and the benchmark still run."""
    wheels = complete_folder(tmp_path / "whl")
    (wheels / "wandb-0.31.0-py3-none-any.whl").unlink()
    (wheels / "docstring_parser-0.18.0-py3-none-any.whl").unlink()
    done = run_check("--dry-run", "--wheels", str(wheels), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    table = table_of(tmp_path)
    assert {part: status for part, (status, _) in table.items()} == {
        "setup": "ok", "cuda": "ok", "suite": "ok", "fit": "SKIPPED", "bench": "ok"
    }  # fmt: skip
    assert "wheel folder not ready" in table["setup"][1]
    assert table["setup"][1].endswith("without: jsonargparse wandb")
    assert table["fit"][1] == (
        f"needs jsonargparse: no wheel for docstring-parser in {wheels}, which jsonargparse needs"
    )
    for part in ("cuda", "suite"):
        assert table[part][1].startswith("(without jsonargparse, wandb: their tests skip) ")
    assert not (tmp_path / "logs" / "fit.log").exists()


def test_without_wandb_the_job_writes_csv_logs(tmp_path: Path) -> None:
    wheels = complete_folder(tmp_path / "whl")
    (wheels / "wandb-0.31.0-py3-none-any.whl").unlink()
    done = run_check("--dry-run", "--parts", "fit", "--wheels", str(wheels), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    status, note = table_of(tmp_path)["fit"]
    assert status == "ok"
    assert note.startswith(f"CSV logs, no wandb: no wheel for wandb in {wheels}; config parses")
    config = (tmp_path / "logs" / "fit.log").read_text()
    assert "class_path: lightning.pytorch.loggers.CSVLogger" in config
    assert "WandbLogger" not in config


def test_missing_names_what_the_folder_or_this_python_cannot_provide(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dependency's wheel gone (pydantic) makes its root (wandb) missing; a root with no wheel
    (compressed-tensors) is named itself; without a folder, what this Python cannot import."""
    (folder / "pydantic-2.14.4-py3-none-any.whl").unlink()
    why = gpu_wheels.missing(folder, ["requests"])
    assert why == {
        "wandb": f"no wheel for pydantic in {folder}, which wandb needs",
        "compressed-tensors": f"no wheel for compressed-tensors in {folder}",
    }
    imports = {**gpu_wheels.IMPORTS, "hypothesis": ("hypothesis", "no_such_module_here")}
    monkeypatch.setattr(gpu_wheels, "IMPORTS", imports)
    assert gpu_wheels.missing(None, []) == {
        "hypothesis": "not installed (no_such_module_here cannot be imported)"
    }


# Tests that need an optional package at run time only (not when collected): each must skip.
NEEDS_OPTIONAL_AT_RUN_TIME = [
    "tests/lightning/test_lightning.py::test_lightning_cli_yaml_configures_callbacks",
    "tests/lightning/test_lightning.py::test_lightning_cli_yaml_configures_a_group",
    "tests/lightning/test_loading.py::"
    "test_cli_checkpoint_loads_with_load_from_checkpoint_and_validate",
    "tests/lightning/test_pretend_cuda.py::test_cpu_tests_pass_as_on_a_gpu_machine",
    "tests/lightning/test_workflows.py::test_imp_recipe_runs",
    "tests/wse/test_wse_device.py::test_names_registered_for_python_and_yaml",
    "tests/integrations/test_lit_checkpoint.py::"
    "test_a_checkpoint_outside_its_run_directory_reads_no_config",
    "tests/integrations/test_export_safety.py::test_overwrite_replaces_an_export_or_an_empty_folder",
    "tests/models/test_hf_lm.py::test_hf_llama_tiny_recipe_trains_through_the_cli",
]
SUITE_DIRS = ["tests/core", "tests/lightning", "tests/wse", "tests/integrations", "tests/models"]


def hidden_pytest(*args: str) -> subprocess.CompletedProcess:
    """pytest with jsonargparse, wandb and compressed-tensors hidden (tests/scripts/
    hide_optional.py), as on the GPU image without their wheels."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "-p", "tests.scripts.hide_optional", *args],
        cwd=REPO,
        env=nested_pytest_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip


def test_the_test_parts_collect_and_skip_without_the_optional_packages() -> None:
    """What gpu_check.sh's cuda and suite parts run: no collection error without the optional
    packages (a test file that imports the command at the top fails this), and the tests that
    need one at run time skip."""
    cuda_files = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "mark.cuda" in p.read_text()
    )
    collected = hidden_pytest("--collect-only", "-m", "not slow", *SUITE_DIRS, *cuda_files)
    assert collected.returncode == 0, collected.stdout[-3000:]
    assert "tests/lightning/test_wandb.py:" in collected.stdout  # skipped: the hiding holds
    ran = hidden_pytest(*NEEDS_OPTIONAL_AT_RUN_TIME)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert f"{len(NEEDS_OPTIONAL_AT_RUN_TIME)} skipped" in ran.stdout, ran.stdout[-3000:]


def test_bad_options_are_refused(tmp_path: Path) -> None:
    for args, message in (
        (["--parts", "cuda,gpu"], "no part 'gpu'"),
        (["--timeout", "setup=5"], "no part 'setup'"),
        (["--frobnicate"], "unknown option --frobnicate"),
    ):
        done = run_check(*args, tmp_path=tmp_path)
        assert done.returncode == 2 and message in done.stdout, (args, done.stdout)


# ------------------------------------------------------------------ the wheel folder's check
def _wheel(
    folder: Path, name: str, version: str, requires: list[str], tag: str = "py3-none-any"
) -> None:
    stem = f"{name.replace('-', '_')}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {line}\n" for line in requires
    )
    with zipfile.ZipFile(folder / f"{stem}-{tag}.whl", "w") as archive:
        archive.writestr(f"{stem}.dist-info/METADATA", metadata)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A closed set: wandb needs pydantic (a wheel) and requests (the image); jsonargparse's
    signatures extra needs docstring-parser; what markers exclude on CPython 3.12 is not needed."""
    _wheel(tmp_path, "wandb", "0.31.0", ["pydantic<3,>=2.6", "requests", "boto3; extra == 'aws'"])
    _wheel(tmp_path, "pydantic", "2.14.4", ['tzdata; platform_system == "Windows"'])
    _wheel(
        tmp_path,
        "jsonargparse",
        "4.53.0",
        ['docstring-parser>=0.17; extra == "signatures"', 'toml; extra == "toml"',
         'typing-extensions>=4.12.0; python_version < "3.11" and extra == "signatures"'],
    )  # fmt: skip
    _wheel(tmp_path, "docstring-parser", "0.18.0", [])
    return tmp_path


PINS = ["wandb==0.31.0", "pydantic==2.14.4", "jsonargparse==4.53.0", "docstring-parser==0.18.0"]


def test_a_closed_set_is_ready(folder: Path) -> None:
    assert gpu_wheels.problems(folder, PINS, ["requests"]) == []


def test_what_is_missing_or_wrong_is_named(folder: Path) -> None:
    (folder / "pydantic-2.14.4-py3-none-any.whl").unlink()
    (folder / "docstring_parser-0.18.0-py3-none-any.whl").rename(
        folder / "docstring_parser-0.18.0-cp311-cp311-manylinux_2_17_x86_64.whl"
    )
    _wheel(folder, "extra-thing", "1.0", ["sniffio"])
    pins = ["pydantic==2.14.4", "jsonargparse==4.52.0", "docstring-parser==0.18.0"]
    errors = gpu_wheels.problems(folder, pins, [])
    assert errors == [
        "docstring_parser-0.18.0-cp311-cp311-manylinux_2_17_x86_64.whl: no tag runs on "
        "CPython 3.12, Linux x86_64",
        "pydantic==2.14.4: no wheel (run bash benchmarks/gpu_wheels.sh)",
        "jsonargparse: wheel 4.53.0, pinned 4.52.0",
        "extra-thing: a wheel no pin asks for",
        "wandb: a wheel no pin asks for",
        "extra-thing needs sniffio: not a wheel here",
        "wandb needs pydantic<3,>=2.6: not a wheel here",
        "wandb needs requests: not a wheel here",
    ]


def test_the_pins_are_the_ones_the_project_asks_for() -> None:
    """Every root the check starts from is pinned, and nothing the image already has is."""
    pins = {line.split("==")[0] for line in gpu_wheels.names(gpu_wheels.PINS)}
    image = set(gpu_wheels.names(gpu_wheels.IMAGE))
    assert set(gpu_wheels.ROOTS) <= pins
    assert not pins & image
    assert {"torch", "lightning", "transformers", "pytest", "hypothesis"} <= image


def test_installed_versions_are_checked_against_every_wheel(tmp_path: Path) -> None:
    """On the GPU machine, after installing: what the image holds at a version a wheel refuses,
    or not at all, is named; markers are this Python's."""
    pytest_version = importlib.metadata.version("pytest")
    _wheel(
        tmp_path,
        "wandb",
        "0.31.0",
        [f"pytest=={pytest_version}", "pytest<1", "not-a-package-anywhere>=1",
         'other-missing; python_version < "3"', "boto3; extra == 'aws'"],
    )  # fmt: skip
    assert gpu_wheels.installed_problems(tmp_path) == [
        f"wandb needs pytest<1: {pytest_version} is installed",
        "wandb needs not-a-package-anywhere: not installed",
    ]
