"""Mixed precision and skipped steps.

Plain PyTorch with ``torch.amp.GradScaler("cpu")`` under CPU autocast (bf16 and fp16 both work on
CPU in torch 2.13): an inf gradient at a *pruned* position is masked away, so the step runs; an
inf at a *kept* position makes the scaler skip ``optimizer.step``, and then no mask changes and
``sparsity.step`` does not advance.

Lightning 2.6 on CPU: ``precision="bf16-mixed"`` is supported (no scaler). ``precision=
"16-mixed"`` with ``accelerator="cpu"`` is *not*: Lightning warns and silently switches to
bf16-mixed (checked below, so a Lightning upgrade that adds it is noticed). The fp16 + GradScaler
path of Lightning is reachable on CPU with ``plugins=[MixedPrecision("16-mixed", "cpu")]``, and is
tested that way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SET, RigL, SparsityAlgorithm, Static
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)

INF = float("inf")
AMP_DTYPES = [torch.bfloat16, torch.float16]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def first_index(mask: torch.Tensor, value: bool) -> tuple[int, ...]:
    """Index of the first position where ``mask == value``."""
    return tuple(int(i) for i in (mask == value).nonzero()[0])


def inject_inf(param: nn.Parameter, index: tuple[int, ...]) -> torch.utils.hooks.RemovableHandle:
    """Make the incoming gradient of ``param`` inf at ``index`` (before accumulation into .grad)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[index] = INF
        return grad

    return param.register_hook(hook)


class Setup:
    """Model + sparsity + SGD(momentum) + GradScaler, plain PyTorch spelling."""

    def __init__(self, sparsity: SparsityAlgorithm, dtype: torch.dtype) -> None:
        self.model = mlp()
        self.sparsity = sparsity
        self.dtype = dtype
        self.model.apply(sparsity)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        sparsity.apply(self.optimizer)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        self.optimizer_steps = 0
        self.optimizer.register_step_pre_hook(self._count)

    def _count(self, *args: object) -> None:
        self.optimizer_steps += 1

    def step(self, t: int) -> None:
        self.optimizer.zero_grad()
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(t))
        with torch.autocast("cpu", dtype=self.dtype):
            out = self.model(x)
        loss = out.float().pow(2).mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def masks(self) -> dict[str, torch.Tensor]:
        return {n: sp.mask.clone() for n, sp in self.sparsity.sparse_params.items()}

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def states(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {
            f"{names[id(p)]}.{k}": v.clone()
            for p, state in self.optimizer.state.items()
            for k, v in state.items()
            if torch.is_tensor(v)
        }


def assert_pruned_zero(setup: Setup, target: float) -> None:
    for name, sp in setup.sparsity.sparse_params.items():
        assert torch.count_nonzero(sp.param.detach()[~sp.mask]) == 0, name
        assert int(sp.mask.sum()) == int((1 - target) * sp.mask.numel()), name
        for key, value in setup.optimizer.state[sp.param].items():
            if torch.is_tensor(value) and value.shape == sp.param.shape:
                assert torch.count_nonzero(value[~sp.mask]) == 0, f"{name} {key}"


def assert_inf_at_batch_2(records: list, where: str) -> list[int]:
    """Per-batch ``(step, masks, scale)`` records of a run whose batch 2 had an inf gradient at a
    ``kept`` or ``pruned`` position: a kept inf skips the step and its mask update; a pruned one
    is masked away. Returns the recorded steps."""
    steps = [r[0] for r in records]
    scales = [r[2] for r in records]
    masks = [r[1] for r in records]
    if where == "kept":
        assert steps == [1, 2, 2, 3, 4], "the skipped batch must not advance sparsity.step"
        assert scales[2] == scales[1] * 0.5
        assert equal_dicts(masks[2], masks[1]), "the skipped step changed a mask"
        assert not equal_dicts(masks[3], masks[2]), "the next clean step changed no mask"
    else:
        assert steps == [1, 2, 3, 4, 5]
        assert scales[2] == scales[1]
        assert not equal_dicts(masks[2], masks[1]), "the update of batch 2 did not run"
    return steps


def equal_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


ALGORITHMS: dict[str, Callable[[], SparsityAlgorithm]] = {
    "static": lambda: Static(0.5),
    "set_every_step": lambda: SET(0.5, update=None, drop_fraction=0.5),
    # freq 2: the injected step (step 1) is not an update step, so gradients are masked.
    "rigl_freq2": lambda: RigL(0.5, update={"freq": 2}, drop_fraction=0.5),
}


@pytest.mark.parametrize("dtype", AMP_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("make", list(ALGORITHMS.values()), ids=list(ALGORITHMS))
def test_inf_grad_at_pruned_position_does_not_skip_the_step(
    make: Callable[[], SparsityAlgorithm], dtype: torch.dtype
) -> None:
    setup = Setup(make(), dtype)
    setup.step(0)  # a clean step first, so optimizer state exists
    assert setup.sparsity.step == 1 and setup.optimizer_steps == 1
    weight = setup.model[0].weight
    pruned = first_index(setup.model[0].weight_mask, False)
    scale, weights = setup.scaler.get_scale(), setup.weights()

    handle = inject_inf(weight, pruned)
    setup.step(1)
    handle.remove()

    assert setup.optimizer_steps == 2, "the scaler skipped optimizer.step"
    assert setup.scaler.get_scale() == scale, "the scaler backed off: it saw the inf"
    assert setup.sparsity.step == 2
    assert not torch.equal(weight.detach(), weights["0.weight"]), "weights did not move"
    assert torch.isfinite(weight.grad).all()
    assert_pruned_zero(setup, 0.5)


@pytest.mark.parametrize("dtype", AMP_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("cls", [SET, RigL])
def test_inf_grad_at_kept_position_skips_step_and_changes_no_mask(
    cls: type, dtype: torch.dtype
) -> None:
    setup = Setup(cls(0.5, update=None, drop_fraction=0.5), dtype)  # update every step
    setup.step(0)
    weight = setup.model[0].weight
    kept = first_index(setup.model[0].weight_mask, True)
    scale = setup.scaler.get_scale()
    masks, weights, states = setup.masks(), setup.weights(), setup.states()
    assert states, "SGD momentum buffers should exist after the first step"

    handle = inject_inf(weight, kept)
    setup.step(1)
    handle.remove()

    assert setup.optimizer_steps == 1, "optimizer.step ran despite an inf gradient"
    assert setup.scaler.get_scale() == scale * 0.5
    assert setup.sparsity.step == 1, "a skipped step advanced sparsity.step"
    assert equal_dicts(setup.masks(), masks), "a skipped step changed a mask"
    assert equal_dicts(setup.weights(), weights)
    assert equal_dicts(setup.states(), states)

    # The same step, clean: now the update runs and masks change (so the check above can fail).
    setup.step(1)
    assert setup.optimizer_steps == 2 and setup.sparsity.step == 2
    assert not equal_dicts(setup.masks(), masks), "the clean update step changed no mask"
    assert_pruned_zero(setup, 0.5)


@pytest.mark.parametrize("dtype", AMP_DTYPES, ids=["bf16", "fp16"])
def test_inf_grad_at_pruned_position_on_rigl_update_step_does_not_skip(dtype: torch.dtype) -> None:
    """docs/design.md: NaN/inf at pruned positions "never makes AMP skip a step" -- RigL too.

    On RigL update steps gradients stay dense through backward (for the grow score), so the inf at
    the pruned position reaches the scaler unless the library neutralises it.
    """
    setup = Setup(RigL(0.5, update=None, drop_fraction=0.5), dtype)  # every step updates
    setup.step(0)
    pruned = first_index(setup.model[0].weight_mask, False)
    scale, masks = setup.scaler.get_scale(), setup.masks()

    handle = inject_inf(setup.model[0].weight, pruned)
    setup.step(1)
    handle.remove()

    assert setup.optimizer_steps == 2, "the scaler skipped optimizer.step"
    assert setup.scaler.get_scale() == scale
    assert setup.sparsity.step == 2
    assert not equal_dicts(setup.masks(), masks), "the update did not run"
    assert_pruned_zero(setup, 0.5)


# ---------------------------------------------------------------------------- Lightning


class TinyModule(pl.LightningModule):
    """Two sparse Linear layers; optionally injects inf into one gradient at one batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(3)
        self.inject: tuple[int, tuple[int, ...]] | None = None  # (batch_idx, index in 0.weight)
        self._handle: torch.utils.hooks.RemovableHandle | None = None
        self.records: list[tuple[int, dict[str, torch.Tensor], float | None]] = []
        self.sparsity: SparsityAlgorithm | None = None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.inject is not None and batch_idx == self.inject[0]:
            self._handle = inject_inf(self.net[0].weight, self.inject[1])
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def on_train_batch_end(self, *args: object) -> None:
        assert self.sparsity is not None
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        masks = {n: sp.mask.clone() for n, sp in self.sparsity.sparse_params.items()}
        self.records.append((self.sparsity.step, masks, scaler.get_scale() if scaler else None))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 4, generator=g))
    return DataLoader(data, batch_size=8)


def fit(
    module: TinyModule, sparsity: SparsityAlgorithm, max_steps: int, **kwargs: object
) -> pl.Trainer:
    module.sparsity = sparsity
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[sparsity],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, loader())
    return trainer


def assert_module_sparse(
    module: TinyModule, sparsity: SparsityAlgorithm, target: float, optimizer: torch.optim.Optimizer
) -> None:
    assert set(sparsity.sparse_params) == {"net.0.weight", "net.2.weight"}
    for name, sp in sparsity.sparse_params.items():
        assert sp.mask.dtype == torch.bool
        assert int(sp.mask.sum()) == int((1 - target) * sp.mask.numel()), name
        assert torch.count_nonzero(sp.param.detach()[~sp.mask]) == 0, name
        for key, value in optimizer.state[sp.param].items():
            if torch.is_tensor(value) and value.shape == sp.param.shape:
                assert torch.count_nonzero(value[~sp.mask]) == 0, f"{name} {key}"


def test_lightning_bf16_mixed_rigl_keeps_exact_sparsity() -> None:
    module = TinyModule()
    twin = RigL(sparsity=0.8, update={"freq": 2})  # same seed: the masks fit starts from
    copy.deepcopy(module).apply(twin)
    initial = {n: sp.mask.clone() for n, sp in twin.sparse_params.items()}

    sparsity = RigL(sparsity=0.8, update={"freq": 2})
    trainer = fit(module, sparsity, max_steps=4, precision="bf16-mixed")
    assert trainer.precision_plugin.precision == "bf16-mixed"
    assert sparsity.step == 4 == trainer.global_step
    assert_module_sparse(module, sparsity, 0.8, trainer.optimizers[0])
    params = sparsity.sparse_params
    changed = [n for n, sp in params.items() if not torch.equal(sp.mask, initial[n])]
    assert changed, "RigL with freq 2 changed no mask in 4 steps"


def test_lightning_16_mixed_on_cpu_falls_back_to_bf16() -> None:
    """Lightning 2.6 has no fp16 AMP on CPU: it warns and uses bf16-mixed (no scaler)."""
    with pytest.warns(UserWarning, match="not supported on CPU"):
        trainer = pl.Trainer(
            accelerator="cpu",
            precision="16-mixed",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
    assert trainer.precision_plugin.precision == "bf16-mixed"
    assert getattr(trainer.precision_plugin, "scaler", None) is None


def test_lightning_fp16_scaler_plugin_rigl_keeps_exact_sparsity() -> None:
    module = TinyModule()
    sparsity = RigL(sparsity=0.8, update={"freq": 2})
    trainer = fit(module, sparsity, max_steps=4, plugins=[MixedPrecision("16-mixed", "cpu")])
    assert trainer.precision_plugin.scaler is not None
    assert sparsity.step == 4
    assert_module_sparse(module, sparsity, 0.8, trainer.optimizers[0])


@pytest.mark.parametrize("where", ["kept", "pruned"])
def test_lightning_fp16_scaler_inf_gradient(where: str) -> None:
    """Lightning + GradScaler: inf at a kept position skips the step and its mask update."""
    module = TinyModule()
    sparsity = SET(sparsity=0.5, update=None, drop_fraction=0.5, seed=0)  # masks change every step
    twin = SET(sparsity=0.5, update=None, seed=0)
    copy.deepcopy(module).apply(twin)
    index = first_index(twin.sparse_params["net.0.weight"].mask, where == "kept")
    module.inject = (2, index)  # batch 2: after two clean steps (the second one updates)
    fit(module, sparsity, max_steps=5, plugins=[MixedPrecision("16-mixed", "cpu")])

    steps = assert_inf_at_batch_2(module.records, where)
    assert sparsity.step == steps[-1]
    assert_module_sparse(module, sparsity, 0.5, module.trainer.optimizers[0])
