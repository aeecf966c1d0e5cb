"""Workflows: Variable SPDF (one run and chained runs), FLOP accounting, iterative pruning with LR
rewinding, and the recipes run through the CLI on tiny overrides."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sparse import Static
from lightning_sparse.core.state_dict import checkpoint_masks
from lightning_sparse.data import ByteTextDataModule
from lightning_sparse.lightning import (
    FlopCounter,
    IterativePruning,
    LoadWeights,
    VariableSPDF,
    drop_mask_entries,
    imp_sparsity,
    rewind_lr_scheduler,
)
from lightning_sparse.models import LitCausalLM
from tests.helpers import TinyLM, repeated_batch_loader, token_loader, trainer

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"  # this checkout's
# cli.run(args) under pytest: LightningCLI notes that sys.argv holds pytest's own arguments.
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

# Hand count for TinyNet (tests/helpers.py) at 75% on fc1 and fc2, batches [8, 9] = 64 tokens:
# fc1 and fc2 hold 24 * 40 = 960 weights each and keep int(0.25 * 960) = 240; the head holds
# 24 * 16 = 384; the embedding lookup costs 2 * 16 * 24 = 768 per token; no attention.
SPARSE_PER_TOKEN = 2 * (240 + 240 + 384) + 768  # 2496
DENSE_PER_TOKEN = 2 * (960 + 960 + 384) + 768  # 5376
TOKENS = 8 * 8


def _masks(module: torch.nn.Module) -> list[str]:
    return [n for n, _ in module.named_buffers() if n.endswith("_mask")]


class _Probe(pl.Callback):
    """Records, at each batch start (after the callbacks listed before it), masks and weights."""

    def __init__(self) -> None:
        self.masks: dict[int, list[str]] = {}
        self.fc1: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.masks[trainer.global_step] = _masks(pl_module)
        self.fc1[trainer.global_step] = pl_module.net.fc1.weight.detach().clone()


# ------------------------------------------------------------------ Variable SPDF, one run
def test_variable_spdf_densifies_at_the_switch_and_zeros_then_grow(tmp_path: Path) -> None:
    static, probe, counter = Static(sparsity=0.75), _Probe(), FlopCounter(verbose=False)
    module = TinyLM()
    t = trainer(tmp_path, max_steps=6, callbacks=[static, counter, VariableSPDF(4), probe])
    t.fit(module, token_loader())

    assert probe.masks[3] == ["net.fc1.weight_mask", "net.fc2.weight_mask"]
    assert probe.masks[4] == [] and _masks(module) == []
    pruned = probe.fc1[3] == 0
    assert int(pruned.sum()) == 960 - 240
    assert torch.equal(probe.fc1[4][pruned], torch.zeros(720))  # zeros kept at the switch
    assert int((module.net.fc1.weight[pruned] != 0).sum()) > 600  # ... then they learn
    # The sparsity callback stays, with nothing to do: no sparse parameters, no step hooks.
    assert static in t.callbacks and static.sparse_params == {} and static.step == 4
    assert not any(k.endswith("_mask") for k in module.state_dict())


def test_flop_counter_matches_a_hand_count_across_the_switch(tmp_path: Path) -> None:
    counter = FlopCounter(verbose=False)
    t = trainer(tmp_path, max_steps=6, callbacks=[Static(0.75), counter, VariableSPDF(4)])
    t.fit(TinyLM(), token_loader())

    flops = 3 * TOKENS * (4 * SPARSE_PER_TOKEN + 2 * DENSE_PER_TOKEN)
    dense = 3 * TOKENS * 6 * DENSE_PER_TOKEN
    assert (flops, dense) == (3_981_312, 6_193_152)
    summary = counter.summary()
    assert summary["flops"] == flops and summary["dense_flops"] == dense
    assert summary["saved"] == pytest.approx(1 - flops / dense)
    assert summary["effective_sparsity"] == pytest.approx(4 / 6 * (1 - 480 / 1920))
    sparse, dense_stage = counter.segments
    assert (sparse.first_step, sparse.last_step, sparse.batches) == (0, 3, 4)
    assert (dense_stage.first_step, dense_stage.last_step, dense_stage.sparsity) == (4, 5, 0.0)
    assert "saved" in counter.table()


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint")
@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before")
def test_variable_spdf_resume_after_the_switch_is_exact(tmp_path: Path) -> None:
    def fit(root: Path, steps: int, ckpt: str | None = None, save: bool = False):
        callbacks = [Static(0.75), FlopCounter(verbose=False), VariableSPDF(3)]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0))
        module = TinyLM()
        t = trainer(root, max_steps=steps, callbacks=callbacks, enable_checkpointing=save)
        t.fit(module, repeated_batch_loader(), ckpt_path=ckpt)
        return module, callbacks[1]

    full, full_counter = fit(tmp_path / "a", 7)
    fit(tmp_path / "b", 5, save=True)
    saved = torch.load(tmp_path / "b" / "last.ckpt", weights_only=True)
    assert not [k for k in saved["state_dict"] if k.endswith("_mask")]  # dense weights only
    static = saved["sparsity"]["Static"]
    assert static["removed"] and static["params"] == {}  # a removed algorithm: prunes nothing
    resumed, resumed_counter = fit(tmp_path / "c", 7, ckpt=str(tmp_path / "b" / "last.ckpt"))
    assert _masks(resumed) == []
    for (name, a), (_, b) in zip(
        full.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert resumed_counter.summary() == full_counter.summary()


# ------------------------------------------------------------------ chained runs
def test_chained_runs_load_sparse_weights_dense_and_count_both_stages(tmp_path: Path) -> None:
    stage1 = trainer(
        tmp_path / "s", max_steps=4, callbacks=[Static(0.75), FlopCounter(verbose=False)]
    )
    sparse_module = TinyLM()
    stage1.fit(sparse_module, token_loader())
    ckpt = tmp_path / "sparse.ckpt"
    stage1.save_checkpoint(ckpt)
    assert checkpoint_masks(torch.load(ckpt, weights_only=True)).keys() == {
        "net.fc1.weight",
        "net.fc2.weight",
    }

    loader, counter, probe = LoadWeights(str(ckpt)), FlopCounter(str(ckpt), verbose=False), _Probe()
    dense_module = TinyLM()
    stage2 = trainer(tmp_path / "d", max_steps=2, callbacks=[loader, counter, probe])
    stage2.fit(dense_module, token_loader(seed=1))

    assert probe.masks[0] == [] and torch.equal(probe.fc1[0], sparse_module.net.fc1.weight)
    pruned = probe.fc1[0] == 0
    assert int((dense_module.net.fc1.weight[pruned] != 0).sum()) > 600
    # Same batches and costs as the one-run test: 4 sparse, then 2 dense.
    summary = counter.summary()
    assert summary["flops"] == 3_981_312 and summary["dense_flops"] == 6_193_152
    assert [s.run for s in counter.all_segments()] == [0, 1]


def test_load_weights_errors_and_mask_dropping(tmp_path: Path) -> None:
    state = {"a.weight": torch.ones(2), "a.weight_mask": torch.ones(2, dtype=torch.bool)}
    state["attn_mask"] = torch.ones(1)  # a buffer named *_mask that is not a parameter's mask
    assert set(drop_mask_entries(state)) == {"a.weight", "attn_mask"}
    t = trainer(tmp_path, max_steps=1, callbacks=[LoadWeights(str(tmp_path / "missing.ckpt"))])
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        t.fit(TinyLM(), token_loader())
    with pytest.raises(TypeError, match="dense_from_step must be an int"):
        VariableSPDF(dense_from_step=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="remove the sparsity callback"):
        VariableSPDF(dense_from_step=0)


# ------------------------------------------------------------------ iterative pruning
TINY_LM = dict(dim=32, n_layers=1, n_heads=2, max_seq_len=16, warmup_steps=1)
TINY_DATA = dict(seq_len=16, batch_size=2, max_bytes=20_000, val_windows=2)


class _LrProbe(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.adam_steps: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        masks = {n: b.clone() for n, b in pl_module.named_buffers() if n.endswith("_mask")}
        self.kept[trainer.global_step] = masks

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])
        state = optimizer.state.get(pl_module.model.layers[0].mlp.up_proj.weight, {})
        self.adam_steps.append(float(state.get("step", 0)))


def _imp_fit(tmp_path: Path, imp: IterativePruning, steps: int) -> tuple[_LrProbe, LitCausalLM]:
    pl.seed_everything(0)
    probe = _LrProbe()
    module = LitCausalLM(**TINY_LM, max_steps=imp.level_steps)
    t = trainer(
        tmp_path,
        max_steps=steps,
        callbacks=[imp, probe],
        val_check_interval=imp.level_steps,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    t.fit(module, datamodule=ByteTextDataModule(**TINY_DATA))
    return probe, module


def test_imp_sparsity_is_geometric() -> None:
    assert [imp_sparsity(k, 0.2) for k in range(4)] == pytest.approx([0, 0.2, 0.36, 0.488])
    assert imp_sparsity(5, 0.5) == pytest.approx(1 - 1 / 32)


def test_iterative_pruning_levels_rewind_and_table(tmp_path: Path) -> None:
    L, levels, p = 3, 3, 0.5
    imp = IterativePruning(L, levels, prune_fraction=p, param_filter="*proj.weight", verbose=False)
    probe, module = _imp_fit(tmp_path, imp, steps=(levels + 1) * L)

    # Masks change at each level start's optimizer step, so batch k * L + 1 sees level k's masks.
    for k in range(levels + 1):
        masks = probe.kept[k * L + 1] if k else probe.kept[1]
        for name, mask in masks.items():
            assert int(mask.sum()) == int((1 - imp_sparsity(k, p)) * mask.numel()), (k, name)
            if k:  # each level prunes surviving weights only
                previous = probe.kept[(k - 1) * L + 1][name]
                assert not (mask & ~previous).any()
    # The LR schedule restarts at every level: step k * L + j trains at the LR of step j.
    lrs = probe.lrs
    assert len(lrs) == (levels + 1) * L and lrs[1] != lrs[2]
    for k in range(1, levels + 1):
        assert lrs[k * L : (k + 1) * L] == lrs[:L]
    # One end-of-level validation per level, with its sparsity; the table has a row per level.
    rows = imp.level_rows()
    assert [r["level"] for r in rows] == [0, 1, 2, 3]
    assert [r["sparsity"] for r in rows] == sorted(r["sparsity"] for r in rows)
    assert rows[-1]["inference_reduction"] > rows[1]["inference_reduction"] > 1.0
    assert len(imp.table().splitlines()) == 2 + levels + 1
    title = imp.table().splitlines()[0]  # the scope in words, not a dangling "layer"
    assert title.endswith("of the remaining weights per level, ranked within each layer")
    assert probe.adam_steps[L + 1] == L + 1  # optimizer state kept by default


def test_iterative_pruning_global_scope_reset_optimizer_and_no_rewind(tmp_path: Path) -> None:
    L = 2
    imp = IterativePruning(
        L, 2, prune_fraction=0.3, scope="global", rewind_lr=False, reset_optimizer=True
    )
    probe, _ = _imp_fit(tmp_path, imp, steps=3 * L)
    masks = probe.kept[2 * L + 1]
    total = sum(m.numel() for m in masks.values())
    assert sum(int(m.sum()) for m in masks.values()) == int((1 - imp_sparsity(2, 0.3)) * total)
    assert probe.lrs[L] != probe.lrs[0]  # not rewound
    assert probe.adam_steps[L + 1] == 1 and probe.adam_steps[2 * L + 1] == 1  # cleared per level


def test_rewind_lr_scheduler_replays_recursive_schedules() -> None:
    def make() -> torch.optim.lr_scheduler.LRScheduler:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)

    reference, scheduler = make(), make()
    initial = (scheduler.state_dict(), [g["lr"] for g in scheduler.optimizer.param_groups])
    for _ in range(7):
        scheduler.optimizer.step()
        scheduler.step()
    for _ in range(3):
        reference.optimizer.step()
        reference.step()
    rewind_lr_scheduler(scheduler, initial, 3)
    assert scheduler.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
    assert scheduler.last_epoch == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"level_steps": 0, "levels": 2}, "level_steps"),
        ({"level_steps": 5, "levels": 2, "prune_fraction": 1.0}, "prune_fraction"),
        ({"level_steps": 5, "levels": 2, "scope": "model"}, "scope"),
    ],
)
def test_iterative_pruning_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        IterativePruning(**kwargs)


# ------------------------------------------------------------------ recipes through the CLI
TINY_CLI = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.max_seq_len=16",
    "--model.warmup_steps=1",
    "--data.seq_len=16",
    "--data.batch_size=2",
    "--data.max_bytes=20000",
    "--data.val_windows=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def _cli(recipe: str, tmp_path: Path, *overrides: str):
    pytest.importorskip("jsonargparse")  # the command's (an optional package)
    from lightning_sparse.app.cli import run as cli_run

    args = ["fit", "--config", str(RECIPES_DIR / recipe), *TINY_CLI, *overrides]
    return cli_run([*args, f"--trainer.logger.init_args.save_dir={tmp_path}"])


def test_vspdf_recipe_runs(tmp_path: Path) -> None:
    cli = _cli(
        "vspdf_llama.yaml",
        tmp_path,
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=4",
        "--trainer.callbacks.init_args.dense_from_step=2",
    )
    counter = next(c for c in cli.trainer.callbacks if isinstance(c, FlopCounter))
    assert [s.batches for s in counter.segments] == [2, 2]
    assert counter.segments[0].sparsity == pytest.approx(0.9, abs=1e-3)
    assert 0 < counter.summary()["saved"] < 0.9
    assert _masks(cli.model) == []


def test_imp_recipe_runs(tmp_path: Path) -> None:
    cli = _cli(
        "imp_llama.yaml",
        tmp_path,
        "--trainer.max_steps=6",
        "--trainer.val_check_interval=2",
        "--model.max_steps=2",
        "--trainer.callbacks.init_args.level_steps=2",
        "--trainer.callbacks.init_args.levels=2",
    )
    imp = next(c for c in cli.trainer.callbacks if isinstance(c, IterativePruning))
    assert [round(r["sparsity"], 2) for r in imp.level_rows()] == [0.0, 0.33, 0.55]


def test_chained_vspdf_recipes_run(tmp_path: Path) -> None:
    sparse = _cli(
        "vspdf_sparse.yaml", tmp_path, "--trainer.max_steps=2", "--trainer.val_check_interval=2"
    )
    ckpt = tmp_path / "sparse" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    recipe = yaml.safe_load((RECIPES_DIR / "vspdf_dense.yaml").read_text())
    for callback in recipe["trainer"]["callbacks"]:  # point both callbacks at this checkpoint
        key = "path" if callback["class_path"].endswith("LoadWeights") else "previous"
        callback["init_args"][key] = str(ckpt)
    override = tmp_path / "dense_paths.yaml"
    override.write_text(yaml.safe_dump({"trainer": {"callbacks": recipe["trainer"]["callbacks"]}}))
    dense = _cli(
        "vspdf_dense.yaml",
        tmp_path,
        f"--config={override}",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
    )
    counter = next(c for c in dense.trainer.callbacks if isinstance(c, FlopCounter))
    assert [s.run for s in counter.all_segments()] == [0, 1]
    assert counter.earlier[0].sparsity == pytest.approx(0.9, abs=1e-3)
    assert _masks(dense.model) == [] and _masks(sparse.model) != []


def test_run_summary_charges_the_dense_stage_at_dense_cost(tmp_path: Path) -> None:
    from lightning_sparse.lightning.summary import SparseRunSummary

    run_summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    # As the CLI orders them: recipe callbacks first, the run summary after them.
    t = trainer(tmp_path, max_steps=6, callbacks=[Static(0.75), VariableSPDF(4), run_summary])
    t.fit(TinyLM(), token_loader())
    assert run_summary.counters["train_flops"] == 3 * TOKENS * (
        4 * SPARSE_PER_TOKEN + 2 * DENSE_PER_TOKEN
    )
    assert run_summary.counters["dense_train_flops"] == 3 * TOKENS * 6 * DENSE_PER_TOKEN


def test_run_summary_and_flop_counter_agree_whatever_the_callback_order(tmp_path: Path) -> None:
    """Both cost a batch after its backward (one `FlopMeter`, one `FlopLedger`): listed before
    `VariableSPDF`, the summary used to charge the switch batch at the sparse cost it measured at
    batch start, while `FlopCounter` charged it dense."""
    from lightning_sparse.lightning.summary import SparseRunSummary

    run_summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    counter = FlopCounter(verbose=False)
    callbacks = [run_summary, counter, Static(0.75), VariableSPDF(4)]
    trainer(tmp_path, max_steps=6, callbacks=callbacks).fit(TinyLM(), token_loader())
    expected = 3 * TOKENS * (4 * SPARSE_PER_TOKEN + 2 * DENSE_PER_TOKEN)
    assert run_summary.train_flops == counter.summary()["flops"] == expected
    assert run_summary.counters["dense_train_flops"] == counter.summary()["dense_flops"]
