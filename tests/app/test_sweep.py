"""Local, offline W&B sweeps: config validation, grid / random expansion, the agent's command
line, and a two-point sweep on a tiny model."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import yaml

from lightning_sparse.app import sweep, sweep_seeds
from lightning_sparse.app.cli import RECIPES_DIR
from lightning_sparse.app.cli import main as cli_main

SWEEPS = sorted((RECIPES_DIR / "sweeps").glob("*.yaml"))
# Written by the recipes' owner alongside rigl_llama.yaml; the algorithm sweep names them.
TWIN_RECIPES = {"static_llama.yaml", "set_llama.yaml", "dense_llama.yaml", "granet_llama.yaml"}


def _grid(**parameters: dict) -> dict:
    return {"method": "grid", "parameters": parameters, "command": ["lightning-sparse", "${args}"]}


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_repository_sweeps_are_valid_wandb_configs(path: Path) -> None:
    config = sweep.load_sweep(path)
    assert {"method", "metric", "parameters", "command", "program"} <= set(config)
    assert config["metric"] == {"name": "val/loss", "goal": "minimize"}
    points = sweep.expand(config)
    assert len(points) == config.get("run_cap", len(points)) > 1
    argv = sweep.command_line(config, points[0])
    assert argv[:2] == ["lightning-sparse", "fit"]
    assert argv[2].startswith("--config=recipes/")  # the recipe first, overrides after it
    missing = {
        Path(p["config"]).name for p in points if not (RECIPES_DIR.parent / p["config"]).is_file()
    }
    if missing & TWIN_RECIPES:
        pytest.skip(f"recipes {sorted(missing)} are not in this checkout yet")
    assert not missing


def _resolve(printed: dict, name: str) -> object:
    """The value a dotted CLI key ended up with in a --print_config dump."""
    node: object = printed
    for part in name.split("."):
        if isinstance(node, list):  # a list of classes: init_args overrides reach the last one
            node = node[-1]
        if isinstance(node, dict) and part not in node and "init_args" in node:
            node = node["init_args"]
        node = node[part]  # type: ignore[index]
    return node


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_sweep_overrides_reach_the_intended_callback(path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(RECIPES_DIR.parent)  # recipe paths in sweeps are relative to the repo root
    config = sweep.load_sweep(path)
    recipes: dict[str, dict] = {}
    for point in sweep.expand(config):
        recipes.setdefault(point["config"], point)  # one point per recipe
    for point in recipes.values():
        argv = sweep.command_line(config, point)
        with pytest.raises(SystemExit) as exit_:
            cli_main([*argv[1:], "--print_config"])
        assert exit_.value.code in (0, None)
        printed = yaml.safe_load(capsys.readouterr().out)
        for name, value in point.items():
            if name != "config":
                assert _resolve(printed, name) == pytest.approx(value), name


def test_grid_is_the_product_in_parameter_order() -> None:
    config = _grid(a={"values": [1, 2, 3]}, b={"value": "x"}, c={"values": [0.5, 0.9]})
    points = sweep.expand(config)
    assert len(points) == 6
    assert points[0] == {"a": 1, "b": "x", "c": 0.5} and points[1] == {"a": 1, "b": "x", "c": 0.9}
    assert sweep.expand(config, count=2) == points[:2]


def test_random_is_seeded_and_respects_ranges() -> None:
    config = {
        "method": "random",
        "parameters": {
            "lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
            "frac": {"min": 0.2, "max": 0.33},
            "layers": {"min": 1, "max": 4},
            "algo": {"values": ["set", "rigl"]},
        },
    }
    first, again = sweep.expand(config, count=20, seed=3), sweep.expand(config, count=20, seed=3)
    assert first == again and first != sweep.expand(config, count=20, seed=4)
    for point in first:
        assert 1e-4 <= point["lr"] <= 1e-2 and 0.2 <= point["frac"] <= 0.33
        assert point["layers"] in (1, 2, 3, 4) and point["algo"] in ("set", "rigl")
    with pytest.raises(ValueError, match="count"):
        sweep.expand(config)


def test_command_line_matches_the_wandb_agent() -> None:
    utils = pytest.importorskip("wandb.sdk.launch.sweeps.utils")
    point = {"config": "recipes/rigl_llama.yaml", "model.lr": 0.001, "flag": True}
    config = {**_grid(), "command": ["${env}", "lightning-sparse", "fit", "${args}", "--x=1"]}
    expected = utils.create_sweep_command_args(
        {"args": {k: {"value": v} for k, v in point.items()}}
    )
    assert sweep.command_line(config, point) == [
        "lightning-sparse",
        "fit",
        *expected["args"],
        "--x=1",
    ]
    no_hyphens = {**config, "command": ["prog", "${args_no_hyphens}"]}
    assert sweep.command_line(no_hyphens, point) == ["prog", *expected["args_no_hyphens"]]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"method": "hyperband", "parameters": {"a": {"value": 1}}}, "method"),
        ({"method": "grid", "parameters": {"a": {"value": 1}}, "sweep": 1}, "unknown keys"),
        ({"method": "grid", "parameters": {"a": {"parameters": {}}}}, "nested"),
        ({"method": "grid", "parameters": {"a": {"values": []}}}, "non-empty"),
        ({"method": "bayes", "parameters": {"a": {"value": 1}}}, "metric"),
        (
            {"method": "grid", "parameters": {"a": {"value": 1}}, "command": ["${program}"]},
            "program",
        ),
    ],
)
def test_invalid_configs_are_rejected(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sweep.validate_sweep(config)


def test_bayes_and_grid_distributions_need_wandb() -> None:
    bayes = {"method": "bayes", "metric": {"name": "val/loss"}, "parameters": {"a": {"value": 1}}}
    with pytest.raises(ValueError, match="wandb agent"):
        sweep.expand(bayes)
    with pytest.raises(ValueError, match="method: random"):
        sweep.expand(_grid(a={"min": 0.0, "max": 1.0}))


TINY_RECIPE = {
    "seed_everything": 0,
    "trainer": {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 2,
        "val_check_interval": 2,
        "check_val_every_n_epoch": None,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": [{"class_path": "lightning_sparse.Static", "init_args": {"sparsity": 0.5}}],
    },
    "model": {
        "class_path": "lightning_sparse.models.LitCausalLM",
        "init_args": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16, "warmup_steps": 1},
    },
    "data": {
        "class_path": "lightning_sparse.data.ByteTextDataModule",
        "init_args": {"seq_len": 16, "batch_size": 2, "max_bytes": 20000, "val_windows": 2},
    },
    "summary": {"print_layers": False},
}


def test_local_sweep_of_two_points_prints_a_table(tmp_path: Path, capsys, monkeypatch) -> None:
    """Each point writes only under its own folder of ``--out``, checkpoints included (the
    recipe's checkpoint folder, relative to the working directory as in the shipped recipes,
    was shared by every point; issue 34.4)."""
    monkeypatch.chdir(tmp_path)
    trainer = {**TINY_RECIPE["trainer"], "enable_checkpointing": True}  # type: ignore[dict-item]
    trainer["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": "outputs/tiny/checkpoints", "save_last": True},
        },
        *trainer["callbacks"],
    ]
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({**TINY_RECIPE, "trainer": trainer}))
    config = {
        "name": "tiny",
        "method": "grid",
        "metric": {"name": "val/loss", "goal": "minimize"},
        "parameters": {
            "config": {"value": str(recipe)},
            "trainer.callbacks.init_args.sparsity": {"values": [0.5, 0.75]},
        },
        "command": ["${env}", "lightning-sparse", "fit", "${args}"],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / "out"
    sweep.main([str(path), "--out", str(out), "--", "--trainer.log_every_n_steps=1"])

    printed = capsys.readouterr().out
    table = printed[printed.index("Sweep tiny") :].splitlines()[1:]
    assert table[0].split()[:3] == ["#", "config", "sparsity"]
    rows = [line.split() for line in table[1:]]
    assert [r[0] for r in rows] == ["0", "1"] and [r[2] for r in rows] == ["0.5", "0.75"]
    assert all(r[-1] == "ok" for r in rows)
    with open(out / "results.csv") as f:
        results = list(csv.DictReader(f))
    assert len(results) == 2 and all(math.isfinite(float(r["val/loss"])) for r in results)
    assert (out / "0").is_dir() and (out / "1").is_dir()
    for point in ("0", "1"):
        (last,) = (out / point).rglob("last.ckpt")
        assert last.parent == out / point / "lightning_logs/version_0/checkpoints"
    assert not (tmp_path / "outputs").exists()  # nothing outside --out


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    config = _grid(**{"trainer.no_such_option": {"values": [1]}})
    config["command"] = ["lightning-sparse", "fit", "${args}"]
    results = sweep.run_sweep(config, tmp_path, overrides=["--print_config"])
    assert len(results) == 1 and results[0].status.startswith("failed")


def test_a_sweep_with_a_failed_point_exits_1_after_writing_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every point's row is written, then the command says how many failed and exits 1 (it
    exited 0 when every point had failed)."""
    config = _grid(**{"trainer.no_such_option": {"values": [1, 2]}})
    config["command"] = ["lightning-sparse", "fit", "${args}"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        sweep.main([str(path), "--out", str(out), "--", "--print_config"])
    assert info.value.code == 1
    assert (
        "sweep: 2 of 2 point(s) failed (first: point 0, failed: exit 2" in capsys.readouterr().err
    )
    with open(out / "results.csv") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["failed: exit 2"] * 2


def test_a_sweep_over_seeds_is_summarized_per_setting(tmp_path: Path) -> None:
    metrics = {("a.yaml", 0): 1.0, ("a.yaml", 1): 2.0, ("a.yaml", 2): 3.0}
    metrics |= {("b.yaml", 0): 5.0, ("b.yaml", 1): None, ("b.yaml", 2): 5.5}  # one failed
    results = [
        sweep.PointResult(i, {"config": c, "seed_everything": s}, m, 1.0)
        for i, ((c, s), m) in enumerate(metrics.items())
    ]
    table = sweep_seeds.seed_table(results, "val/loss").splitlines()
    assert table[0].split()[:5] == ["config", "seeds", "mean", "val/loss", "sd"]
    # a: mean 2, sd 1, half width t(0.975, 2) / sqrt(3) = 2.484138.
    assert table[1].split() == ["a.yaml", "3", "2.0000", "1.0000", "[-0.4841,", "4.4841]"]
    # b: two seeds, mean 5.25, sd 0.353553, half width t(0.975, 1) * 0.353553 / sqrt(2) = 3.1766.
    assert table[2].split() == ["b.yaml", "2", "5.2500", "0.3536", "[2.0734,", "8.4266]"]
    sweep_seeds.write_seed_table(results, "val/loss", tmp_path / "by_seed.csv")
    with open(tmp_path / "by_seed.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["config"] for r in rows] == ["a.yaml", "b.yaml"]
    assert float(rows[1]["ci95_high"]) == pytest.approx(5.25 + 3.176551, abs=1e-6)
