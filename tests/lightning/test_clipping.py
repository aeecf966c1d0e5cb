"""Gradient clipping under every precision with the fused AdamW (`lightning_sparse.lightning.
clipping`, through `LitCausalLM.configure_gradient_clipping`).

Lightning's `MixedPrecision` refuses to clip for an optimizer that unscales in its own step (the
fused AdamW), under ``bf16-mixed`` too. The clip must hold at the optimizer step under
``32-true``, ``bf16-mixed``, ``bf16-true`` and ``16-mixed`` with a GradScaler (on the CPU through
``plugins=[MixedPrecision("16-mixed", "cpu", scaler=...)]``: Lightning turns ``precision=
"16-mixed"`` into bf16 there), and with a GradScaler the clip must act on the unscaled gradients:
the fused run then trains the same weights as the for-each AdamW, which Lightning unscales itself.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_sparse.lightning.clipping import clip_gradients, unscales_in_step
from lightning_sparse.models import LitCausalLM
from tests.helpers import one_thread, trainer  # noqa: F401  (one_thread: autouse fixture)

ADAMW = torch.optim.AdamW
PRECISIONS = ["32-true", "bf16-mixed", "bf16-true", "16-mixed"]


def model() -> LitCausalLM:
    torch.manual_seed(0)
    return LitCausalLM(dim=16, n_layers=1, n_heads=2, max_seq_len=8, warmup_steps=1, max_steps=8)


def batches(n: int = 8) -> DataLoader:
    """Random byte windows [4, 9]; the same on every call."""
    tokens = torch.randint(0, 256, (4 * n, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(list(tokens), batch_size=4)


def precision_args(precision: str, init_scale: float = 2.0**8) -> dict[str, object]:
    """Trainer arguments for ``precision``; ``16-mixed`` as a plugin with a CPU GradScaler."""
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": precision}


class StepGradients(pl.Callback):
    """Records the gradients each optimizer step used (after clipping, read in a step post-hook:
    the closure that computes them runs inside ``step``): their global 2-norm and largest
    magnitude, in float32. Steps whose gradients are not finite (a GradScaler skips them) are left
    out."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.maxima: list[float] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(self._record)

    def _record(self, optimizer: torch.optim.Optimizer, *args: object) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad.float().flatten() for p in params if p.grad is not None]
        if all(bool(g.isfinite().all()) for g in grads):
            self.norms.append(float(torch.linalg.vector_norm(torch.cat(grads))))
            self.maxima.append(float(torch.cat(grads).abs().max()))


def fit(precision: str, steps: int, **kwargs: object) -> tuple[pl.Trainer, StepGradients]:
    grads = StepGradients()
    args = {**precision_args(precision), **kwargs}
    run = trainer(
        max_steps=steps, callbacks=[grads], deterministic=False, limit_val_batches=0, **args
    )
    run.fit(model(), batches(steps))
    return run, grads


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_clip_norm_holds_at_the_step_under_every_precision(precision: str) -> None:
    clip = 1e-2  # far below the gradients' norm at initialisation: every step is clipped
    run, grads = fit(precision, steps=3, gradient_clip_val=clip)
    optimizer = run.optimizers[0]
    assert unscales_in_step(optimizer), "the fused AdamW is what Lightning refused to clip"
    assert len(grads.norms) == 3
    tolerance = 2e-2 if precision == "bf16-true" else 1e-4  # bf16 gradients, scaled in bf16
    assert grads.norms == pytest.approx([clip] * 3, rel=tolerance)
    weight = run.lightning_module.model.layers[0].mlp.up_proj.weight
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert weight.dtype == expected and bool(weight.isfinite().all())  # the fused AdamW stepped


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_clipping_by_value_under_mixed_precision(precision: str) -> None:
    clip = 1e-4
    _, grads = fit(precision, steps=2, gradient_clip_val=clip, gradient_clip_algorithm="value")
    assert grads.maxima == pytest.approx([clip] * 2, rel=1e-6)


def adamw(fused: bool) -> Callable[..., torch.optim.AdamW]:
    """`torch.optim.AdamW` with ``fused`` forced, for the model's ``configure_optimizers``."""

    def make(*args: object, **kwargs: object) -> torch.optim.AdamW:
        return ADAMW(*args, **{**kwargs, "fused": fused})  # type: ignore[arg-type]

    return make


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("clip", [0.5, 1e-3])
def test_16_mixed_fused_trains_the_weights_of_the_for_each_adamw(
    clip: float, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GradScaler: the for-each AdamW is unscaled by Lightning before the clip, the fused one
    by `clip_gradients`; a clip of the scaled gradients, or a second division by the scale in
    the fused step, would train other weights. The first scale overflows fp16, so steps are
    skipped on the way down (the fused step reads found_inf from the unscale)."""
    weights, scales = [], []
    for fused in (True, False):
        monkeypatch.setattr(torch.optim, "AdamW", adamw(fused))
        scaler = torch.amp.GradScaler(device, init_scale=2.0**20)
        run = trainer(
            accelerator="gpu" if device == "cuda" else "cpu",
            max_steps=8,
            gradient_clip_val=clip,
            plugins=[MixedPrecision("16-mixed", device, scaler=scaler)],
            deterministic=False,
            limit_val_batches=0,
        )
        module = model()
        run.fit(module, batches(8))
        assert unscales_in_step(run.optimizers[0]) == fused
        weights.append({n: p.detach().cpu() for n, p in module.named_parameters()})
        scales.append(scaler.get_scale())
    assert scales[0] == scales[1] < 2.0**20, "no step was skipped: found_inf is not exercised"
    start = dict(model().named_parameters())
    # The two AdamW kernels round differently (more so on a GPU); a clip of scaled gradients
    # moves the weights by far more.
    rtol, atol = (1e-5, 1e-6) if device == "cpu" else (1e-4, 1e-5)
    for name, weight in weights[0].items():
        assert not torch.equal(weight, start[name].detach()), f"{name} never stepped"
        torch.testing.assert_close(weight, weights[1][name], rtol=rtol, atol=atol, msg=name)


def test_an_unknown_clip_algorithm_is_named() -> None:
    module = model()
    run = trainer(precision="bf16-mixed")
    module.trainer = run
    optimizer = torch.optim.AdamW(module.parameters(), fused=True)
    with pytest.raises(ValueError, match="gradient_clip_algorithm='nrom'.*'norm'"):
        clip_gradients(module, optimizer, 1.0, "nrom")
