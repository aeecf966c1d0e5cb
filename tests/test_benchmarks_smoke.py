"""Smoke test: `benchmarks/bench_step_cost.py --quick` runs end to end and prints its table.

No timing assertions: the numbers depend on the machine and its load; only the shape of the
report is checked (every variant timed, the goal line and a verdict printed, exit status 0).
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
