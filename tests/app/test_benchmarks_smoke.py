"""Smoke tests: `bench_step_cost.py --quick`, `bench_dynamic_cost.py --quick` and
`bench_gpu_step.py --quick` run end to end and print their tables (the GPU one, on a machine
without CUDA, only its "skipped: no CUDA" line; with ``--device cpu`` its table on the CPU).

No timing assertions: the numbers depend on the machine and its load; only the shape of the
report is checked (every variant timed, the goal lines and verdicts printed, exit status 0).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Per script: lines the output must contain (with what a missing one means), table rows (the text
# before a row's first double space), markers of verdict lines and how many there are (each says
# PASS or FAIL, not both), and text the output must not contain.
CASES = {
    "bench_step_cost.py": dict(
        present={
            "machine facts": ("torch ", "CPU "),
            "table header": ("variant", "median ms", "ratio"),
            "goal line": ("goal: Static / dense <= 1.03 (plain and Lightning)",),
            "comparison line": ("WeightNormSparsifier / dense =",),
            # every sparse variant really trained at 80% sparsity, the dense ones stayed dense
            "sparsity check": ("static 0.800", "torch.ao 0.800", "lightning static 0.800"),
            # each per-step pass of the static loop timed in place, and the bandwidth floor
            "passes table": (
                "gradients, in backward",
                "weights, before the step",
                "exp_avg_sq held at 1.0",
                "exp_avg_sq released",
                "all passes",
                "for any design that makes these passes",
            ),
        },
        rows=("dense", "static", "torch.ao", "lightning dense", "lightning static"),
        verdicts=(("Static / dense =",), 2),
        absent=("WARNING",),
    ),
    "bench_dynamic_cost.py": dict(
        present={
            "machine facts": ("torch ", "CPU ", "load average"),
            "update-cost row": (
                "rigl update()",
                "set update()",
                "rigl compute_masks()",
                "naive top-k",
            ),
            "goal line": (
                "goal: one update() / dense step <= 0.25",
                "goal: amortized (99 * ordinary step + update step) / 100 / dense <= 1.05",
            ),
            "RigL note": ("no extra backward on RigL's update steps",),
        },
        rows=("dense", "rigl", "set", "rigl update", "set update"),
        verdicts=(("update / dense =", "amortized ="), 4),
        absent=(),
    ),
    "bench_gpu_step.py": dict(
        needs_cuda=True,  # without CUDA it prints only "skipped: no CUDA" and exits 0
        present={
            "machine facts": ("torch ", "GPU ", "date "),
            "table header": ("variant", "median ms", "ratio"),
            "goal line": (
                "goal: Static / dense <= 1.02",
                "goal: one RigL update() / dense step <= 0.25",
                "goal: RigL amortized (99 * ordinary step + update step) / 100 / dense <= 1.02",
            ),
            "sparsity check": ("static 0.800", "rigl 0.800", "rigl update 0.800"),
        },
        rows=("dense", "static", "rigl", "rigl update"),
        verdicts=(("Static / dense =", "rigl update / dense =", "rigl amortized ="), 3),
        absent=(),
    ),
}
# The GPU benchmark's own loop on the CPU (`--device cpu`), so that CI runs its code too.
CASES["bench_gpu_step.py --device cpu"] = dict(
    CASES["bench_gpu_step.py"],
    needs_cuda=False,
    present={
        **CASES["bench_gpu_step.py"]["present"],
        "machine facts": ("torch ", "no GPU: --device cpu", "date "),
    },
)


@pytest.mark.parametrize("script", list(CASES))
def test_bench_quick_prints_the_table(script: str) -> None:
    case = CASES[script]
    name, *args = script.split()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), "--quick", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang, not a timing assertion (it takes ~10 s)
    )
    out = done.stdout
    assert done.returncode == 0, f"stdout:\n{out}\nstderr:\n{done.stderr}"
    if case.get("needs_cuda") and not torch.cuda.is_available():
        assert out.strip().startswith("skipped: no CUDA"), out
        assert "variant" not in out, out
        return
    for what, texts in case["present"].items():
        for text in texts:
            assert text in out, f"no {what} {text!r}:\n{out}"
    rows = {line.split("  ")[0].strip() for line in out.splitlines()}
    for variant in case["rows"]:
        assert variant in rows, f"no table row for {variant!r}:\n{out}"
    markers, count = case["verdicts"]
    verdicts = [line for marker in markers for line in out.splitlines() if marker in line]
    assert len(verdicts) == count and all(("PASS" in v) != ("FAIL" in v) for v in verdicts), out
    for text in case["absent"]:
        assert text not in out, f"unexpected {text!r}:\n{out}"


def test_bench_mask_memory_first_steps_compares_chunked_and_unchunked() -> None:
    """`bench_mask_memory.py --first-steps` (benchmarks/README's row for `fused_mask.CHUNK`), tiny:
    a row per way, each with its build, four steps, total and kernels compiled."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_mask_memory.py"), "--first-steps"]
        + ["--dim", "64", "--layers", "1", "--chunk", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang, not a timing assertion
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    chunked = [r for r in rows if r[:3] == ["chunks", "of", "3"]]
    whole = [r for r in rows if r[:1] == ["unchunked"]]
    assert len(chunked) == len(whole) == 1, done.stdout
    for row in (chunked[0][3:], whole[0][1:]):
        assert len(row) == 7 and int(row[-1]) >= 1, done.stdout  # 5 times, total, compiled
