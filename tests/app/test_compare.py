"""`lightning-sparse compare --seeds N`: what a seed varies, the table with its intervals, the
plot's bands, parallel runs, and resuming an interrupted comparison.

Runs are tiny (a 1-layer Llama of dim 32, a few steps) and log to CSV; W&B is covered in
``tests/lightning/test_wandb.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from lightning_sparse.app import compare, compare_runs, compare_table, svg_plot
from lightning_sparse.app.fit import SparseCLI
from lightning_sparse.app.stats import mean_interval, paired_difference
from lightning_sparse.core.algorithms.base import SparsityAlgorithm
from tests.helpers import repo_pythonpath

REPO = Path(__file__).resolve().parents[2]
STATIC, DENSE, RIGL = (str(REPO / f"recipes/{n}_llama.yaml") for n in ("static", "dense", "rigl"))
TINY = [
    *("--trainer.accelerator", "cpu"),  # the recipes say auto: the GPU where there is one
    *("--model.dim", "32", "--model.n_layers", "1", "--model.max_seq_len", "32"),
    *("--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"),
    *("--data.val_windows", "4", "--trainer.enable_progress_bar", "false"),
    *("--trainer.enable_model_summary", "false"),
    *("--trainer.logger", "lightning.pytorch.loggers.CSVLogger"),
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inherited by the runs `compare` starts.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("PYTHONPATH", repo_pythonpath())


def built(seed: int) -> tuple[dict, torch.Tensor, dict]:
    """(initial weights, first training batch, initial masks) of the RigL recipe as the CLI
    builds it with ``--seed_everything seed``."""
    args = ["--config", RIGL, *TINY, "--seed_everything", str(seed)]
    cli = SparseCLI(args=args, run=False)
    weights = {n: p.detach().clone() for n, p in cli.model.named_parameters()}
    cli.datamodule.setup("fit")
    batch = next(iter(cli.datamodule.train_dataloader()))
    (algorithm,) = [c for c in cli.trainer.callbacks if isinstance(c, SparsityAlgorithm)]
    assert algorithm.seed is None  # the recipe leaves it to the experiment's seed
    algorithm.apply(cli.model)
    masks = {n: sp.mask.clone() for n, sp in algorithm.sparse_params.items()}
    return weights, batch, masks


def test_seed_everything_varies_init_data_order_and_masks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    w0, b0, m0 = built(0)
    w0_again, b0_again, m0_again = built(0)
    w1, b1, m1 = built(1)
    # The same seed rebuilds the same run ...
    assert all(torch.equal(w0[n], w0_again[n]) for n in w0) and torch.equal(b0, b0_again)
    assert all(torch.equal(m0[n], m0_again[n]) for n in m0)
    # ... another seed changes all three: the initial weights, the data order and the masks.
    random = [n for n in w0 if w0[n].numel() > 1 and w0[n].std() > 0]  # not the norms' ones
    assert random and all(not torch.equal(w0[n], w1[n]) for n in random)
    assert not torch.equal(b0, b1)
    assert m0 and all(not torch.equal(m0[n], m1[n]) for n in m0)


def test_band_polygons_in_the_series_colour_and_inside_the_plot() -> None:
    svg = svg_plot.line_plot_svg(
        {"a": [(0, 1.0), (10, 0.5)], "b": [(0, 2.0), (10, 1.5)]},
        bands={"a": [(0, 0.9, 1.1), (10, 0.4, 0.6)]},
    )
    (polygon,) = re.findall(r'<polygon points="([^"]+)" fill="([^"]+)"', svg)
    line_colours = re.findall(r'<polyline points="[^"]+" fill="none" stroke="([^"]+)"', svg)
    assert polygon[1] == line_colours[0]  # a's band in a's colour
    corners = [tuple(map(float, p.split(","))) for p in polygon[0].split()]
    assert len(corners) == 4  # low edge forth, high edge back
    assert svg.index("<polygon") < svg.index("<polyline")  # drawn under the lines
    with pytest.raises(ValueError, match=r"bands \['c'\] have no series"):
        svg_plot.line_plot_svg({"a": [(0, 1.0)]}, bands={"c": [(0, 1.0, 2.0)]})


def test_compare_two_seeds_table_intervals_and_bands(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cmp"
    args = ["--recipes", STATIC, DENSE, "--seeds", "2", "--jobs", "2", "--steps", "3"]
    start = time.perf_counter()
    compare.main([*args, "--out", str(out), "--", *TINY])
    seconds = time.perf_counter() - start
    printed = capsys.readouterr().out
    assert "2 at a time, 1 torch thread(s) each" in printed
    record = json.loads((out / "comparison.json").read_text())
    losses = {
        (r["name"], r["seed"]): r["summary"]["val"]["loss"] for r in record["runs"]
    }  # fmt: skip
    assert sorted(losses) == [("dense", 0), ("dense", 1), ("static", 0), ("static", 1)]
    assert losses[("static", 0)] != losses[("static", 1)]  # the seeds differ
    static = {s: losses[("static", s)] for s in (0, 1)}
    dense = {s: losses[("dense", s)] for s in (0, 1)}
    # The table: mean ± sd, the 95% t interval, and dense - static paired by seed.
    table = (out / "comparison.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| dense |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    i = mean_interval(list(dense.values()))
    d = paired_difference(dense, static).interval
    assert cells[3] == "2" and cells[4] == f"{i.mean:.4f} ± {i.sd:.4f}"
    assert cells[5] == f"[{i.low:.4f}, {i.high:.4f}]"
    assert cells[6] == f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"
    # By hand for two values: half width t(0.975, 1) * |a - b| / 2, t = 12.7062.
    half = 12.706205 * abs(dense[0] - dense[1]) / 2
    assert i.high - i.mean == pytest.approx(half, rel=1e-6)
    assert "Student t with N - 1 degrees of freedom" in table and row in printed
    (method,) = [m for m in record["methods"] if m["method"] == "dense"]
    assert method["val_loss_vs_static"] == pytest.approx(d.mean)
    assert method["val_loss_ci95_low"] == pytest.approx(i.low)
    # The plot: one mean line and one band per method, the band around its mean.
    svg = (out / "val_loss.svg").read_text()
    assert svg.count("<polyline") == 2 and svg.count("<polygon") == 2
    assert "mean of 2 seeds, 95% band" in svg
    print(f"compare --seeds 2, 2 recipes, 2 jobs: {seconds:.0f} s")  # ~20 s on 2 idle cores


def test_jobs_split_the_cores_and_runs_get_their_method_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LIGHTNING_SPARSE_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = compare_runs.child_env("rigl", 2, threads=3)
    assert env["LIGHTNING_SPARSE_THREADS"] == "3"
    assert (env["WANDB_RUN_GROUP"], env["WANDB_JOB_TYPE"], env["WANDB_TAGS"]) == (
        "rigl", "fit", "seed_2",
    )  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's choice wins
    assert "LIGHTNING_SPARSE_THREADS" not in compare_runs.child_env("rigl", 2, threads=3)
    # A run directory a fit in this process decided (for its DDP workers) is not a run's.
    monkeypatch.setenv("LIGHTNING_SPARSE_RUN", '{"root": "outputs/x", "version": 0}')
    assert "LIGHTNING_SPARSE_RUN" not in compare_runs.child_env("rigl", 2, threads=3)
    monkeypatch.setattr(compare_runs, "available_cores", lambda: 4)
    monkeypatch.setattr(compare_runs, "busy_cores", lambda: 1.0)
    assert compare_runs.default_jobs(10) == 3 and compare_runs.default_jobs(2) == 2
    runs = compare_runs.plan_runs(
        {"static": Path("s.yaml"), "rigl": Path("r.yaml")}, [0, 1], Path("/o"), None, ["--x"]
    )
    assert [(r.method, r.seed) for r in runs] == [
        ("static", 0), ("rigl", 0), ("static", 1), ("rigl", 1),
    ]  # fmt: skip
    assert runs[3].run_dir == Path("/o/rigl/seed_1")
    assert runs[3].command[-3:] == ["--seed_everything", "1", "--x"]


def test_an_interrupted_comparison_resumes_where_it_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """SIGTERM while the second run trains: the first stays finished and is not retrained, the
    second's process ends with ``compare``, and the next call continues the second from its
    last checkpoint (a copy of the RigL recipe that checkpoints every 4 steps)."""
    recipe = yaml.safe_load(Path(RIGL).read_text())
    (checkpoint,) = [
        c for c in recipe["trainer"]["callbacks"] if "ModelCheckpoint" in c["class_path"]
    ]
    checkpoint["init_args"]["every_n_train_steps"] = 5
    rigl = tmp_path / "rigl_llama.yaml"
    rigl.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = tmp_path / "cmp"
    args = ["--recipes", STATIC, str(rigl), "--jobs", "1", "--steps", "40", "--out", str(out)]
    args += ["--", *TINY]
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_sparse.app.cli", "compare", *args]
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    first, second = out / "static/seed_0", out / "rigl/seed_0"
    deadline = time.monotonic() + 300
    while not list(second.rglob("last.ckpt")):  # the first finished, the second checkpointed
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.05)
    (child,) = psutil.Process(process.pid).children()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) != 0
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert (first / "run.json").is_file() and not (second / "run.json").is_file()
    trained = (first / "summary.json").stat().st_mtime

    compare.main(args)
    printed = capsys.readouterr().out
    assert "static seed 0: reusing the finished run" in printed
    assert "1 run(s) to train" in printed and "rigl seed 0: resuming from " in printed
    assert (first / "summary.json").stat().st_mtime == trained  # not retrained
    assert "lightning-sparse: resuming the latest run" in (second / "fit.log").read_text()
    summary = json.loads((second / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["tokens"] == 40 * 4 * 32  # the whole run
    compare.main(args)  # everything finished: nothing to train
    assert capsys.readouterr().out.count("reusing the finished run") == 2


def test_bad_counts_name_the_option() -> None:
    for option in ("--seeds", "--jobs"):
        with pytest.raises(SystemExit, match=f"{option} must be >= 1, got 0"):
            compare.main([option, "0"])


def test_a_baseline_that_is_not_compared_is_refused_before_any_run(tmp_path: Path) -> None:
    """``--baseline statc`` ran the whole comparison with no baseline column; it is refused,
    naming the recipes, before anything trains."""
    out = tmp_path / "cmp"
    with pytest.raises(
        SystemExit,
        match=r"--baseline 'statc' is not one of the recipes compared "
        r"\(dense, rigl\); name one of them or add it to --recipes",
    ):
        compare.main(["--recipes", "dense", "rigl", "--baseline", "statc", "--out", str(out)])
    assert not out.exists()


def test_difference_to_static_over_training_by_hand() -> None:
    def run(method: str, seed: int, curve: list[list[float]]) -> compare_runs.Run:
        r = compare_runs.Run(method, seed, Path("r.yaml"), Path("d"), [])
        r.summary = {"val_curve": curve}
        return r

    runs = [
        run("static", 0, [[100, 2.0], [200, 1.5]]),
        run("static", 1, [[100, 2.2], [200, 1.7]]),
        run("rigl", 0, [[100, 1.9], [200, 1.4], [300, 1.0]]),  # 300: static has none
        run("rigl", 1, [[100, 2.2], [200, 1.5]]),
    ]
    (rows,) = compare_table.difference_curves(runs, "static").values()
    assert [r[0] for r in rows] == [100.0, 200.0]
    # Step 200: d = [-0.1, -0.2], mean -0.15, sd 0.1 / sqrt(2), half width 12.706205 * 0.05.
    step, mean, low, high = rows[1]
    assert mean == pytest.approx(-0.15)
    assert (low, high) == pytest.approx((-0.15 - 0.6353103, -0.15 + 0.6353103), abs=1e-6)
    assert rows[0][1] == pytest.approx(-0.05)
    assert compare_table.difference_curves(runs, "dense") == {}  # no such baseline
