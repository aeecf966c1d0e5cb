"""Compact training state on the device: the kept values are what the optimizer steps.

Every masked `nn.Linear` under a live algorithm trains its kept values (value gradients, optimizer
state of the values only; the weight parameter holds no values between steps), mask updates run
dense and move the moments as the cpu path does, and checkpoints keep the cpu format so runs
resume across the two accelerators. Everything is compared with ``accelerator="cpu"`` in float64.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_sparse import RigL, Static
from lightning_sparse.core.algorithms import SparsityAlgorithm
from lightning_sparse.lightning.imp import IterativePruning
from lightning_sparse.lightning.spdf import VariableSPDF
from lightning_sparse.wse import WSEAccelerator
from lightning_sparse.wse.layer import STATE
from tests.helpers import (  # one_thread: autouse fixture
    one_thread,  # noqa: F401
    repeated_batch_loader,
    token_loader,
)
from tests.wse.test_wse_device import PATH, TinyLlamaLM, _trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*[Ss]parse.*:UserWarning")
MASKED = 14  # the tiny Llama's projection matrices


def _rigl(freq: int = 3) -> RigL:
    return RigL(0.75, update={"freq": freq}, drop_fraction=0.3, seed=1)


def _accelerator(name: str) -> Any:
    return WSEAccelerator(kernel_path=PATH) if name == "wse" else "cpu"


def _fit(
    name: str,
    algorithm: SparsityAlgorithm,
    steps: int,
    callbacks: tuple[pl.Callback, ...] = (),
    module: pl.LightningModule | None = None,
    loader: Any = None,
    **kwargs: Any,
) -> tuple[pl.LightningModule, pl.Trainer]:
    module = module if module is not None else TinyLlamaLM()
    trainer = _trainer(_accelerator(name), [*callbacks, algorithm], max_steps=steps, **kwargs)
    trainer.fit(module, loader if loader is not None else token_loader(n=8 * steps))
    return module, trainer


def _close(a: Any, b: Any, what: str) -> None:
    if torch.is_tensor(a):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        if a.dtype == torch.bool:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=what)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            _close(a[key], b[key], f"{what}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{what}[{i}]")
    else:
        assert a == b, what


# ------------------------------------------------------------------ what is held
class Inspect(pl.Callback):
    """At one step's ``on_before_optimizer_step``: what the masked layers and optimizer hold."""

    def __init__(self, step: int) -> None:
        self.step, self.checked = step, 0

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any):
        if trainer.global_step != self.step:
            return
        (algorithm,) = [c for c in trainer.callbacks if isinstance(c, SparsityAlgorithm)]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        layers = trainer.accelerator.executor.compact.layers.values()
        compact = {id(layer.compact.weight): layer.compact for layer in layers}
        for sp in algorithm.sparse_params.values():
            weight = sp.param
            assert all(p is not weight for p in params), "the dense weight is stepped"
            assert weight.grad is None
            assert weight.untyped_storage().nbytes() == weight.element_size()  # one element
            values = compact[id(weight)].values
            nnz = int(sp.mask.sum())
            assert values.shape == (nnz,) and values.grad.shape == (nnz,)
            assert any(p is values for p in params)
            shapes = {k: tuple(v.shape) for k, v in optimizer.state[values].items()}
            assert shapes == {"step": (), "exp_avg": (nnz,), "exp_avg_sq": (nnz,)}
            self.checked += 1


def test_masked_layers_hold_values_gradients_and_moments_of_the_kept_weights_only() -> None:
    inspect = Inspect(step=2)
    module, trainer = _fit("wse", Static(0.75, seed=1), steps=4, callbacks=(inspect,))
    assert inspect.checked == MASKED
    # After the fit the model is an ordinary model again: dense weights, zero where pruned.
    for name, param in module.named_parameters():
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size(), name
    cpu, _ = _fit("cpu", Static(0.75, seed=1), steps=4)
    _close(module.state_dict(), cpu.state_dict(), "state_dict")


def test_without_an_elementwise_optimizer_layers_keep_the_dense_state() -> None:
    """Adafactor factors a matrix's second moment by rows and columns: stepping the kept values
    as a vector would change its numbers, so the layers keep the dense form."""

    class AdafactorLM(TinyLlamaLM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)

    wse, trainer = _fit("wse", Static(0.75, seed=1), steps=3, module=AdafactorLM())
    assert trainer.accelerator.stats.steps == 3
    cpu, _ = _fit("cpu", Static(0.75, seed=1), steps=3, module=AdafactorLM())
    _close(wse.state_dict(), cpu.state_dict(), "state_dict")


# ------------------------------------------------------------------ mask updates
def _masks(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The mask buffers (read from the modules, whether or not the state dict carries them)."""
    return {k: v.clone() for k, v in module.named_buffers() if k.endswith("_mask")}


class Snapshots(pl.Callback):
    """Model and optimizer state dicts and the masks after every optimizer step."""

    def __init__(self) -> None:
        self.rows: list[tuple[dict, dict, dict]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        model = {k: v.clone() for k, v in pl_module.state_dict().items()}
        optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.rows.append((model, optimizer, _masks(pl_module)))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_mask_updates_move_weights_and_moments_as_the_cpu_path(optimizer: str) -> None:
    """RigL every 3 steps: after every step the model and the optimizer state dicts (the cpu
    format: dense moments, zero where pruned; kept weights keep their moments, grown ones start
    at zero) equal the cpu path's, masks bit-exactly."""
    runs = {}
    for name in ("cpu", "wse"):
        snapshots = Snapshots()
        _fit(name, _rigl(), steps=8, callbacks=(snapshots,), module=TinyLlamaLM(optimizer))
        runs[name] = snapshots.rows
    assert len(runs["wse"]) == len(runs["cpu"]) == 8
    for step, (wse, cpu) in enumerate(zip(runs["wse"], runs["cpu"], strict=True)):
        _close(wse[0], cpu[0], f"model @ {step}")
        _close(wse[1], cpu[1], f"optimizer @ {step}")
        _close(wse[2], cpu[2], f"masks @ {step}")
    first, last = runs["cpu"][0][2], runs["cpu"][-1][2]
    assert len(first) == MASKED
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the masks did change


class InspectUpdate(pl.Callback):
    """Listed before the algorithm: around the mask update of step ``step``, what is held."""

    def __init__(self, step: int) -> None:
        self.step, self.masks, self.after = step, {}, 0

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any):
        if trainer.global_step != self.step:
            return
        (algorithm,) = [c for c in trainer.callbacks if isinstance(c, SparsityAlgorithm)]
        assert algorithm.is_update_step(self.step)
        for sp in algorithm.sparse_params.values():
            weight = sp.param
            # Still compact: the weight holds one element and no dense gradient; the layer
            # holds the gradient outside the mask that RigL reads, its grow candidates.
            assert weight.untyped_storage().nbytes() == weight.element_size(), sp.name
            assert weight.grad is None, sp.name
            index, values = STATE[sp.module].candidates
            count = algorithm.grow_candidates(sp.name)
            assert 0 < count < 0.1 * weight.numel(), sp.name
            assert index.dtype == torch.int32 and index.shape == values.shape == (count,)
            assert not sp.mask.view(-1)[index.long()].any(), sp.name  # all outside the mask
            self.masks[sp.name] = sp.mask.clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step != self.step + 1:
            return
        (algorithm,) = [c for c in trainer.callbacks if isinstance(c, SparsityAlgorithm)]
        layers = trainer.accelerator.executor.compact.layers.values()
        compact = {id(layer.compact.weight): layer.compact for layer in layers}
        params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
        for sp in algorithm.sparse_params.values():
            weight = sp.param
            assert weight.untyped_storage().nbytes() == weight.element_size(), sp.name
            assert weight.grad is None, sp.name
            assert STATE[sp.module].candidates is None, sp.name  # dropped after the update
            values = compact[id(weight)].values
            assert values.shape == (int(sp.mask.sum()),) and any(p is values for p in params)
            self.after += 1


def test_a_mask_update_keeps_the_layers_compact() -> None:
    """RigL's update step: no layer goes dense and no dense gradient is held; each layer keeps
    its grow candidates until the update has read them, and the values follow the new masks."""
    inspect = InspectUpdate(step=3)
    module, trainer = _fit("wse", _rigl(), steps=5, callbacks=(inspect,))
    assert len(inspect.masks) == inspect.after == MASKED
    after = _masks(module)
    changed = [n for n, m in inspect.masks.items() if not torch.equal(m, after[f"{n}_mask"])]
    assert changed  # the update did change masks under the compact layers
    cpu, _ = _fit("cpu", _rigl(), steps=5)
    _close(module.state_dict(), cpu.state_dict(), "state_dict")


class LoadSparsityState(pl.Callback):
    """At one step: reload the algorithm's own state (masks from another run) mid-run."""

    def __init__(self, step: int, state: dict[str, Any]) -> None:
        self.step, self.state = step, state

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            (algorithm,) = [c for c in trainer.callbacks if isinstance(c, SparsityAlgorithm)]
            algorithm.load_state_dict(self.state)


def test_loading_the_sparsity_state_mid_run_moves_the_compact_layers_as_the_cpu() -> None:
    """Masks written by loading the algorithm's state while the layers are compact: the values
    and moments follow them (`core.held`), as pruning does on the cpu path."""
    donor = _rigl()
    _fit("cpu", donor, steps=7)  # masks after two updates: not the run's masks at step 4
    state = copy.deepcopy(donor.state_dict())
    state["step"] = 4
    state["last_update_step"] = 3
    runs = {}
    for name in ("cpu", "wse"):
        module, trainer = _fit(name, _rigl(), steps=6, callbacks=(LoadSparsityState(4, state),))
        runs[name] = (module.state_dict(), copy.deepcopy(trainer.optimizers[0].state_dict()),
                      _masks(module))  # fmt: skip
    _close(runs["wse"], runs["cpu"], "run")


def test_rigl_200_steps_equal_the_cpu_path() -> None:
    """Losses over 200 steps of RigL (updates every 25 steps) and the final masks."""
    losses = {}
    masks = {}
    for name in ("cpu", "wse"):
        recorder = _Losses()
        module, _ = _fit(name, _rigl(freq=25), steps=200, callbacks=(recorder,),
                         loader=token_loader(n=8 * 200, seq=5, batch=8))  # fmt: skip
        losses[name] = torch.stack(recorder.losses)
        masks[name] = _masks(module)
    assert len(losses["cpu"]) == 200 and len(masks["cpu"]) == MASKED
    torch.testing.assert_close(losses["wse"], losses["cpu"], rtol=1e-9, atol=1e-12)
    _close(masks["wse"], masks["cpu"], "masks")


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *a: Any):
        self.losses.append(outputs["loss"].detach().clone())


# ------------------------------------------------------------------ checkpoints
class SaveAt(pl.Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)  # our own files


@pytest.mark.parametrize(("first", "second"), [("wse", "cpu"), ("cpu", "wse")])
def test_checkpoint_written_mid_run_has_the_cpu_format_and_resumes_across(
    first: str, second: str, tmp_path: Path
) -> None:
    """A checkpoint written during compact training holds exactly what the cpu path's holds
    (dense weights, masks, dense optimizer moments), and either resumes on the other
    accelerator to the uninterrupted run's end state."""
    paths = {name: tmp_path / f"{name}.ckpt" for name in ("cpu", "wse")}
    for name in ("cpu", "wse"):
        _fit(name, _rigl(), steps=7, callbacks=(SaveAt(5, paths[name]),),
             loader=repeated_batch_loader())  # fmt: skip
    saved = {name: _load(path) for name, path in paths.items()}
    _close(saved["wse"]["state_dict"], saved["cpu"]["state_dict"], "state_dict")
    _close(saved["wse"]["optimizer_states"], saved["cpu"]["optimizer_states"], "optimizer")
    resumed = TinyLlamaLM()
    trainer = _trainer(_accelerator(second), [_rigl()], max_steps=10)
    trainer.fit(resumed, repeated_batch_loader(), ckpt_path=paths[first])
    straight, _ = _fit("cpu", _rigl(), steps=10, loader=repeated_batch_loader())
    _close(resumed.state_dict(), straight.state_dict(), "resumed")
    _close(_masks(resumed), _masks(straight), "resumed masks")
    assert len(_masks(straight)) == MASKED


class RoundTrip(pl.Callback):
    """At one step: reload the model's and the optimizer's own state dicts."""

    def __init__(self, step: int) -> None:
        self.step, self.compact_after = step, -1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            optimizer = trainer.optimizers[0]
            model, state = copy.deepcopy(pl_module.state_dict()), optimizer.state_dict()
            state = copy.deepcopy(state)
            pl_module.load_state_dict(model)
            optimizer.load_state_dict(state)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any):
        if trainer.global_step == self.step + 1:
            self.compact_after = len(trainer.accelerator.executor.compact.layers)


def test_loading_state_dicts_during_compact_training_changes_nothing() -> None:
    roundtrip = RoundTrip(step=4)
    module, _ = _fit("wse", _rigl(), steps=8, callbacks=(roundtrip,))
    assert roundtrip.compact_after == MASKED  # compact again at the next step
    straight, _ = _fit("cpu", _rigl(), steps=8)
    _close(module.state_dict(), straight.state_dict(), "state_dict")
    _close(_masks(module), _masks(straight), "masks")


# ------------------------------------------------------------------ validation, densify
class ValidatedLM(TinyLlamaLM):
    def __init__(self) -> None:
        super().__init__()
        self.val_losses: list[torch.Tensor] = []

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.val_losses.append(loss.detach().clone())


def test_validation_during_compact_training_equals_the_cpu_path() -> None:
    runs = {}
    for name in ("cpu", "wse"):
        module = ValidatedLM()
        trainer = _trainer(_accelerator(name), [_rigl()], max_steps=8, val_check_interval=3,
                           limit_val_batches=2, num_sanity_val_steps=0)  # fmt: skip
        trainer.fit(module, token_loader(n=64), token_loader(n=16, seed=1))
        runs[name] = torch.stack(module.val_losses)
    assert len(runs["wse"]) == 4
    torch.testing.assert_close(runs["wse"], runs["cpu"], rtol=1e-9, atol=1e-12)


def test_densified_mid_run_the_layers_go_dense_and_train_as_on_the_cpu() -> None:
    """`VariableSPDF` removes the masks at step 4: the compact layers turn dense (weights and
    moments), then train every weight, as on the cpu path."""
    runs = {}
    for name in ("cpu", "wse"):
        module, trainer = _fit(name, Static(0.75, seed=1), steps=7,
                               callbacks=(VariableSPDF(dense_from_step=4),))  # fmt: skip
        runs[name] = (module.state_dict(), copy.deepcopy(trainer.optimizers[0].state_dict()))
    assert not any(k.endswith("_mask") for k in runs["cpu"][0])
    _close(runs["wse"][0], runs["cpu"][0], "state_dict")
    _close(runs["wse"][1], runs["cpu"][1], "optimizer")


def test_iterative_pruning_levels_on_compact_layers_equal_the_cpu_path() -> None:
    """`IterativePruning` (magnitude pruning at each level start, the kept count shrinking): the
    compact layers rebuild at every level and train as the cpu path, state dicts equal."""
    runs = {}
    for name in ("cpu", "wse"):
        imp = IterativePruning(3, levels=2, prune_fraction=0.5, param_filter="*proj.weight",
                               verbose=False)  # fmt: skip
        module = TinyLlamaLM()
        trainer = _trainer(_accelerator(name), [imp], max_steps=8)
        trainer.fit(module, token_loader(n=64))
        runs[name] = (module.state_dict(), copy.deepcopy(trainer.optimizers[0].state_dict()),
                      _masks(module))  # fmt: skip
    masks = runs["cpu"][2]
    assert len(masks) == MASKED and all(0.7 < 1 - m.float().mean() < 0.8 for m in masks.values())
    _close(runs["wse"], runs["cpu"], "run")


def test_a_mask_change_after_the_optimizer_is_gone_prunes_the_dense_weight() -> None:
    """`compact.rebuild` without the optimizer (collected): the layer stays dense under the new
    mask, pruned as the cpu path prunes it: weights the new mask drops are exactly 0, kept ones
    keep their values, grown ones start at 0."""
    import gc

    from lightning_sparse.wse import compact as compact_state
    from lightning_sparse.wse.csr import CSRWeight

    torch.manual_seed(0)
    old_mask = torch.rand(6, 8) < 0.5
    new_mask = old_mask.clone()
    new_mask[0] = ~old_mask[0]  # row 0: every kept weight dropped, every pruned one grown
    weight = torch.nn.Parameter(torch.randn(6, 8) * old_mask)
    dense = weight.detach().clone()
    optimizer = torch.optim.SGD([weight], lr=0.1)
    slot = compact_state.find_slot([optimizer], weight)
    assert slot is not None
    csr = CSRWeight.from_dense(weight.detach(), old_mask)
    layer = compact_state.to_compact(weight, csr, slot)
    del optimizer, slot
    gc.collect()
    assert layer.optimizer() is None
    new_csr = CSRWeight.from_dense(dense, new_mask)
    assert compact_state.rebuild(layer, new_csr, None) is None
    assert torch.equal(weight.detach(), dense * new_mask)
    assert bool((weight.detach()[~new_mask] == 0).all()) and bool(old_mask[0].any())
