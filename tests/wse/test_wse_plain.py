"""Compact training in plain PyTorch: ``with on_wse(model, optimizer=optimizer):`` around an
ordinary loop trains the kept values only, with the machinery ``accelerator="wse"`` uses, and
equals masked dense training (the cpu path) and the Lightning device, float64, through mask
updates; its misuses are refused before anything is modified."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse.models.llama import Llama, LlamaConfig
from lightning_sparse.wse import on_wse
from lightning_sparse.wse.layer import STATE
from tests.helpers import one_thread, token_loader  # noqa: F401  (one_thread: autouse fixture)
from tests.wse.test_wse_compact import _close  # tensors, dicts, lists: equal in float64
from tests.wse.test_wse_device import (
    ALGORITHMS,
    PATH,
    STEPS,
)
from tests.wse.test_wse_device import _fit as lightning_fit

pytestmark = pytest.mark.filterwarnings("ignore:.*[Ss]parse.*:UserWarning")
MASKED = 14  # the tiny Llama's projection matrices


class Net(nn.Module):
    """TinyLlamaLM's model (seed, dtype) under the same name, ``model``: the algorithms draw
    their random masks by parameter name."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Llama(LlamaConfig.from_preset("tiny", vocab_size=16, max_seq_len=16)).double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def _model() -> Net:
    return Net()


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":  # TinyLlamaLM.configure_optimizers
        return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _epochs(loader: Any) -> Any:
    """The loader's batches, epoch after epoch (as the Trainer runs them)."""
    while True:
        yield from loader


class Held:
    """What the masked layers hold before each step (the weight parameters' storage bytes)."""

    def __init__(self) -> None:
        self.weight_bytes: list[int] = []


def _plain(
    kind: str,
    device: bool,
    optimizer_kind: str = "adamw",
    accumulate: int = 1,
    steps: int = STEPS,
    held: Held | None = None,
    inner: bool = False,
) -> dict[str, Any]:
    """A plain loop: ``model.apply``, ``sparsity.apply(optimizer)``, forward, backward, step;
    inside ``on_wse(model, optimizer=...)`` when ``device`` (of the Llama inside the model the
    algorithm was applied to, with ``inner``)."""
    model = _model()
    sparsity = ALGORITHMS[kind]()
    model.apply(sparsity)
    optimizer = _optimizer(model, optimizer_kind)
    sparsity.apply(optimizer)
    batches = _epochs(token_loader(n=64 * accumulate))
    losses = []

    def loop() -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            for _ in range(accumulate):
                (tokens,) = next(batches)
                loss = _loss(model, tokens) / accumulate
                loss.backward()
                losses.append(loss.detach() * accumulate)
            if held is not None:
                held.weight_bytes.append(
                    sum(
                        sp.param.untyped_storage().nbytes()
                        for sp in sparsity.sparse_params.values()
                    )
                )
            optimizer.step()

    if device:
        root = model.model if inner else model
        with on_wse(root, optimizer=optimizer, accumulate_grad_batches=accumulate, path=PATH):
            loop()
    else:
        loop()
    return {
        "losses": torch.stack(losses),
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "masks": {k: v.clone() for k, v in model.named_buffers() if k.endswith("_mask")},
        "sparsity": sparsity,
        "module": model,
        "opt": optimizer,
    }


CASES = [
    ("static", "adamw", 1),
    ("static", "sgd", 2),
    ("gmp", "adamw", 1),
    ("set", "sgd", 1),
    ("rigl", "adamw", 1),
    ("rigl", "sgd", 1),
    ("rigl", "adamw", 2),
    ("granet", "adamw", 1),
]


@pytest.mark.parametrize(("kind", "optimizer", "accumulate"), CASES)
def test_plain_compact_training_equals_masked_dense_training(
    kind: str, optimizer: str, accumulate: int
) -> None:
    """Losses every step, then model, optimizer state (the cpu format) and masks at the end."""
    held = Held()
    cpu = _plain(kind, False, optimizer, accumulate)
    wse = _plain(kind, True, optimizer, accumulate, held=held)
    _close(wse["losses"], cpu["losses"], "losses")
    _close(wse["model"], cpu["model"], "model")
    _close(wse["optimizer"], cpu["optimizer"], "optimizer")
    _close(wse["masks"], cpu["masks"], "masks")
    assert len(cpu["masks"]) == MASKED
    # Compact inside the block: before every step the masked weights held one element each.
    assert held.weight_bytes == [MASKED * 8] * STEPS
    sparsity = cpu["sparsity"]
    if kind != "static":
        assert any(sparsity.is_update_step(s) for s in range(1, STEPS))  # masks did move


def test_the_algorithm_may_own_a_model_that_contains_the_one_on_the_device() -> None:
    """``model.apply(sparsity)`` on a wrapper, ``on_wse(model.model, ...)``: the layers find
    their algorithm all the same and train compact."""
    held = Held()
    wse = _plain("rigl", True, steps=7, held=held, inner=True)
    cpu = _plain("rigl", False, steps=7)
    assert held.weight_bytes == [MASKED * 8] * 7
    _close(wse["model"], cpu["model"], "model")
    _close(wse["masks"], cpu["masks"], "masks")


def test_plain_equals_the_lightning_device() -> None:
    """The same RigL run (mask updates at steps 3, 6, 9) in a plain loop on the device and
    through ``Trainer(accelerator="wse")``: one machinery, the same numbers."""
    plain = _plain("rigl", True)
    lit = lightning_fit(_wse(), ALGORITHMS["rigl"])
    _close(plain["losses"], lit["losses"], "losses")
    state = {k: v for k, v in lit["state"].items() if k in plain["model"]}  # weights, buffers
    _close(plain["model"], state, "model")
    _close(plain["masks"], {k: v for k, v in lit["state"].items() if k.endswith("_mask")}, "masks")


def _wse() -> Any:
    from lightning_sparse.wse import WSEAccelerator

    return WSEAccelerator(kernel_path=PATH)


def test_after_the_block_training_goes_on_as_on_the_cpu_path() -> None:
    """After the block the model is an ordinary model; the optimizer's state dict has the cpu
    format, and its next step gives it the weights back (dense state, zeros at pruned
    positions): training goes on without the device, equal to masked dense training."""
    runs = {}
    for device in (False, True):
        run = _plain("rigl", device, steps=4)
        model, optimizer = run["module"], run["opt"]
        assert not any(STATE.get(m) for m in model.modules())
        saved = copy.deepcopy(optimizer.state_dict())
        tokens = next(iter(token_loader(n=8, seed=3)))[0]
        for _ in range(3):  # a mask update at step 6 included
            optimizer.zero_grad()
            _loss(model, tokens).backward()
            optimizer.step()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            assert [id(p) for p in params] == [id(p) for p in model.parameters()]
        runs[device] = (saved, copy.deepcopy(model.state_dict()),
                        copy.deepcopy(optimizer.state_dict()))  # fmt: skip
    _close(runs[True], runs[False], "after the block")


# ------------------------------------------------------------------ refusals
def _setup(kind: str = "static") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    sparsity = ALGORITHMS[kind]()
    model.apply(sparsity)
    return model, sparsity


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    params = [id(p) for group in optimizer.param_groups for p in group["params"]]
    return (copy.deepcopy(model.state_dict()), params, [type(m) for m in model.modules()])


def test_an_optimizer_that_is_not_elementwise_is_refused_before_anything_changes() -> None:
    model, _ = _setup()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    before = _snapshot(model, optimizer)
    with pytest.raises(TypeError, match="Adafactor.*elementwise|elementwise.*Adafactor"):
        with on_wse(model, optimizer=optimizer):
            pass
    _close(_snapshot(model, optimizer), before, "unchanged")


def test_an_optimizer_of_other_parameters_is_refused() -> None:
    model, _ = _setup()
    other = torch.optim.AdamW(_model().parameters(), lr=1e-2)
    before = _snapshot(model, other)
    with pytest.raises(ValueError, match="none of the optimizer's parameters"):
        with on_wse(model, optimizer=other):
            pass
    _close(_snapshot(model, other), before, "unchanged")


def test_an_optimizer_missing_a_masked_weight_is_refused_and_names_it() -> None:
    model, sparsity = _setup()
    name = next(iter(sparsity.sparse_params))
    params = [p for n, p in model.named_parameters() if n != name]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    before = _snapshot(model, optimizer)
    with pytest.raises(ValueError, match=rf"{name!r}.*steps it 0 times"):
        with on_wse(model, optimizer=optimizer):
            pass
    _close(_snapshot(model, optimizer), before, "unchanged")


def test_on_wse_twice_is_refused_and_the_first_block_trains_on() -> None:
    model, sparsity = _setup()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    tokens = next(iter(token_loader(n=8)))[0]
    with on_wse(model, optimizer=optimizer, path=PATH):
        _loss(model, tokens).backward()
        optimizer.step()  # compact now: the weights hold no values
        before = _snapshot(model, optimizer)
        with pytest.raises(RuntimeError, match="already runs on the device"):
            with on_wse(model, optimizer=optimizer):
                pass
        with pytest.raises(RuntimeError, match="trains compact under another executor"):
            from lightning_sparse.wse import install_executor

            install_executor(model)
        assert _snapshot(model, optimizer)[1:] == before[1:]
        optimizer.zero_grad()
        _loss(model, tokens).backward()
        optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_undeclared_accumulation_on_a_rigl_update_step_is_an_error_not_a_wrong_mask() -> None:
    """Without ``accumulate_grad_batches`` the device keeps one backward's grow candidates on an
    update step; a second backward before the step is refused, naming the fix."""
    model, sparsity = _setup("rigl")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    batches = _epochs(token_loader(n=64))
    with on_wse(model, optimizer=optimizer, path=PATH):
        for _ in range(3):  # steps 0-2; step 3 updates the masks
            optimizer.zero_grad()
            _loss(model, next(batches)[0]).backward()
            optimizer.step()
        assert sparsity.dense_grad_needed
        optimizer.zero_grad()
        _loss(model, next(batches)[0]).backward()
        with pytest.raises(RuntimeError, match="accumulate_grad_batches=N"):
            _loss(model, next(batches)[0]).backward()


def test_accumulate_grad_batches_must_be_positive() -> None:
    model, _ = _setup()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="accumulate_grad_batches must be an int >= 1, got 0"):
        with on_wse(model, optimizer=optimizer, accumulate_grad_batches=0):
            pass
    assert not any(STATE.get(m) for m in model.modules())


def test_the_machinery_both_paths_share_does_not_import_lightning() -> None:
    """One implementation: the executor, the layers and the compact state are plain PyTorch;
    only ``wse/lightning.py`` (the accelerator) and the package's registration import Lightning."""
    from tests.core.test_layers import PACKAGE, imports_of

    lightning_users = sorted(
        path.name
        for path in (PACKAGE / "wse").glob("*.py")
        if any(
            name.split(".")[0] in ("lightning", "pytorch_lightning") for name in imports_of(path)
        )
    )
    assert lightning_users == ["__init__.py", "lightning.py"]


# ------------------------------------------------------------------ grow candidates
@pytest.mark.parametrize("shape", [(7, 13), (1, 50), (33, 1)])
@pytest.mark.parametrize("count", [0, 1, 5])
def test_grow_candidates_are_the_top_outside_the_mask_ties_to_the_lower_index(
    shape: tuple[int, int], count: int
) -> None:
    """`compact.grow_candidates` against a stable sort: odd shapes, empty rows, ties, NaN/inf
    outside the mask (counted as 0, as the cpu path zeroes them), int32 positions."""
    from lightning_sparse.wse.compact import grow_candidates, with_candidates
    from lightning_sparse.wse.csr import CSRWeight

    g = torch.Generator().manual_seed(sum(shape) + count)
    grad = torch.randn(shape, generator=g, dtype=torch.float64).round(decimals=0)  # ties
    mask = torch.rand(shape, generator=g) < 0.3
    mask[0] = False  # an empty row
    grad.view(-1)[1] = float("nan")
    grad.view(-1)[2] = float("inf")
    count = min(count, int((~mask).sum()))
    csr = CSRWeight.from_dense(grad, mask)
    index, values = grow_candidates(grad, csr, count)
    assert index.dtype == torch.int32 and index.shape == values.shape == (count,)
    score = torch.where(mask, -1.0, torch.nan_to_num(grad, nan=0.0, posinf=0.0).abs()).view(-1)
    expected = torch.sort(score, descending=True, stable=True).indices[:count].sort().values
    assert torch.equal(index.long(), expected)
    clean = torch.where(grad.isfinite(), grad, torch.zeros_like(grad)).view(-1)
    assert torch.equal(values, clean[expected])
    dense = with_candidates(torch.zeros_like(grad), (index, values))
    assert torch.equal(dense.view(-1)[expected], clean[expected])


def test_a_loss_kept_after_the_update_step_keeps_no_replaced_structure_alive() -> None:
    """A plain loop keeps ``loss`` (and its graph) until the next step: the structures and values
    a mask update replaced must not live on in it (0.1 GB on the 51M-parameter model)."""
    import gc
    import weakref

    model, sparsity = _setup("rigl")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    batches = _epochs(token_loader(n=64))
    with on_wse(model, optimizer=optimizer, path=PATH):
        for step in range(4):  # the masks change at step 3
            if step == 3:
                states = [STATE[sp.module].compact for sp in sparsity.sparse_params.values()]
                old = [(weakref.ref(c.csr), c.values) for c in states]
                del states
            optimizer.zero_grad()
            loss = _loss(model, next(batches)[0])
            loss.backward()
            optimizer.step()
        gc.collect()
        assert loss.grad_fn is not None  # the graph is still referenced
        assert all(csr() is None for csr, _ in old)
        assert all(values.numel() == 0 and values.grad is None for _, values in old)
