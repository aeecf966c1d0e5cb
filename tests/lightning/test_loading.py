"""A sparse Lightning checkpoint loads back through the paths users use.

The user's plain LightningModule (no mixin) trained with any sparsity callback loads with
``load_from_checkpoint`` and ``trainer.validate/test/predict(ckpt_path=...)`` without the
callback: no unexpected key, no warning, pruned weights exactly zero, the trained outputs. With
the callback the masks come back bit-exactly; `SparseLoadingMixin` registers them on a module
loaded without it; checkpoints of earlier versions still load; the ``lightning-sparse`` CLI's
checkpoints too.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sparse import (
    GMP,
    SET,
    GraNet,
    Group,
    RigL,
    SparseLoadingMixin,
    Static,
    restore_checkpoint_masks,
    restore_masks,
)
from lightning_sparse.core.state_dict import checkpoint_masks, mask_keys
from lightning_sparse.lightning.callback import check_resumable
from lightning_sparse.models import LitCausalLM
from tests.helpers import (  # noqa: F401  (one_thread: autouse fixture)
    TinyLM,
    assert_state_equal,
    full_state,
    mask_buffers,
    one_thread,
    repeated_batch_loader,
    token_loader,
    trainer,
)

DATA = Path(__file__).resolve().parents[1] / "data"
PROMPTS = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(3))


class EvalLM(TinyLM):
    """`TinyLM` with deterministic validation, test and predict steps: what a user writes, no
    mixin."""

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
    """The mixin first: loading also registers the checkpoint's masks."""


CALLBACKS: dict[str, Callable[[], Any]] = {
    "static": lambda: Static(0.5, seed=0),
    "gmp": lambda: GMP({"type": "linear", "init": 0.3, "slope": 0.1}, update={"freq": 2}),
    "set": lambda: SET(0.5, update={"freq": 2}, seed=0),
    "rigl": lambda: RigL(0.5, update={"freq": 2}, seed=0),
    "granet": lambda: GraNet(
        {"type": "cubic", "init": 0.2, "final": 0.6, "begin": 0, "end": 4}, update={"freq": 2}
    ),
    "group": lambda: Group({"net.fc1.*": Static(0.4), "net.fc2.*": RigL(0.6, update={"freq": 2})}),
}


def rigl() -> RigL:
    return CALLBACKS["rigl"]()


@contextmanager
def no_warnings() -> Iterator[None]:
    """Every warning is an error, but for the three the project's pytest config ignores (on a
    GPU machine every ``accelerator="cpu"`` Trainer says "GPU available but not used")."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        warnings.filterwarnings("ignore", message="GPU available but not used")
        yield


def assert_weights(module: nn.Module, ckpt: dict[str, Any]) -> None:
    """``module``'s weights are the checkpoint's, exactly 0 where its masks prune."""
    state = module.state_dict()
    assert not [k for k in state if k.endswith("_mask")]
    assert state.keys() == ckpt["state"].keys()
    for key, value in ckpt["state"].items():
        assert torch.equal(state[key], value), key
    for name, mask in ckpt["masks"].items():
        pruned = module.get_parameter(name).detach()[~mask]
        assert torch.equal(pruned, torch.zeros_like(pruned)), name


def assert_masks(module: nn.Module, ckpt: dict[str, Any]) -> None:
    """``module`` carries exactly the checkpoint's masks (bool buffers)."""
    got = mask_buffers(module)
    assert got.keys() == {f"{name}_mask" for name in ckpt["masks"]}
    for name, mask in ckpt["masks"].items():
        assert got[f"{name}_mask"].dtype == torch.bool
        assert torch.equal(got[f"{name}_mask"], mask), name


def _train(tmp: Path, kind: str) -> dict[str, Any]:
    module, callback = EvalLM(), CALLBACKS[kind]()
    fit = trainer(tmp, max_steps=5, callbacks=[callback])
    fit.fit(module, repeated_batch_loader())
    path = tmp / f"{kind}.ckpt"
    fit.save_checkpoint(path)
    module.eval()
    val = trainer(tmp, callbacks=[]).validate(module, token_loader(), verbose=False)[0]
    with torch.no_grad():
        logits = module.net(PROMPTS)
        predicted = module.net(next(iter(token_loader()))[0])
    saved = torch.load(path, weights_only=True)
    return {
        "kind": kind,
        "path": path,
        "saved": saved,
        "state": saved["state_dict"],
        "masks": {n: sp.mask.clone() for n, sp in callback.sparse_params.items()},
        "callback_state": callback.state_dict(),
        "val": val["val/loss"],
        "logits": logits,
        "predicted": predicted,
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """A checkpoint of EvalLM trained 5 steps under each callback."""
    tmp = tmp_path_factory.mktemp("ckpt")
    return {kind: _train(tmp, kind) for kind in CALLBACKS}


@pytest.fixture()
def sparse_ckpt(trained: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The RigL run (masks updated at steps 2 and 4, away from the initial ones)."""
    ckpt = trained["rigl"]
    initial = EvalLM()
    initial.apply(rigl())
    assert any(not torch.equal(m, ckpt["masks"][k[:-5]]) for k, m in mask_buffers(initial).items())
    return ckpt


# ---------------------------------------------------------------- the plain module, no callback
@pytest.mark.parametrize("kind", sorted(CALLBACKS))
def test_the_checkpoint_holds_no_mask_keys_and_the_masks_packed(trained, kind: str) -> None:
    ckpt = trained[kind]
    assert not [k for k in ckpt["state"] if k.endswith("_mask")]
    assert not [k for k in ckpt["saved"].get("callbacks", {}) if k in ckpt["saved"]["sparsity"]]
    assert_state_equal(list(ckpt["saved"]["sparsity"].values()), [ckpt["callback_state"]])
    got = checkpoint_masks(ckpt["saved"])
    assert got.keys() == ckpt["masks"].keys()
    assert all(torch.equal(got[n], m) for n, m in ckpt["masks"].items())


@pytest.mark.parametrize("kind", sorted(CALLBACKS))
def test_load_from_checkpoint_into_a_plain_module(trained, kind: str) -> None:
    ckpt = trained[kind]
    with no_warnings():
        module = EvalLM.load_from_checkpoint(ckpt["path"])
    assert_weights(module, ckpt)
    assert not mask_buffers(module)
    with torch.no_grad():
        assert torch.equal(module.net(PROMPTS), ckpt["logits"])


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
@pytest.mark.parametrize("kind", sorted(CALLBACKS))
def test_ckpt_path_into_a_plain_module_without_the_callback(trained, kind: str, stage: str) -> None:
    ckpt, module = trained[kind], EvalLM()
    with no_warnings():
        out = getattr(trainer(callbacks=[]), stage)(module, token_loader(), ckpt_path=ckpt["path"])
    assert_weights(module, ckpt)
    if stage == "predict":
        assert torch.equal(out[0], ckpt["predicted"])
    else:
        assert out[0][f"{'val' if stage == 'validate' else 'test'}/loss"] == ckpt["val"]


@pytest.mark.parametrize("kind", ["rigl", "group"])
def test_restore_masks_gives_a_plain_module_its_masks(trained, kind: str) -> None:
    """For the device, a report or an export: the masks from the checkpoint file."""
    ckpt = trained[kind]
    module = EvalLM.load_from_checkpoint(ckpt["path"])
    registered = restore_masks(module, torch.load(ckpt["path"], weights_only=True))
    assert sorted(registered) == sorted(f"{n}_mask" for n in ckpt["masks"])
    assert_masks(module, ckpt)
    assert_weights(module, ckpt)  # still no mask key in its state dict


# ---------------------------------------------------------------- with the callback
@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
@pytest.mark.parametrize("kind", sorted(CALLBACKS))
def test_ckpt_path_with_the_callback_restores_its_masks(trained, kind: str, stage: str) -> None:
    ckpt, module, callback = trained[kind], EvalLM(), CALLBACKS[kind]()
    with no_warnings():
        out = getattr(trainer(callbacks=[callback]), stage)(
            module, token_loader(), ckpt_path=ckpt["path"]
        )
    assert_weights(module, ckpt)
    assert_masks(module, ckpt)
    assert_state_equal(callback.state_dict(), ckpt["callback_state"])
    if stage == "predict":
        assert torch.equal(out[0], ckpt["predicted"])
    else:
        assert out[0][f"{'val' if stage == 'validate' else 'test'}/loss"] == ckpt["val"]


@pytest.mark.parametrize("kind", sorted(CALLBACKS))
def test_resume_with_the_callback_equals_the_uninterrupted_run(
    trained, kind: str, tmp_path: Path
) -> None:
    """Bit-exact: weights, masks, optimizer state and the callback's state after 7 steps."""
    ckpt = trained[kind]
    full_module, full_callback = EvalLM(), CALLBACKS[kind]()
    full = trainer(tmp_path / "full", max_steps=7, callbacks=[full_callback])
    full.fit(full_module, repeated_batch_loader())
    module, callback = EvalLM(), CALLBACKS[kind]()
    resumed = trainer(tmp_path / "resumed", max_steps=7, callbacks=[callback])
    resumed.fit(module, repeated_batch_loader(), ckpt_path=ckpt["path"])
    assert callback.step == full_callback.step == 7
    assert_state_equal(full_state(module), full_state(full_module))  # weights and masks
    assert_state_equal(callback.state_dict(), full_callback.state_dict())
    assert_state_equal(resumed.optimizers[0].state_dict(), full.optimizers[0].state_dict())


def test_resuming_with_another_algorithm_is_refused_naming_both(trained, tmp_path: Path) -> None:
    """A SET checkpoint resumed with RigL: RigL would start from step 0 at global step 5. Lightning
    loads the weights before any callback sees the checkpoint, so ``fit`` refuses after that, with
    the algorithm unchanged; `check_resumable` refuses before anything changes."""
    callback, module = rigl(), EvalLM()
    fit = trainer(tmp_path, max_steps=7, callbacks=[callback])
    before = full_state(module)
    with pytest.raises(ValueError, match=r"sparsity state of SET but none of RigL.*LoadWeights"):
        check_resumable(fit, trained["set"]["path"])
    assert_state_equal(full_state(module), before)
    assert callback.root is None and callback.step == 0 and not callback.sparse_params
    with pytest.raises(ValueError, match=r"sparsity state of SET but none of RigL.*LoadWeights"):
        fit.fit(module, token_loader(), ckpt_path=trained["set"]["path"])
    untouched = rigl()
    EvalLM().apply(untouched)
    assert_state_equal(callback.state_dict(), untouched.state_dict())  # as applied, no more


def test_resuming_with_other_settings_is_refused_before_anything_changes(
    trained, tmp_path: Path
) -> None:
    callback, module = RigL(0.7, update={"freq": 2}, seed=0), EvalLM()
    fit = trainer(tmp_path, max_steps=7, callbacks=[callback])
    before = full_state(module)
    with pytest.raises(ValueError, match=r"made with sparsity=.*construct the algorithm"):
        check_resumable(fit, trained["rigl"]["path"])
    assert_state_equal(full_state(module), before)
    assert callback.root is None and callback.step == 0
    fit.ckpt_path = trained["rigl"]["path"]  # set before fit: refused at setup, before apply
    with pytest.raises(ValueError, match=r"made with sparsity=.*construct the algorithm"):
        fit.fit(module, token_loader())
    assert_state_equal(full_state(module), before)
    assert callback.root is None


def test_an_old_checkpoint_keyed_by_class_is_refused_by_another_algorithm(tmp_path) -> None:
    """Earlier versions kept the state under ``checkpoint["callbacks"]["RigL"]``."""
    callback = SET(0.5, update={"freq": 2}, seed=0)
    with pytest.raises(ValueError, match=r"sparsity state of RigL but none of SET"):
        trainer(tmp_path, max_steps=7, callbacks=[callback]).fit(
            EvalLM(), token_loader(), ckpt_path=DATA / "rigl_v0.ckpt"
        )
    assert callback.step == 0


def test_a_corrupt_packed_mask_is_refused_before_anything_changes(sparse_ckpt, tmp_path) -> None:
    bad = copy.deepcopy(sparse_ckpt["saved"])
    packed = bad["sparsity"]["RigL"]["masks"]["net.fc2.weight"]
    bad["sparsity"]["RigL"]["masks"]["net.fc2.weight"] = packed[:-1]
    torch.save(bad, tmp_path / "bad.ckpt")
    callback = rigl()
    with pytest.raises(ValueError, match=r"masks\['net.fc2.weight'\].*119 bytes.*corrupt"):
        trainer(callbacks=[callback]).validate(
            EvalLM(), token_loader(), ckpt_path=tmp_path / "bad.ckpt"
        )
    module = EvalLM()  # and directly: nothing changes, the algorithm nor the model
    module.apply(callback := rigl())
    before, state = full_state(module), callback.state_dict()
    with pytest.raises(ValueError, match="corrupt"):
        callback.load_state_dict(bad["sparsity"]["RigL"])
    assert_state_equal(full_state(module), before)
    assert_state_equal(callback.state_dict(), state)


# ---------------------------------------------------------------- the mixin, old checkpoints
def test_the_mixin_registers_the_masks(sparse_ckpt) -> None:
    module = SparseEvalLM.load_from_checkpoint(sparse_ckpt["path"])
    assert_weights(module, sparse_ckpt)
    assert_masks(module, sparse_ckpt)
    module = SparseEvalLM()
    trainer(callbacks=[]).validate(module, token_loader(), ckpt_path=sparse_ckpt["path"])
    assert_masks(module, sparse_ckpt)


def test_with_a_callback_the_algorithm_checks_the_masks_not_the_mixin(sparse_ckpt) -> None:
    """A callback sparsifying fewer parameters than the checkpoint refuses it, and the mixin has
    registered nothing for the parameter the callback leaves dense."""
    callback = RigL(0.5, update={"freq": 2}, seed=0, param_filter=["net.fc1.*"])
    module, path = SparseEvalLM(), sparse_ckpt["path"]
    with pytest.raises(ValueError, match=r"other parameters or shapes.*'net.fc2.weight'"):
        trainer(callbacks=[callback]).validate(module, token_loader(), ckpt_path=path)
    assert "weight_mask" not in module.net.fc2._buffers


def old_layout(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint an earlier version wrote: masks as ``<param>_mask`` state-dict entries."""
    state = dict(ckpt["state"])
    state.update({f"{n}_mask": m.clone() for n, m in ckpt["masks"].items()})
    return {"state_dict": state}


def test_an_old_checkpoint_loads_without_a_callback(tmp_path) -> None:
    old = torch.load(DATA / "rigl_v0.ckpt", weights_only=True)
    masks = {k: v for k, v in old["state_dict"].items() if k.endswith("_mask")}
    module = SparseEvalLM.load_from_checkpoint(DATA / "rigl_v0.ckpt")
    assert_state_equal(mask_buffers(module), masks)
    for key, value in module.state_dict().items():
        assert torch.equal(value, old["state_dict"][key]), key
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*weight_mask"):
        EvalLM.load_from_checkpoint(DATA / "rigl_v0.ckpt")  # as before: the mixin is needed


def test_a_wrong_mask_shape_is_refused_before_anything_changes(sparse_ckpt) -> None:
    checkpoint = old_layout(sparse_ckpt)
    checkpoint["state_dict"]["net.fc2.weight_mask"] = torch.ones(2, 3, dtype=torch.bool)
    before = dict(checkpoint["state_dict"])
    module = SparseEvalLM()
    with pytest.raises(
        ValueError,
        match=r"'net.fc2.weight_mask' has shape \(2, 3\) but "
        r"'net.fc2.weight' has shape \(24, 40\)",
    ):
        module.on_load_checkpoint(checkpoint)
    assert not mask_buffers(module)
    assert all(checkpoint["state_dict"][k] is v for k, v in before.items())


def test_pruned_weights_are_zeroed_even_if_the_checkpoint_has_them_nonzero(sparse_ckpt) -> None:
    checkpoint = old_layout(sparse_ckpt)
    state = checkpoint["state_dict"]
    state["net.fc1.weight"] = state["net.fc1.weight"].clone()
    mask = state["net.fc1.weight_mask"]
    state["net.fc1.weight"][~mask] = 7.0
    held = state["net.fc1.weight"]
    module = SparseEvalLM()
    assert restore_checkpoint_masks(module, checkpoint) == list(mask_keys(state))
    module.load_state_dict(checkpoint["state_dict"])  # strict: the mask entries are taken
    assert_weights(module, sparse_ckpt)
    assert_masks(module, sparse_ckpt)
    assert (held[~mask] == 7.0).all()  # the caller's tensor is not modified


# ---------------------------------------------------------------- LitCausalLM and the CLI
TINY = [
    *("--trainer.accelerator", "cpu"),  # the recipes say auto: the GPU where there is one
    *("--model.dim", "32", "--model.n_layers", "1", "--model.max_seq_len", "32"),
    *("--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "20000"),
    *("--data.val_windows", "4", "--trainer.enable_progress_bar", "false"),
    *("--trainer.enable_model_summary", "false"),
    *("--trainer.logger", "lightning.pytorch.loggers.CSVLogger"),
]


def test_cli_checkpoint_loads_with_load_from_checkpoint_and_validate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jsonargparse")  # the command's (an optional package)
    from lightning_sparse.app import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    steps = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3"]
    fit = cli.run(["fit", *TINY, *steps, "--trainer.callbacks.init_args.update", "{freq: 1}"])
    trained_loss = fit.trainer.callback_metrics["val/loss"]  # validated after the last step
    (path,) = tmp_path.glob("outputs/**/checkpoints/last.ckpt")
    (config,) = tmp_path.glob("outputs/**/config.yaml")
    saved = torch.load(path, weights_only=True)
    ckpt = {"state": saved["state_dict"], "masks": checkpoint_masks(saved)}
    assert len(ckpt["masks"]) == 7  # q/k/v/o and gate/up/down of the one layer

    loaded = LitCausalLM.load_from_checkpoint(path)  # registers the masks (on_load_checkpoint)
    assert_weights(loaded, ckpt)
    assert_masks(loaded, ckpt)
    fit.model.eval()
    with torch.no_grad():
        prompt = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        assert torch.equal(loaded(prompt), fit.model(prompt))

    for extra in ([], ["--trainer.callbacks=[]"]):  # the run's callbacks (RigL), then none
        val = cli.run(["validate", "--config", str(config), *extra, "--ckpt_path", str(path)])
        sparsity = [c for c in val.trainer.callbacks if isinstance(c, RigL)]
        assert len(sparsity) == (0 if extra else 1)
        assert_weights(val.model, ckpt)
        assert_masks(val.model, ckpt)
        assert val.trainer.callback_metrics["val/loss"] == trained_loss
