"""Checkpoints written by the previous layout (tests/data/README.md) still load and resume."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_sparse import RigL
from tests.helpers import TinyLM, token_loader, trainer

DATA = Path(__file__).resolve().parents[1] / "data"


def make_rigl() -> RigL:
    drop = {"type": "cosine", "init": 0.3, "half_period": 8}
    return RigL(0.5, update={"freq": 2}, drop_fraction=drop, seed=0)


def test_old_lightning_checkpoint_resumes(tmp_path: Path) -> None:
    old = torch.load(DATA / "rigl_v0.ckpt", weights_only=False)
    masks = {
        k.removesuffix("_mask"): v for k, v in old["state_dict"].items() if k.endswith("_mask")
    }
    assert masks, "the fixture has no masks"
    callback, module = make_rigl(), TinyLM()
    trainer(tmp_path, max_steps=5, callbacks=[callback]).fit(
        module, token_loader(), ckpt_path=DATA / "rigl_v0.ckpt"
    )  # restores, trains no step
    assert callback.step == 5 and callback.last_update_step == 4
    assert set(callback.sparse_params) == set(masks)
    for name, sp in callback.sparse_params.items():
        assert torch.equal(sp.mask, masks[name]), name
    callback, module = make_rigl(), TinyLM()
    trainer(tmp_path, max_steps=7, callbacks=[callback]).fit(
        module, token_loader(), ckpt_path=DATA / "rigl_v0.ckpt"
    )  # and goes on: one more update (step 6)
    assert callback.step == 7 and callback.last_update_step == 6
    for sp in callback.sparse_params.values():
        assert int(sp.mask.sum()) == int(0.5 * sp.mask.numel())
        assert not sp.param.detach()[~sp.mask].any()


def test_old_plain_state_loads() -> None:
    old = torch.load(DATA / "rigl_v0_plain.pt", weights_only=False)
    module = TinyLM()
    sparsity = make_rigl()
    module.apply(sparsity)
    module.load_state_dict(old["model"])
    sparsity.load_state_dict(old["sparsity"])
    assert sparsity.step == old["sparsity"]["step"] == 5
    assert sparsity.last_update_step == old["sparsity"]["last_update_step"] == 4
    for name, sp in sparsity.sparse_params.items():
        assert torch.equal(sp.mask, old["model"][f"{name}_mask"])
        assert sparsity.mask_target(name) == 0.5
