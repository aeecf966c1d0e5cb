"""Smoke tests: `bench_step_cost.py --quick` and `bench_dynamic_cost.py --quick` run end to end
and print their tables.

No timing assertions: the numbers depend on the machine and its load; only the shape of the
report is checked (every variant timed, the goal lines and verdicts printed, exit status 0).
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("dense", "static", "torch.ao", "lightning dense", "lightning static")


def test_bench_step_cost_quick_prints_the_table():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_step_cost.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang, not a timing assertion (it takes ~10 s)
    )
    out = done.stdout
    assert done.returncode == 0, f"stdout:\n{out}\nstderr:\n{done.stderr}"
    assert "torch " in out and "CPU " in out  # machine facts
    assert "variant" in out and "median ms" in out and "ratio" in out
    rows = {line.split("  ")[0].strip() for line in out.splitlines()}
    for variant in VARIANTS:
        assert variant in rows, f"no table row for {variant!r}:\n{out}"
    assert "goal: Static / dense <= 1.03 (plain and Lightning)" in out
    verdicts = [line for line in out.splitlines() if "Static / dense =" in line]
    assert len(verdicts) == 2 and all(("PASS" in v) != ("FAIL" in v) for v in verdicts), out
    assert "WeightNormSparsifier / dense =" in out
    # every sparse variant really trained at 80% sparsity, the dense ones stayed dense
    assert "static 0.800" in out and "torch.ao 0.800" in out and "lightning static 0.800" in out
    assert "WARNING" not in out


def test_bench_dynamic_cost_quick_prints_the_table():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dynamic_cost.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang, not a timing assertion (it takes ~10 s)
    )
    out = done.stdout
    assert done.returncode == 0, f"stdout:\n{out}\nstderr:\n{done.stderr}"
    assert "torch " in out and "CPU " in out and "load average" in out  # machine facts
    rows = {line.split("  ")[0].strip() for line in out.splitlines()}
    for variant in ("dense", "rigl", "set", "rigl update", "set update"):
        assert variant in rows, f"no table row for {variant!r}:\n{out}"
    for label in ("rigl update()", "set update()", "rigl compute_masks()", "naive top-k"):
        assert label in out, f"no update-cost row {label!r}:\n{out}"
    assert "goal: one update() / dense step <= 0.25" in out
    assert "goal: amortized (99 * ordinary step + update step) / 100 / dense <= 1.05" in out
    verdicts = [line for line in out.splitlines() if "update / dense =" in line]
    verdicts += [line for line in out.splitlines() if "amortized =" in line]
    assert len(verdicts) == 4 and all(("PASS" in v) != ("FAIL" in v) for v in verdicts), out
    assert "no extra backward on RigL's update steps" in out
