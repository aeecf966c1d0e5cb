"""Lightning integration: callbacks, optimizers, logging, checkpoints and resume, LightningCLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_sparse import GMP, SET, GraNet, Group, RigL, Static, configure
from tests.helpers import (
    TinyLM,
    assert_state_equal,
    full_state,
    repeated_batch_loader,
    token_loader,
    trainer,
)

SPARSE = ["net.fc1.weight", "net.fc2.weight"]


def _assert_sparse(module: TinyLM, sparsity: float) -> None:
    for name in SPARSE:
        owner = module.get_submodule(name.rsplit(".", 1)[0])
        mask, weight = owner.weight_mask, owner.weight
        assert mask.dtype == torch.bool
        assert int(mask.sum()) == int((1 - sparsity) * mask.numel())
        assert torch.all(weight[~mask] == 0)


@pytest.mark.parametrize("algorithm", ["static", "set", "rigl", "gmp"])
def test_fit_keeps_exact_sparsity_and_logs(tmp_path: Path, algorithm: str) -> None:
    make = {
        "static": lambda: Static(sparsity=0.75),
        "set": lambda: SET(sparsity=0.75, update={"freq": 2}),
        "rigl": lambda: RigL(sparsity=0.75, update={"freq": 2}),
        "gmp": lambda: GMP(
            sparsity={"type": "linear", "init": 0.5, "slope": 0.05}, update={"freq": 5}
        ),
    }
    callback = make[algorithm]()
    module = TinyLM()
    t = trainer(
        tmp_path, max_steps=6, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[callback]
    )
    t.fit(module, token_loader())
    expected = 0.75 if algorithm != "gmp" else 0.75  # gmp: 0.5 + 0.05 * 5 at its update step 5
    _assert_sparse(module, expected)
    assert callback.step == 6 == t.global_step
    assert set(callback.sparse_params) == set(SPARSE)
    metrics = t.logged_metrics
    assert metrics["sparsity/target"] == pytest.approx(expected)
    assert float(metrics["sparsity/actual"]) == pytest.approx(1 - int(0.25 * 960) / 960, abs=1e-6)


def test_masks_change_under_dynamic_callback(tmp_path: Path) -> None:
    callback = RigL(sparsity=0.75, update={"freq": 2}, drop_fraction=0.5)
    module = TinyLM()
    t = trainer(tmp_path, max_steps=1, callbacks=[callback])
    t.fit(module, token_loader())
    before = module.net.fc1.weight_mask.clone()
    t = trainer(tmp_path, max_steps=5, callbacks=[callback])
    t.fit(module, token_loader())
    assert not torch.equal(before, module.net.fc1.weight_mask)
    _assert_sparse(module, 0.75)


def _fit(
    tmp_path: Path,
    make,
    steps: int,
    ckpt: str | None = None,
    save_every: int | None = None,
    accumulate: int = 1,
) -> tuple[TinyLM, object]:
    callback = make()
    module = TinyLM()
    callbacks = [callback]
    if save_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=tmp_path / "ckpt",
                every_n_train_steps=save_every,
                save_top_k=-1,
                save_last=True,
            )
        )
    t = trainer(
        tmp_path,
        max_steps=steps,
        callbacks=callbacks,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=bool(save_every),
    )
    t.fit(module, repeated_batch_loader(), ckpt_path=ckpt)
    module.optimizer_state = t.optimizers[0].state_dict()  # type: ignore[assignment]
    return module, callback


@pytest.mark.parametrize(
    "make",
    [
        lambda: Static(sparsity=0.7),
        lambda: SET(
            sparsity=0.7,
            update={"freq": 2},
            drop_fraction={"type": "cosine", "init": 0.5, "half_period": 8},
        ),
        lambda: RigL(sparsity=0.7, update={"freq": 3}),
        lambda: GMP(sparsity=[0.3, 0.5, 0.7], update={"steps": [0, 3, 6]}),
        lambda: GraNet(
            {"type": "cubic", "init": 0.3, "final": 0.7, "begin": 0, "end": 6}, update={"freq": 3}
        ),
        lambda: Group({"net.fc1.*": Static(0.5), "net.fc2.*": RigL(0.7, update={"freq": 3})}),
    ],
    ids=["static", "set", "rigl", "gmp-cycling", "granet", "group"],
)
def test_resume_is_bit_exact(tmp_path: Path, make) -> None:
    """Resuming from a mid-run checkpoint gives the weights, masks and optimizer state of an
    uninterrupted run; the checkpoint's masks are the callback's (packed), not model state."""
    full, full_cb = _fit(tmp_path / "a", make, steps=8, accumulate=2)
    _, mid_cb = _fit(tmp_path / "b", make, steps=4, save_every=4, accumulate=2)
    ckpt = tmp_path / "b" / "ckpt" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert not [k for k in saved["state_dict"] if k.endswith("_mask")]
    assert type(mid_cb).__name__ not in saved["callbacks"]
    assert_state_equal(saved["sparsity"][type(mid_cb).__name__], mid_cb.state_dict())
    resumed, resumed_cb = _fit(tmp_path / "c", make, steps=8, ckpt=str(ckpt), accumulate=2)
    for (name, a), (_, b) in zip(
        full_state(full).items(), full_state(resumed).items(), strict=True
    ):
        assert torch.equal(a, b), name  # weights and masks
    assert_state_equal(resumed_cb.state_dict(), full_cb.state_dict())
    assert_state_equal(resumed.optimizer_state, full.optimizer_state)


def test_group_and_configure_result_as_callbacks(tmp_path: Path) -> None:
    group = Group({"*fc1*": Static(sparsity=0.5), "*fc2*": SET(sparsity=0.9, update={"freq": 2})})
    module = TinyLM()
    trainer(tmp_path, max_steps=4, callbacks=[group]).fit(module, token_loader())
    assert int(module.net.fc1.weight_mask.sum()) == int((1 - 0.5) * module.net.fc1.weight.numel())
    assert int(module.net.fc2.weight_mask.sum()) == int((1 - 0.9) * module.net.fc2.weight.numel())
    # fc1.bias matched the glob too: a Group filter is an explicit choice (Cerebras semantics).
    assert hasattr(module.net.fc1, "bias_mask")

    configured = configure({"algorithm": "rigl", "sparsity": 0.8, "update": {"freq": 2}})
    module = TinyLM()
    trainer(tmp_path, max_steps=4, callbacks=[configured]).fit(module, token_loader())
    _assert_sparse(module, 0.8)


def test_sparse_params_are_logged_and_hooks_fire(tmp_path: Path) -> None:
    seen: list[tuple[str, float]] = []
    callback = RigL(sparsity=0.5, update={"freq": 2})
    callback.register_target_sparsity_hook(lambda algo, name, value: seen.append((name, value)))
    trainer(tmp_path, max_steps=4, callbacks=[callback]).fit(TinyLM(), token_loader())
    # once at apply, then after steps 2 and 4's predecessors (update steps 2)
    assert [n for n, _ in seen[:2]] == SPARSE and all(v == 0.5 for _, v in seen)
    assert len(seen) == 2 * 2  # apply + the update at step 2 (step 4 is never reached before stop)


def test_lightning_cli_yaml_configures_callbacks(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse")  # LightningCLI's (an optional package)
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  max_steps: 3
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_sparse.RigL
      init_args:
        sparsity: 0.8
        update: {freq: 2}
        drop_fraction: {type: cosine, init: 0.3, half_period: 10}
"""
    )
    import tests.helpers as helpers

    class DataModuleLM(helpers.TinyLM):
        def train_dataloader(self):  # noqa: ANN202
            return token_loader()

    cli = LightningCLI(
        DataModuleLM, args=["fit", "--config", str(config)], save_config_callback=None
    )
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, RigL)]
    assert len(callbacks) == 1 and callbacks[0].step == 3
    _assert_sparse(cli.model, 0.8)


def test_lightning_cli_yaml_configures_a_group(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse")  # LightningCLI's (an optional package)
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  max_steps: 2
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_sparse.Group
      init_args:
        groups:
          "*fc1.weight":
            class_path: lightning_sparse.Static
            init_args: {sparsity: 0.5}
          "*fc2.weight":
            class_path: lightning_sparse.SET
            init_args: {sparsity: 0.75, update: {freq: 1}}
"""
    )
    import tests.helpers as helpers

    class DataModuleLM(helpers.TinyLM):
        def train_dataloader(self):  # noqa: ANN202
            return token_loader()

    cli = LightningCLI(
        DataModuleLM, args=["fit", "--config", str(config)], save_config_callback=None
    )
    (group,) = [c for c in cli.trainer.callbacks if isinstance(c, Group)]
    assert [type(a) for a in group] == [Static, SET] and group.step == 2
    assert {n: int(sp.mask.sum()) for n, sp in group.sparse_params.items()} == {
        "net.fc1.weight": 480,
        "net.fc2.weight": 240,
    }
