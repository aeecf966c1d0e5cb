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
from collections.abc import Iterator

import pytest
import torch
from torch import nn

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


def held_tensors(obj: object, path: str = "algorithm") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor reachable from ``obj``: attributes, mappings,
    sequences, sets and the cells of functions' closures, each object once; modules and
    optimizers are not entered (they own their tensors), nor weak references."""
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [(path, obj)]
    while stack:
        where, value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield where, value
        elif isinstance(value, (nn.Module, torch.optim.Optimizer, type, types.ModuleType)):
            continue
        elif isinstance(value, dict):
            stack.extend((f"{where}[{k!r}]", v) for k, v in value.items())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, types.FunctionType):
            cells = value.__closure__ or ()
            stack.extend((f"{where}<cell {i}>", c.cell_contents) for i, c in enumerate(cells))
        elif isinstance(value, types.MethodType):
            stack.append((f"{where}.__self__", value.__self__))
        elif hasattr(value, "__dict__") and not isinstance(value, torch.Generator):
            stack.extend((f"{where}.{k}", v) for k, v in vars(value).items())


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
    ``apply(optimizer)`` in ``on_fit_start``."""
    net, sparsity = model(), make(name)
    net.apply(sparsity)
    assert sparsity.sparse_params, name
    net.to("meta")
    # Until the next `rebind`, the step path's record of the tensors it hooked (which lets a
    # ``to_empty`` on the same device get the masks back) is all that is left behind.
    left = off_device(sparsity, "meta")
    assert left and all(w.startswith("algorithm.hooks._seen[") for w in left), left
    sparsity.apply(torch.optim.SGD(net.parameters(), lr=0.1))
    assert off_device(sparsity, "meta") == [], name
    for sp in sparsity.sparse_params.values():
        assert sp.mask.is_meta and all(e.is_meta for e in sparsity.ever_active.values())


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu-path", "gpu-path"])
@pytest.mark.parametrize("name", registered())
def test_move_after_training_holds_nothing_behind_after_the_next_step(
    name: str, gpu_path: bool
) -> None:
    """Trained on the CPU (updates included), moved, one more step (on the meta device): the
    old tensors are let go, the GPU path's kept multipliers (`masking.Multipliers`) included.
    ``last_update`` is the record of the update that ran, on the CPU, and is read once for
    logging; it is not state, so it stays where it was made."""
    with as_on_a_gpu() if gpu_path else contextlib.nullcontext():
        net, sparsity = model(), make(name)
        net.apply(sparsity)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # no state: steps on any device
        sparsity.apply(optimizer)
        train(net, optimizer, 5)
        assert sparsity.step == 5
        kept = [t for w, t in held_tensors(sparsity) if "_multipliers" in w]
        assert bool(kept) == gpu_path
        net.to("meta")
        train(net, optimizer, 1)
    sparsity.last_update = {}
    assert off_device(sparsity, "meta") == [], name


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
