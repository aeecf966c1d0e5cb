"""Lightning on CUDA: ``precision="16-mixed"`` (a real ``GradScaler("cuda")``) and ``"bf16-mixed"``.

Each test runs on the CPU too (``DEVICES``): there fp16 goes through
``MixedPrecision("16-mixed", "cpu")``, since Lightning has no fp16 AMP for ``accelerator="cpu"``
(see ``test_amp.py``). The CUDA variants are marked ``cuda`` and skip without a GPU.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_sparse
from lightning_sparse import SET, RigL, SparsityAlgorithm
from lightning_sparse.core.algorithms.registry import BUILTIN
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.lightning.test_amp import (
    TinyModule,
    assert_inf_at_batch_2,
    assert_module_sparse,
    equal_dicts,
    first_index,
    inject_inf,
    loader,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class WhereDuringFit(pl.Callback):
    """The device types of the algorithm's weights, masks and ever-active masks after every
    training batch: while it trains, not after ``fit``, whose teardown moves the module (and with
    it the masks) back to the CPU."""

    def __init__(self, sparsity: SparsityAlgorithm) -> None:
        self.sparsity = sparsity
        self.seen: set[tuple[str, str]] = set()

    def on_train_batch_end(self, *args: object) -> None:
        for sp in self.sparsity.sparse_params.values():
            self.seen |= {("weight", sp.param.device.type), ("mask", sp.mask.device.type)}
        self.seen |= {("ever_active", m.device.type) for m in self.sparsity.ever_active.values()}


def assert_on_device_in_fit_then_with_the_module(
    where: WhereDuringFit, module: pl.LightningModule, device: str
) -> None:
    """Every weight and mask on ``device`` at every step; after ``fit`` each mask still beside
    its weight, wherever Lightning's teardown left the module (the CPU, from a GPU)."""
    kinds = {"weight", "mask"} | ({"ever_active"} if where.sparsity.ever_active else set())
    assert where.seen == {(kind, device) for kind in kinds}, where.seen
    after = next(module.parameters()).device
    for sp in where.sparsity.sparse_params.values():
        assert sp.param.device == sp.mask.device == after
    assert all(m.device == after for m in where.sparsity.ever_active.values())


class InjectingModule(TinyModule):
    """Injects inf into ``net.0.weight``'s gradient at batch ``at``, at the first kept (or
    pruned) position of the live mask (on whatever device the mask is)."""

    def __init__(self, at: int, kept: bool) -> None:
        super().__init__()
        self.at, self.kept = at, kept

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == self.at:
            self._handle = inject_inf(
                self.net[0].weight, first_index(self.net[0].weight_mask, self.kept)
            )
        return super().training_step(batch, batch_idx)


def fit(
    module: TinyModule,
    sparsity: SparsityAlgorithm,
    device: str,
    precision: str,
    max_steps: int,
    *more: pl.Callback,
) -> pl.Trainer:
    module.sparsity = sparsity
    amp: dict[str, object] = {"precision": precision}
    if device == "cpu" and precision == "16-mixed":
        amp = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[sparsity, *more],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **amp,
    )
    trainer.fit(module, loader())
    return trainer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_amp_rigl_keeps_exact_sparsity_on_the_device(device: str, precision: str) -> None:
    if device == "cuda" and precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    module = TinyModule()
    sparsity = RigL(sparsity=0.8, update={"freq": 2}, seed=0)
    where = WhereDuringFit(sparsity)
    trainer = fit(module, sparsity, device, precision, 5, where)
    assert (getattr(trainer.precision_plugin, "scaler", None) is not None) == (
        precision == "16-mixed"
    )
    assert sparsity.step == 5 == trainer.global_step
    assert_on_device_in_fit_then_with_the_module(where, module, device)
    assert_module_sparse(module, sparsity, 0.8, trainer.optimizers[0])
    first, last = module.records[0][1], module.records[-1][1]
    assert not equal_dicts(first, last), "RigL with freq 2 changed no mask in 5 steps"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["kept", "pruned"])
def test_lightning_fp16_scaler_inf_gradient_on_the_device(device: str, where: str) -> None:
    """Inf at a kept position: the scaler skips the step, and the mask update with it (the
    callback's ``check_finite``); at a pruned position it is masked away and nothing is skipped."""
    module = InjectingModule(at=2, kept=where == "kept")
    sparsity = SET(sparsity=0.5, update=None, drop_fraction=0.5, seed=0)  # updates every step
    fit(module, sparsity, device, "16-mixed", max_steps=5)
    assert_inf_at_batch_2(module.records, where)
    assert_module_sparse(module, sparsity, 0.5, module.trainer.optimizers[0])


CUBIC = {"type": "cubic", "init": 0.0, "final": 0.75, "begin": 0, "end": 4}
EVERY_ALGORITHM = {  # the Lightning classes of the registry's built-ins, updating every 2 steps
    "static": lambda: lightning_sparse.Static(0.75, seed=0),
    "gmp": lambda: lightning_sparse.GMP(CUBIC, update={"freq": 2}),
    "set": lambda: lightning_sparse.SET(0.75, update={"freq": 2}, seed=0),
    "rigl": lambda: lightning_sparse.RigL(0.75, update={"freq": 2}, seed=0),
    "granet": lambda: lightning_sparse.GraNet(
        {**CUBIC, "init": 0.5}, update={"freq": 2}, drop_fraction=0.3, seed=0
    ),
}


def test_every_builtin_algorithm_has_a_device_case() -> None:
    assert set(EVERY_ALGORITHM) == set(BUILTIN)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(EVERY_ALGORITHM))
def test_model_built_on_the_cpu_moved_by_the_trainer(device: str, name: str) -> None:
    """Issue 26: the callback applies sparsity in ``setup``, on the CPU; the Trainer moves the
    model afterwards. Five steps, mask updates at 2 and 4: exact counts, pruned weights and
    optimizer state 0, every mask and ever-active mask on the device."""
    module = TinyModule()
    assert module.net[0].weight.device.type == "cpu"
    sparsity = EVERY_ALGORITHM[name]()
    where = WhereDuringFit(sparsity)
    trainer = fit(module, sparsity, device, "32-true", 5, where)
    assert sparsity.step == 5 == trainer.global_step
    assert sparsity.last_update_step == (-1 if name == "static" else 4)
    assert_on_device_in_fit_then_with_the_module(where, module, device)
    assert_module_sparse(module, sparsity, 0.75, trainer.optimizers[0])
