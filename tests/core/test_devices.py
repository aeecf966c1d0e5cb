"""Every tensor an algorithm holds follows ``model.to(device)`` made after ``apply``.

Lightning applies sparsity in the callbacks' ``setup``, on the CPU, and moves the model to the
GPU afterwards; an algorithm that kept a tensor of its own (a clone in a dict) crashed at its
first update on the GPU (issue 26). The move here is to the ``meta`` device, which the CPU can
emulate: every tensor reachable from the algorithm (its attributes, dicts, lists, hooks'
closures; the model and the optimizer excepted, which own theirs) must be on it afterwards.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.held import held_tensors
from benchmarks.step_ops import as_on_a_gpu
from lightning_sparse import core
from lightning_sparse.core.algorithms.registry import available_algorithms
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)

CUBIC = {"type": "cubic", "init": 0.0, "final": 0.6, "begin": 0, "end": 4}
CASES = {  # every algorithm the package registers, updating every 2 steps
    "static": lambda: core.Static(0.6, seed=1),
    "set": lambda: core.SET(0.6, update={"freq": 2}, drop_fraction=0.4, seed=1),
    "rigl": lambda: core.RigL(0.6, update={"freq": 2}, seed=1),
    "gmp": lambda: core.GMP(CUBIC, update={"freq": 2}),
    "granet": lambda: core.GraNet({**CUBIC, "init": 0.3}, update={"freq": 2}, seed=1),
}


def registered() -> list[str]:
    return sorted(
        n for n, c in available_algorithms().items() if c.__module__.startswith("lightning_sparse")
    )


def make(name: str) -> core.SparsityAlgorithm:
    if name not in CASES:
        pytest.fail(f"algorithm {name!r} is registered but has no entry in CASES; add one")
    return CASES[name]()


def off_device(obj: object, device: str) -> list[str]:
    return [f"{where}: {t.device}" for where, t in held_tensors(obj) if t.device.type != device]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3)
    )


def train(net: nn.Sequential, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(
            4,
            6,
            generator=torch.Generator().manual_seed(step),
            device=next(net.parameters()).device,
        )
        net(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_held_tensors_finds_a_tensor_in_a_closure_and_a_dict() -> None:
    """The walker the tests below rely on finds what a careless algorithm would hold."""
    kept = torch.ones(2)
    holder = types.SimpleNamespace(by_name={"w": [kept]}, hook=lambda: kept + 1)
    assert [w for w, t in held_tensors(holder) if t is kept] in (
        ["algorithm.by_name['w'][0]"],
        ["algorithm.hook<cell 0>"],
    )
    assert off_device(holder, "meta") != []


@pytest.mark.parametrize("name", registered())
def test_lightning_order_apply_then_move_then_optimizer_holds_nothing_behind(name: str) -> None:
    """Lightning's order: ``apply(model)`` in ``setup`` on the CPU, the move, then
    ``apply(optimizer)`` in ``on_fit_start``. Nothing is left behind at any point: the step
    path holds what it hooked weakly."""
    net, sparsity = model(), make(name)
    net.apply(sparsity)
    assert sparsity.sparse_params, name
    net.to("meta")
    assert off_device(sparsity, "meta") == [], name
    sparsity.apply(torch.optim.SGD(net.parameters(), lr=0.1))
    assert off_device(sparsity, "meta") == [], name
    for sp in sparsity.sparse_params.values():
        assert sp.mask.is_meta and all(e.is_meta for e in sparsity.ever_active.values())


def trained(name: str, steps: int = 5) -> tuple[nn.Sequential, core.SparsityAlgorithm, Any]:
    """A model trained ``steps`` steps with algorithm ``name`` (updates every 2 steps)."""
    net, sparsity = model(), make(name)
    net.apply(sparsity)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # no state: steps on any device
    sparsity.apply(optimizer)
    train(net, optimizer, steps)
    assert sparsity.step == steps
    return net, sparsity, optimizer


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu-path", "gpu-path"])
@pytest.mark.parametrize("name", registered())
def test_move_after_training_holds_nothing_behind_with_no_step_after_it(
    name: str, gpu_path: bool
) -> None:
    """Trained on the CPU (updates included), moved, and no step after it (Lightning moves the
    module back to the CPU when ``fit`` ends): no tensor of the old device is held by the
    algorithm, its hooks, or the last update's figures (they follow the masks)."""
    with as_on_a_gpu() if gpu_path else contextlib.nullcontext():
        net, sparsity, _ = trained(name)
        had_figures = bool(sparsity.last_update)
        net.to("meta")
    assert off_device(sparsity, "meta") == [], name
    assert bool(sparsity.last_update) == had_figures


@pytest.mark.parametrize("name", registered())
def test_move_then_a_step_still_trains_on_the_new_device(name: str) -> None:
    """After the move, the next step follows the moved tensors (on the meta device here)."""
    with as_on_a_gpu():
        net, sparsity, optimizer = trained(name)
        net.to("meta")
        train(net, optimizer, 1)
    assert sparsity.step == 6
    assert off_device(sparsity, "meta") == [], name


@pytest.mark.parametrize("name", registered())
def test_dtype_change_holds_no_copy_in_the_old_dtype(name: str) -> None:
    """``.to(torch.float64)`` with no step after it: nothing of a parameter's shape is held,
    in float32 or as an integer copy of a mask (the masks cost their bool bytes only)."""
    with as_on_a_gpu():
        net, sparsity, _ = trained(name)
        net.to(torch.float64)
    shapes = {tuple(p.shape) for p in net.parameters()}
    kept = [w for w, t in held_tensors(sparsity) if tuple(t.shape) in shapes]
    assert kept == [], kept
    assert all(p.dtype == torch.float64 for p in net.parameters())


@pytest.mark.parametrize("name", registered())
def test_state_dict_holds_packed_bits_on_the_cpu_only(name: str) -> None:
    """Masks and ever-active masks alike: 1 bit per weight, on the CPU, whatever the device."""
    net, sparsity = model(), make(name)
    net.apply(sparsity)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    sparsity.apply(optimizer)
    train(net, optimizer, 5)
    tensors = list(held_tensors(sparsity.state_dict(), "state"))
    assert tensors, name
    for where, t in tensors:
        assert t.device.type == "cpu" and t.dtype == torch.uint8 and t.ndim == 1, where
    state = sparsity.state_dict()
    ever = {n: m.clone() for n, m in sparsity.ever_active.items()}
    for m in sparsity.ever_active.values():
        m.fill_(False)
    sparsity.load_state_dict(state)
    for n, m in sparsity.ever_active.items():
        assert torch.equal(m, ever[n]), n


def test_ever_active_of_an_earlier_version_full_size_still_loads() -> None:
    net, sparsity = model(), core.RigL(0.5, update={"freq": 2}, seed=0)
    net.apply(sparsity)
    state = sparsity.state_dict()
    full = {n: torch.ones_like(m) for n, m in sparsity.ever_active.items()}
    sparsity.load_state_dict({**state, "ever_active": full})
    assert all(bool(m.all()) for m in sparsity.ever_active.values())


def test_to_empty_without_the_saved_state_refuses_the_next_step_and_changes_nothing() -> None:
    """``to_empty`` on the same device leaves masks of unknown values (the ones before are let
    go, held weakly): the next step refuses, naming the parameter and the fix, before it prunes
    or steps anything; loading the saved state then lets training go on."""
    net, sparsity, optimizer = trained("rigl", 3)
    saved = sparsity.state_dict()
    masks = {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}
    net.to_empty(device="cpu")
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0)
    net(torch.ones(4, 6)).sum().backward()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"mask buffer of '0\.weight' was replaced on cpu.*"):
        optimizer.step()
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    assert sparsity.step == 3
    sparsity.load_state_dict(saved)
    optimizer.step()
    assert sparsity.step == 4
    for name, sp in sparsity.sparse_params.items():
        assert torch.equal(sp.mask, masks[name]), name
        assert bool((sp.param[~sp.mask] == 0).all()), name
