"""A run the device refuses changes nothing: ``accelerator="wse"`` with a precision its CSR kernels
do not run is refused before any sparsity callback prunes (Lightning sets the accelerator up only
after every callback's ``setup``; the sparsity callbacks ask the accelerator first)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_sparse import RigL, Static
from lightning_sparse.lightning.callback import check_accelerator
from lightning_sparse.wse import WSEAccelerator
from tests.helpers import TinyLM, token_loader, trainer


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "16-true", "bf16-true"])
@pytest.mark.parametrize("algorithm", [RigL, Static], ids=["rigl", "static"])
def test_refused_precision_leaves_model_and_algorithm_bit_equal(
    precision: str, algorithm: type
) -> None:
    module = TinyLM()
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    sparsity = algorithm(0.5)
    state = sparsity.state_dict()
    fit = trainer(accelerator="wse", precision=precision, max_steps=1, callbacks=[sparsity])
    with pytest.raises(ValueError, match=f"does not support precision='{precision}'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit.fit(module, token_loader())
    after = module.state_dict()
    assert list(after) == list(weights)  # no mask buffer registered
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in weights.items())
    assert sparsity.root is None and not sparsity.sparse_params and sparsity.seed is None
    assert sparsity.state_dict() == state
    assert not any(h for m in module.modules() for h in m._forward_pre_hooks.values())


def test_check_accelerator_asks_only_accelerators_that_can_refuse() -> None:
    cpu = trainer(precision="bf16-mixed")
    check_accelerator(cpu)  # the CPU has no check_trainer: nothing to refuse
    wse = trainer(accelerator="wse", precision="32-true")
    check_accelerator(wse)
    assert isinstance(wse.accelerator, WSEAccelerator)
    with pytest.raises(ValueError, match=r"use precision in \('32-true', '64-true'\)"):
        check_accelerator(trainer(accelerator="wse", precision="bf16-true"))


def test_refused_precision_loads_no_weights(tmp_path) -> None:
    """`LoadWeights` (the next stage of a chained run) asks the accelerator before it loads."""
    from lightning_sparse import LoadWeights

    source = TinyLM()
    torch.save({"state_dict": source.state_dict()}, tmp_path / "previous.ckpt")
    module = TinyLM()
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    load = LoadWeights(str(tmp_path / "previous.ckpt"))
    fit = trainer(accelerator="wse", precision="bf16-true", max_steps=1, callbacks=[load])
    with pytest.raises(ValueError, match="does not support precision='bf16-true'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit.fit(module, token_loader())
    assert not load.loaded
    assert all(torch.equal(module.state_dict()[k], v) for k, v in weights.items())


def test_under_autocast_a_layer_falls_back_to_dense_masked_and_warns() -> None:
    """The CSR kernels run float32/float64 without autocast; under CPU autocast a masked layer
    runs dense instead (a warning says so), computing what masked dense training computes."""
    from torch import nn

    from lightning_sparse.wse import on_wse

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8))
    Static(0.7).apply(model)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    with on_wse(model), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match="so this layer runs dense"):
            y = model(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
