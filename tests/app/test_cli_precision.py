"""``lightning-sparse fit --trainer.precision ...`` through the command (a subprocess): every
recipe trains under ``bf16-mixed``, and the default one under ``bf16-true``, with the recipe's
gradient clipping and LitCausalLM's fused AdamW (Lightning's `MixedPrecision` refused to clip
for it: a traceback at the first step). The clipping itself is checked in
``tests/lightning/test_clipping.py``.

Tiny runs on the CPU with CSV logs (``tests/app/test_cli.py``'s arguments and helpers).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_sparse.core.state_dict import checkpoint_masks
from tests.app.test_cli import CSV, REPO, TINY, finish, lightning_sparse

RECIPES = REPO / "recipes"  # this checkout's, not the installed package's
STEPS = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
# The recipes that write CSV logs already (a logger override would drop their save_dir).
OWN_CSV = ("imp_llama", "vspdf_llama", "vspdf_sparse", "vspdf_dense", "hf_llama_tiny")
SHORTER = {  # the recipes' own schedules, shrunk into a run of 4 steps
    "imp_llama": [
        *("--trainer.max_steps", "4", "--model.max_steps", "2"),
        *("--trainer.callbacks.init_args.level_steps", "2"),
        *("--trainer.callbacks.init_args.levels", "2"),
    ],
    "vspdf_llama": [
        *("--trainer.max_steps", "4", "--trainer.val_check_interval", "4"),
        *("--trainer.callbacks.init_args.dense_from_step", "2"),
    ],
}


# Model settings TINY's dim 32 does not fit (heads that divide it, a narrower SwiGLU).
SMALLER = {"rigl_llama_3b_wse": ["--model.n_heads", "4", "--model.ffn_hidden", "64"]}


def fit(recipe: str, precision: str, cwd: Path, *extra: str) -> tuple[dict[str, Any], Path]:
    """Train ``recipe`` tiny under ``precision``; its summary and run directory."""
    args = ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *TINY, *STEPS]
    args += SMALLER.get(recipe, [])
    logger = [] if recipe in OWN_CSV else CSV
    args += [*logger, *SHORTER.get(recipe, []), *extra, "--trainer.precision", precision]
    output = finish(lightning_sparse(*args, cwd=cwd), timeout=180)
    found = re.search(r"summary saved to (\S+)", output)
    assert found, output[-3000:]
    path = cwd / found[1]
    summary = json.loads(path.read_text())
    trainer = yaml.safe_load((path.parent / "config.yaml").read_text())["trainer"]
    assert trainer["precision"] == precision
    assert trainer["gradient_clip_val"] == 1.0  # the recipe's clipping, kept
    assert math.isfinite(summary["val"]["loss"])
    return summary, path.parent


# Every recipe but stage 2 of the chained Variable SPDF, which runs after its stage 1.
NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem != "vspdf_dense")


@pytest.mark.parametrize("recipe", NAMES)
def test_every_recipe_trains_under_bf16_mixed(recipe: str, tmp_path: Path) -> None:
    if recipe == "hf_llama_tiny":
        pytest.importorskip("transformers")
        pytest.importorskip("tokenizers")
    summary, _ = fit(recipe, "bf16-mixed", tmp_path)
    assert summary["steps"] == (4 if recipe in SHORTER else 2)
    if recipe == "vspdf_sparse":  # stage 2 starts from stage 1's checkpoint, in the same place
        dense, _ = fit("vspdf_dense", "bf16-mixed", tmp_path)
        assert dense["steps"] == 2


def test_the_default_recipe_trains_under_bf16_true(tmp_path: Path) -> None:
    summary, run = fit("rigl_llama", "bf16-true", tmp_path)
    assert summary["steps"] == 2
    # The validation loss is summed in float32: not a bfloat16 number (the metric's state was
    # cast with the module, and the loss rounded to ~3 digits).
    loss = summary["val"]["loss"]
    assert torch.tensor(loss).bfloat16().item() != loss
    saved = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    masks = checkpoint_masks(saved)
    assert len(masks) == 7  # the decoder's linear layers
    for name, mask in masks.items():
        weight = saved["state_dict"][name]
        assert weight.dtype == torch.bfloat16  # trained in bf16, fused AdamW included
        assert not weight[~mask].any() and weight[mask].isfinite().all()
