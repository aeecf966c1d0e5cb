"""A sparse Lightning checkpoint loads back through the paths users use: ``load_from_checkpoint``,
``trainer.validate/test/predict(ckpt_path=...)`` with and without the sparsity callback, and the
``lightning-sparse`` CLI. Each time: masks bit-exact, pruned weights zero, the trained outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sparse import RigL, SparseLoadingMixin, restore_checkpoint_masks, strip_masks
from lightning_sparse.core.state_dict import mask_keys
from lightning_sparse.models import LitCausalLM
from tests.helpers import TinyLM, one_thread, token_loader, trainer  # noqa: F401

DATA = Path(__file__).resolve().parents[1] / "data"
PROMPTS = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(3))


class EvalLM(TinyLM):
    """`TinyLM` with deterministic validation, test and predict steps (no mixin)."""

    def _loss(self, batch: tuple[torch.Tensor]) -> torch.Tensor:
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch))

    def test_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        self.log("test/loss", self._loss(batch))

    def predict_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])


class SparseEvalLM(SparseLoadingMixin, EvalLM):
    """What a user writes: the mixin first."""


def rigl() -> RigL:
    return RigL(0.5, update={"freq": 2}, seed=0)


def model_masks(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if k.endswith("_mask")}


def assert_loaded(module: nn.Module, state: dict[str, Any]) -> None:
    """``module`` carries exactly the checkpoint's masks, bit-exact, and its weights."""
    masks = model_masks(module)
    assert masks.keys() == mask_keys(state).keys() and masks
    for key, weight in mask_keys(state).items():
        assert masks[key].dtype == torch.bool and torch.equal(masks[key], state[key]), key
        loaded = module.get_parameter(weight).detach()
        assert torch.equal(loaded, state[weight]), weight
        assert torch.equal(loaded[~masks[key]], torch.zeros(int((~masks[key]).sum()))), weight


@pytest.fixture(scope="module")
def sparse_ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SparseEvalLM trained 5 steps under RigL (masks updated at steps 2 and 4), checkpointed."""
    tmp = tmp_path_factory.mktemp("ckpt")
    module, callback = SparseEvalLM(), rigl()
    fit = trainer(tmp, max_steps=5, callbacks=[callback])
    fit.fit(module, token_loader())
    path = tmp / "sparse.ckpt"
    fit.save_checkpoint(path)
    module.eval()
    val = trainer(tmp, callbacks=[]).validate(module, token_loader(), verbose=False)[0]
    with torch.no_grad():
        logits = module.net(PROMPTS)
        predicted = module.net(next(iter(token_loader()))[0])
    state = torch.load(path, weights_only=False)["state_dict"]
    initial = SparseEvalLM()  # the masks moved away from the initial ones: loading matters
    assert any(not torch.equal(v, state[k]) for k, v in model_masks(_applied(initial)).items())
    return {
        "path": path,
        "state": state,
        "val": val["val/loss"],
        "logits": logits,
        "predicted": predicted,
    }


def _applied(module: nn.Module) -> nn.Module:
    module.apply(rigl())
    return module


def test_load_from_checkpoint_without_a_callback(sparse_ckpt: dict[str, Any]) -> None:
    module = SparseEvalLM.load_from_checkpoint(sparse_ckpt["path"])
    assert_loaded(module, sparse_ckpt["state"])
    with torch.no_grad():
        assert torch.equal(module.net(PROMPTS), sparse_ckpt["logits"])


@pytest.mark.parametrize("with_callback", [False, True], ids=["plain-trainer", "rigl-callback"])
@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_trainer_ckpt_path(sparse_ckpt: dict[str, Any], stage: str, with_callback: bool) -> None:
    module, callbacks = SparseEvalLM(), [rigl()] if with_callback else []
    run = getattr(trainer(callbacks=callbacks), stage)
    out = run(module, token_loader(), ckpt_path=sparse_ckpt["path"])
    assert_loaded(module, sparse_ckpt["state"])
    if with_callback:  # the algorithm holds the checkpoint's masks (and its state) too
        for name, sp in callbacks[0].sparse_params.items():
            assert torch.equal(sp.mask, sparse_ckpt["state"][f"{name}_mask"])
        assert callbacks[0].step == 5
    if stage == "predict":
        assert torch.equal(out[0], sparse_ckpt["predicted"])
    else:
        key = "val/loss" if stage == "validate" else "test/loss"
        assert out[0][key] == sparse_ckpt["val"]


def test_a_module_without_the_mixin(sparse_ckpt: dict[str, Any]) -> None:
    """What docs/workflows.md tells a plain module: with the callback ``ckpt_path=`` works;
    without it strict loading refuses the masks, and ``strict_loading = False`` or `strip_masks`
    load the (pruned) weights without masks."""
    module, path = EvalLM(), sparse_ckpt["path"]
    out = trainer(callbacks=[rigl()]).validate(module, token_loader(), ckpt_path=path)
    assert_loaded(module, sparse_ckpt["state"])
    assert out[0]["val/loss"] == sparse_ckpt["val"]
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*weight_mask"):
        trainer(callbacks=[]).validate(EvalLM(), token_loader(), ckpt_path=sparse_ckpt["path"])
    module = EvalLM()
    module.strict_loading = False
    out = trainer(callbacks=[]).validate(module, token_loader(), ckpt_path=sparse_ckpt["path"])
    assert out[0]["val/loss"] == sparse_ckpt["val"] and not model_masks(module)
    dense = EvalLM()
    dense.load_state_dict(strip_masks(sparse_ckpt["state"]))
    with torch.no_grad():
        assert torch.equal(dense.net(PROMPTS), sparse_ckpt["logits"])


def test_resume_with_the_mixin_and_the_callback(sparse_ckpt: dict[str, Any], tmp_path) -> None:
    callback, module = rigl(), SparseEvalLM()
    trainer(tmp_path, max_steps=7, callbacks=[callback]).fit(
        module, token_loader(), ckpt_path=sparse_ckpt["path"]
    )
    assert callback.step == 7 and callback.last_update_step == 6
    for name, sp in callback.sparse_params.items():
        assert not sp.param.detach()[~sp.mask].any(), name
    assert model_masks(module).keys() == mask_keys(sparse_ckpt["state"]).keys()


def test_with_a_callback_the_algorithm_checks_the_masks_not_the_mixin(sparse_ckpt) -> None:
    """A callback sparsifying fewer parameters than the checkpoint refuses it, and the mixin has
    registered nothing for the parameter the callback leaves dense."""
    callback = RigL(0.5, update={"freq": 2}, seed=0, param_filter=["net.fc1.*"])
    module, path = SparseEvalLM(), sparse_ckpt["path"]
    with pytest.raises(ValueError, match=r"masks for \['net.fc2.weight_mask'\]"):
        trainer(callbacks=[callback]).validate(module, token_loader(), ckpt_path=path)
    assert "weight_mask" not in module.net.fc2._buffers


def test_an_old_checkpoint_loads_without_a_callback() -> None:
    old = torch.load(DATA / "rigl_v0.ckpt", weights_only=False)
    assert_loaded(SparseEvalLM.load_from_checkpoint(DATA / "rigl_v0.ckpt"), old["state_dict"])


def test_a_wrong_mask_shape_is_refused_before_anything_changes(sparse_ckpt) -> None:
    checkpoint = {"state_dict": dict(sparse_ckpt["state"])}
    checkpoint["state_dict"]["net.fc2.weight_mask"] = torch.ones(2, 3, dtype=torch.bool)
    before = dict(checkpoint["state_dict"])
    module = SparseEvalLM()
    with pytest.raises(
        ValueError,
        match=r"'net.fc2.weight_mask' has shape \(2, 3\) but "
        r"'net.fc2.weight' has shape \(24, 40\)",
    ):
        module.on_load_checkpoint(checkpoint)
    assert not model_masks(module)
    assert all(checkpoint["state_dict"][k] is v for k, v in before.items())


def test_pruned_weights_are_zeroed_even_if_the_checkpoint_has_them_nonzero(sparse_ckpt) -> None:
    state = {k: v.clone() for k, v in sparse_ckpt["state"].items()}
    mask = state["net.fc1.weight_mask"]
    state["net.fc1.weight"][~mask] = 7.0
    held = state["net.fc1.weight"]
    module = SparseEvalLM()
    checkpoint = {"state_dict": state}
    assert restore_checkpoint_masks(module, checkpoint) == list(mask_keys(state))
    module.load_state_dict(checkpoint["state_dict"])
    assert_loaded(module, sparse_ckpt["state"])
    assert (held[~mask] == 7.0).all()  # the caller's tensor is not modified


# ---------------------------------------------------------------- LitCausalLM and the CLI
TINY = [
    *("--model.dim", "32", "--model.n_layers", "1", "--model.max_seq_len", "32"),
    *("--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"),
    *("--data.val_windows", "4", "--trainer.enable_progress_bar", "false"),
    *("--trainer.enable_model_summary", "false"),
    *("--trainer.logger", "lightning.pytorch.loggers.CSVLogger"),
]


def test_cli_checkpoint_loads_with_load_from_checkpoint_and_validate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_sparse.app import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    steps = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3"]
    fit = cli.run(["fit", *TINY, *steps, "--trainer.callbacks.init_args.update", "{freq: 1}"])
    trained_loss = fit.trainer.callback_metrics["val/loss"]  # validated after the last step
    (ckpt,) = tmp_path.glob("outputs/**/checkpoints/last.ckpt")
    (config,) = tmp_path.glob("outputs/**/config.yaml")
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert len(mask_keys(state)) == 7  # q/k/v/o and gate/up/down of the one layer

    loaded = LitCausalLM.load_from_checkpoint(ckpt)
    assert_loaded(loaded, state)
    fit.model.eval()
    with torch.no_grad():
        prompt = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        assert torch.equal(loaded(prompt), fit.model(prompt))

    for extra in ([], ["--trainer.callbacks=[]"]):  # the run's callbacks (RigL), then none
        val = cli.run(["validate", "--config", str(config), *extra, "--ckpt_path", str(ckpt)])
        sparsity = [c for c in val.trainer.callbacks if isinstance(c, RigL)]
        assert len(sparsity) == (0 if extra else 1)
        assert_loaded(val.model, state)
        assert val.trainer.callback_metrics["val/loss"] == trained_loss
