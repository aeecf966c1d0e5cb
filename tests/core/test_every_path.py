"""Every way a plain PyTorch loop can touch a sparse model ("Core v2" items 4, 5, 6).

Item 5, the per-step property: after EVERY optimizer step each pruned weight is exactly 0, every
optimizer state tensor of the parameter's shape is exactly 0 at pruned positions, and the
gradient the step applied is the gradient of the loss masked by the mask (scaled by the clip
coefficient where the loop clips), for Static/SET/RigL/GMP/GraNet and eleven torch.optim
optimizers, whatever the loop does between steps:

a. gradients assigned (``p.grad = g`` from ``torch.autograd.grad``) instead of backward;
b. parameters replaced (``load_state_dict(assign=True)``, ``setattr`` of a new Parameter, both
   with a new optimizer; ``to_empty`` + ``reset_parameters`` with the same one);
c. weights rewritten after apply (in place under no_grad, and through ``.data``);
d. optimizer state loaded on its own (dense);
e. the optimizer replaced mid-run (the algorithm's step keeps counting, masks keep updating);
f. gradient clipping, in the supported order: ``sparsity.update()`` before ``clip_grad_norm_``
   on update steps;
g. ``copy.deepcopy(model)`` and ``torch.save(model)`` / ``torch.load``.

Item 4: ``apply(model)`` is all or nothing (frozen, integer, reused, bad-init and 1-D cases).
Item 6: algorithm checkpoints are checked completely before anything changes; the default seed
is the experiment's, rank 0's under torch.distributed.
"""

from __future__ import annotations

import copy
import io
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_sparse import GMP, SET, GraNet, Group, RigL, SparsityAlgorithm, Static
from lightning_sparse.core import algorithms_of
from lightning_sparse.core.rng import resolve_seed
from tests.core.test_invariants import assert_pruned_state_is_zero
from tests.helpers import (  # noqa: F401  (one_thread: autouse fixture)
    assert_state_equal,
    free_port,
    full_state,
    mask_buffers,
    one_thread,
)

N_STEPS = 6
FREQ = 2  # update steps 2 and 4 (GMP/GraNet ramps end at 4, also on the cadence)
RAMP_END = 4

# ---------------------------------------------------------------------------- algorithms


def _cubic(final: float, init: float = 0.0) -> dict[str, Any]:
    return {"type": "cubic", "init": init, "final": final, "begin": 0, "end": RAMP_END}


ALGORITHMS: dict[str, Callable[[float, int], SparsityAlgorithm]] = {
    "static": lambda s, seed: Static(s, seed=seed),
    "set": lambda s, seed: SET(s, update={"freq": FREQ}, drop_fraction=0.5, seed=seed),
    "rigl": lambda s, seed: RigL(s, update={"freq": FREQ}, drop_fraction=0.5, seed=seed),
    "gmp": lambda s, seed: GMP(_cubic(s), update={"freq": FREQ}, seed=seed),
    "granet": lambda s, seed: GraNet(
        _cubic(s, s / 2), update={"freq": FREQ}, drop_fraction=0.5, seed=seed
    ),
}


def expected_last_update(name: str, t: int) -> int:
    """The last update step at or before step ``t`` (-1: none yet), from the cadence alone."""
    if name == "static":
        return -1
    done = [
        u for u in range(1, t + 1) if u % FREQ == 0 or (name in ("gmp", "granet") and u == RAMP_END)
    ]
    return done[-1] if done else -1


# ---------------------------------------------------------------------------- optimizers
# Weight decay wherever the optimizer has it: it adds the (possibly rewritten) weight to the
# gradient inside step(), which is how dense values reach the state.

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01, weight_decay=1e-2),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(
        p, lr=0.05, weight_decay=1e-2, initial_accumulator_value=0.1
    ),
    "rmsprop": lambda p: torch.optim.RMSprop(
        p, lr=0.01, momentum=0.9, centered=True, weight_decay=1e-2
    ),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01, weight_decay=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01, weight_decay=1e-2),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0, weight_decay=1e-2),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.01, weight_decay=1e-2, t0=1),
}

# ---------------------------------------------------------------------------- the run


def mlp(widths: list[int], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


@dataclass
class Run:
    """One model under one algorithm and optimizer, stepped by a path function."""

    model: nn.Sequential
    sparsity: SparsityAlgorithm
    optimizer: torch.optim.Optimizer
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    d_in: int
    scale: float = 1.0  # what the loop multiplied the gradients by (clipping)
    reference: dict[str, torch.Tensor] = field(default_factory=dict)

    def loss(self, t: int) -> torch.Tensor:
        x = torch.randn(4, self.d_in, generator=torch.Generator().manual_seed(t))
        out = self.model(x)
        target = torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 + t))
        return (out - target).pow(2).mean()

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def record_reference(self, t: int) -> None:
        """The dense gradient of this step's loss at the current weights (no hooks run)."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(self.loss(t), self.params())
        self.reference = dict(zip(names, grads, strict=True))

    def backward(self, t: int) -> None:
        self.optimizer.zero_grad()
        self.record_reference(t)
        self.loss(t).backward()

    def new_optimizer(self) -> None:
        self.optimizer = self.make_optimizer(self.params())
        self.sparsity.apply(self.optimizer)


def assert_applied_gradient(run: Run, old_masks: dict[str, torch.Tensor], when: str) -> None:
    """The gradient the step applied is the reference gradient, masked, times ``run.scale``.

    A connection grown by this step's update gets its gradient from RigL/GraNet (they read the
    dense gradient); the others may leave it 0 (the hook masked it with the old mask)."""
    masks = {n: sp.mask for n, sp in run.sparsity.sparse_params.items()}
    for name, p in run.model.named_parameters():
        if name not in run.reference:
            continue
        expected = run.reference[name] * run.scale
        if name in masks:
            mask = masks[name]
            expected = expected * mask
            assert torch.count_nonzero(p.grad[~mask]) == 0, f"{when}: {name} pruned grad"
            if not run.sparsity.needs_dense_grad:
                grown = mask & ~old_masks[name]
                zero_ok = grown & (p.grad == 0)
                expected = torch.where(zero_ok, torch.zeros_like(expected), expected)
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7, msg=f"{when}: {name}")


# ---------------------------------------------------------------------------- the paths
# Each takes the run and the step index and does one training step its way.


def plain_backward(run: Run, t: int) -> None:
    run.backward(t)
    run.optimizer.step()


def assigned_gradients(run: Run, t: int) -> None:
    """a. ``p.grad = g`` from ``torch.autograd.grad``: no backward, no gradient hook."""
    run.optimizer.zero_grad()
    run.record_reference(t)
    grads = torch.autograd.grad(run.loss(t), run.params())
    for p, g in zip(run.params(), grads, strict=True):
        p.grad = g
    run.optimizer.step()


def _dense_like(t: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(t) + 2.0  # nonzero everywhere


def load_state_dict_assign(run: Run, t: int) -> None:
    """b. ``load_state_dict(sd, assign=True)`` with dense weights, then a new optimizer: at step
    2 with the masks in ``sd`` (an earlier version's layout), at step 5 without (today's layout,
    or a dense checkpoint: the masks are kept)."""
    if t in (2, 5):
        masks = mask_buffers(run.model)
        sd = {k: _dense_like(v) for k, v in run.model.state_dict().items()}
        if t == 2:
            sd.update(masks)
        run.model.load_state_dict(sd, assign=True)
        run.new_optimizer()
        assert_pruned_state_is_zero(run.sparsity, run.optimizer, "right after assign-load")
        assert_state_equal(mask_buffers(run.model), masks)
    plain_backward(run, t)


def setattr_parameter(run: Run, t: int) -> None:
    """b. ``setattr(module, "weight", nn.Parameter(...))`` (dense), then a new optimizer."""
    if t == 2:
        for sp in run.sparsity.sparse_params.values():
            setattr(sp.module, sp.param_name, nn.Parameter(_dense_like(sp.param)))
        run.new_optimizer()
    plain_backward(run, t)


def to_empty_and_reset(run: Run, t: int) -> None:
    """b. ``to_empty`` + ``reset_parameters`` (same optimizer), then the algorithm's state
    loaded back. ``to_empty`` gives the mask buffers uninitialised memory (zeroed here, so that
    what they hold is deterministic: any content is possible); the algorithm holds the masks
    before it weakly (nothing outlives a move), so they come back from its saved state."""
    if t == 3:  # not an update step: the masks must come back exactly
        before = {n: sp.mask.clone() for n, sp in run.sparsity.sparse_params.items()}
        saved = run.sparsity.state_dict()
        run.model.to_empty(device="cpu")
        for module in run.model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for sp in run.sparsity.sparse_params.values():
            sp.mask.zero_()
        run.sparsity.load_state_dict(saved)
        plain_backward(run, t)
        for name, sp in run.sparsity.sparse_params.items():
            assert torch.equal(sp.mask, before[name]), f"{name}: mask lost by to_empty"
        return
    plain_backward(run, t)


def rewrite_weights(run: Run, t: int) -> None:
    """c. every step, weights rewritten densely: in place under no_grad, or through ``.data``."""
    for sp in run.sparsity.sparse_params.values():
        if t % 2:
            sp.param.data.copy_(_dense_like(sp.param))
        else:
            with torch.no_grad():
                sp.param.copy_(_dense_like(sp.param))
    plain_backward(run, t)


def load_optimizer_state(run: Run, t: int) -> None:
    """d. ``optimizer.load_state_dict`` with dense state (every same-shape tensor all ones)."""
    if t == 2:
        sd = run.optimizer.state_dict()
        for state in sd["state"].values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.ndim > 0:
                    state[key] = torch.ones_like(value)
        run.optimizer.load_state_dict(sd)
    plain_backward(run, t)


def replace_optimizer(run: Run, t: int) -> None:
    """e. a new optimizer applied mid-run; the old one is never stepped again."""
    if t == 3:
        run.new_optimizer()
    plain_backward(run, t)


MAX_NORM = 0.05


def clip_gradients(run: Run, t: int) -> None:
    """f. the supported order: ``update()`` (on update steps), then ``clip_grad_norm_``."""
    before = {n: sp.mask.clone() for n, sp in run.sparsity.sparse_params.items()}
    run.backward(t)
    if run.sparsity.is_update_step():
        run.sparsity.update()
    masks = {n: sp.mask for n, sp in run.sparsity.sparse_params.items()}
    if not run.sparsity.needs_dense_grad:  # connections grown now had their gradient masked
        masks = {n: m & before[n] for n, m in masks.items()}
    masked = [g * masks[n] if n in masks else g for n, g in run.reference.items()]
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in masked]))
    norm = nn.utils.clip_grad_norm_(run.params(), MAX_NORM)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0.0)
    run.scale = min(1.0, MAX_NORM / (float(norm) + 1e-6))
    run.optimizer.step()
    applied = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in run.params()]))
    assert math.isclose(float(applied), min(MAX_NORM, float(expected_norm)), rel_tol=1e-4)


PATHS: dict[str, Callable[[Run, int], None]] = {
    "backward": plain_backward,
    "assigned_grad": assigned_gradients,
    "load_assign": load_state_dict_assign,
    "setattr_param": setattr_parameter,
    "to_empty": to_empty_and_reset,
    "rewrite_weights": rewrite_weights,
    "load_optimizer_state": load_optimizer_state,
    "replace_optimizer": replace_optimizer,
    "clip_grad_norm": clip_gradients,
}


@pytest.mark.parametrize("algorithm_name", sorted(ALGORITHMS))
@pytest.mark.parametrize("path", sorted(PATHS))
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(2, 6), min_size=2, max_size=3),
    sparsity=st.floats(0.2, 0.8),
    seed=st.integers(0, 2**16),
)
def test_every_step_of_every_path_keeps_pruned_entries_zero(
    path: str, algorithm_name: str, widths: list[int], sparsity: float, seed: int
) -> None:
    for optimizer_name, make_optimizer in OPTIMIZERS.items():
        model = mlp(widths, seed)
        algorithm = ALGORITHMS[algorithm_name](sparsity, seed)
        model.apply(algorithm)
        optimizer = make_optimizer(model.parameters())
        algorithm.apply(optimizer)
        run = Run(model, algorithm, optimizer, make_optimizer, widths[0])
        assert_pruned_state_is_zero(algorithm, run.optimizer, f"{optimizer_name}: after apply")
        for t in range(N_STEPS):
            run.scale = 1.0
            old_masks = {n: sp.mask.clone() for n, sp in algorithm.sparse_params.items()}
            PATHS[path](run, t)
            when = f"{path}/{algorithm_name}/{optimizer_name}: after step {t + 1}"
            assert algorithm.step == t + 1, when
            assert algorithm.last_update_step == expected_last_update(algorithm_name, t), when
            assert_pruned_state_is_zero(algorithm, run.optimizer, when)
            assert_applied_gradient(run, old_masks, when)


def test_replaced_optimizer_keeps_the_cadence_and_the_old_one_no_longer_counts() -> None:
    """e. The step counter is the algorithm's: the new optimizer continues it and masks change
    exactly on the update steps after the replacement."""
    model = mlp([5, 8, 3], 0)
    algorithm = SET(0.6, update={"freq": 2}, drop_fraction=0.5, seed=1)
    model.apply(algorithm)
    run = Run(
        model,
        algorithm,
        torch.optim.Adam(model.parameters(), lr=0.01),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        5,
    )
    algorithm.apply(run.optimizer)
    changed_at = []
    for t in range(8):
        if t == 3:
            run.new_optimizer()
        before = {n: sp.mask.clone() for n, sp in algorithm.sparse_params.items()}
        plain_backward(run, t)
        if any(not torch.equal(before[n], sp.mask) for n, sp in algorithm.sparse_params.items()):
            changed_at.append(t)
    assert algorithm.step == 8
    assert changed_at == [2, 4, 6]


def test_clipping_before_update_is_the_unsupported_order() -> None:
    """f. Why the order matters: RigL leaves update-step gradients dense for its grow score, so
    clipping before ``update()`` measures a norm the step never applies."""
    model = mlp([5, 8, 3], 0)
    algorithm = RigL(0.7, update={"freq": 1}, drop_fraction=0.5, seed=1)
    model.apply(algorithm)
    run = Run(model, algorithm, torch.optim.SGD(model.parameters(), lr=0.05), OPTIMIZERS["adam"], 5)
    algorithm.apply(run.optimizer)
    plain_backward(run, 0)
    run.backward(1)
    norm = nn.utils.clip_grad_norm_(run.params(), MAX_NORM)  # before update(): dense
    run.optimizer.step()
    applied = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in run.params()]))
    assert float(norm) > MAX_NORM and float(applied) < MAX_NORM * 0.999


# ---------------------------------------------------------------------------- g. copies


def _copy_by_save(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("algorithm_name", sorted(ALGORITHMS))
@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
def test_copies_hold_masks_and_leave_the_original_run_unchanged(
    algorithm_name: str, how: str
) -> None:
    def train(copy_at: int | None) -> tuple[nn.Module, SparsityAlgorithm, nn.Module | None]:
        model = mlp([5, 8, 3], 0)
        algorithm = ALGORITHMS[algorithm_name](0.6, 3)
        model.apply(algorithm)
        run = Run(
            model, algorithm, torch.optim.Adam(model.parameters(), lr=0.01), OPTIMIZERS["adam"], 5
        )
        algorithm.apply(run.optimizer)
        copied = None
        for t in range(N_STEPS):
            if t == copy_at:
                copied = copy.deepcopy(model) if how == "deepcopy" else _copy_by_save(model)
                masks = mask_buffers(model)
            plain_backward(run, t)
        if copied is not None:  # the copy is a snapshot: masks of the copy time, weights pruned
            state = full_state(copied)
            assert sorted(k for k in state if k.endswith("_mask")) == sorted(masks)
            for key, mask in masks.items():
                assert torch.equal(state[key], mask), key
                assert torch.count_nonzero(state[key[: -len("_mask")]][~mask]) == 0, key
        return model, algorithm, copied

    reference, ref_algorithm, _ = train(None)
    model, algorithm, copied = train(copy_at=3)
    assert copied is not None and algorithm.step == ref_algorithm.step == N_STEPS
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), (
            f"training the original changed after a copy: {key}"
        )
    # The copy's hooks are inert: loading into it and training it leave the original alone.
    copied.load_state_dict(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(copied.state_dict()[key], value), key
    copied(torch.randn(2, 5)).sum().backward()
    torch.optim.SGD(copied.parameters(), lr=0.1).step()
    assert algorithm.step == N_STEPS
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key


# ---------------------------------------------------------------------------- item 4: apply


class WithInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)
        self.codes = nn.Parameter(torch.arange(12).reshape(3, 4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything ``apply`` may touch: state, buffers, hooks of every module and parameter."""
    return {
        "state": full_state(model),
        "buffers": sorted(n for n, _ in model.named_buffers()),
        "forward_hooks": [dict(m._forward_hooks) for m in model.modules()],
        "forward_pre_hooks": [dict(m._forward_pre_hooks) for m in model.modules()],
        "load_pre_hooks": [dict(m._load_state_dict_pre_hooks) for m in model.modules()],
        "load_post_hooks": [dict(m._load_state_dict_post_hooks) for m in model.modules()],
        "grad_hooks": [dict(p._post_accumulate_grad_hooks or {}) for p in model.parameters()],
        "applied": algorithms_of(model),
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key], value), key
    for key in before:
        if key != "state":
            assert after[key] == before[key], key


def _frozen_model() -> nn.Sequential:
    model = mlp([4, 6, 6, 3], 0)
    model[2].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("grouped", [False, True])
def test_frozen_parameter_is_left_dense_by_the_default_filter(grouped: bool) -> None:
    model = _frozen_model()
    algorithm: Any = Group({None: RigL(0.5, update={"freq": 1})}) if grouped else RigL(0.5)
    model.apply(algorithm)
    assert sorted(algorithm.sparse_params) == ["0.weight", "4.weight"]
    assert "weight_mask" not in model[2]._buffers


@pytest.mark.parametrize("cls", [Static, SET, RigL])
def test_frozen_parameter_selected_explicitly_gets_a_fixed_mask(cls: type) -> None:
    model = _frozen_model()
    initial = model[2].weight.detach().clone()
    kwargs = {} if cls is Static else {"update": {"freq": 1}, "drop_fraction": 0.5}
    algorithm = cls(0.5, param_filter="*weight", seed=0, **kwargs)
    model.apply(algorithm)
    frozen = model[2].weight
    mask = model[2].weight_mask.clone()
    assert int(mask.sum()) == 18 and torch.equal(frozen.detach(), initial * mask)
    assert not frozen._post_accumulate_grad_hooks  # no gradient hook on a frozen weight
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    algorithm.apply(optimizer)
    others = {n: sp.mask.clone() for n, sp in algorithm.sparse_params.items() if n != "2.weight"}
    run = Run(model, algorithm, optimizer, OPTIMIZERS["adam"], 4)
    for t in range(3):  # every step is an update step for SET/RigL
        plain_backward(run, t)
    assert algorithm.last_update_step == (-1 if cls is Static else 2)
    assert torch.equal(model[2].weight_mask, mask) and torch.equal(frozen.detach(), initial * mask)
    if cls is not Static:  # the trainable ones did update
        assert any(
            not torch.equal(others[n], sp.mask)
            for n, sp in algorithm.sparse_params.items()
            if n in others
        )


@pytest.mark.parametrize("grouped", [False, True])
def test_integer_parameter_selected_explicitly_is_a_type_error_and_changes_nothing(
    grouped: bool,
) -> None:
    torch.manual_seed(0)
    model = WithInt()
    before = snapshot(model)
    if grouped:
        sparsity: Any = Group({"fc*": Static(0.5), "codes": Static(0.5)})
    else:
        sparsity = Static(0.5, param_filter="*")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 1-D biases "*" also picks
        with pytest.raises(TypeError, match=r"'codes'.*torch.int64"):
            model.apply(sparsity)
    assert_unchanged(model, before)
    members = list(sparsity) if grouped else [sparsity]
    assert all(m.root is None and not m.sparse_params for m in members)


def test_group_reusing_one_algorithm_object_is_an_error_at_construction() -> None:
    shared = Static(0.5)
    with pytest.raises(RuntimeError, match="member of this Group"):
        Group({"0.*": shared, "2.*": shared})


def _wrong_shape(p: torch.Tensor, sparsity: float, **kwargs: Any) -> torch.Tensor:
    return torch.ones(p.numel(), dtype=torch.bool)


def _float_mask(p: torch.Tensor, sparsity: float, **kwargs: Any) -> torch.Tensor:
    return torch.full_like(p, 0.5)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(
    ("init", "error"),
    [(_wrong_shape, ValueError), (_float_mask, TypeError)],
    ids=["shape", "dtype"],
)
def test_bad_init_method_is_named_and_changes_nothing(
    init: Callable, error: type, grouped: bool
) -> None:
    model = mlp([4, 6, 3], 0)
    before = snapshot(model)
    bad = Static(0.5, init_method=init)
    sparsity: Any = Group({"0.*": Static(0.5), "2.*": bad}) if grouped else bad
    members = list(sparsity) if grouped else [sparsity]
    settings = [_settings(a) for a in members]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=init.__name__):
            model.apply(sparsity)
    assert_unchanged(model, before)
    for algorithm, was in zip(members, settings, strict=True):  # the algorithm is unchanged too
        assert_state_equal(_settings(algorithm), was)
    model.apply(Static(0.5, seed=None))  # and the model takes another algorithm


def _settings(algorithm: SparsityAlgorithm) -> dict[str, Any]:
    """Everything an ``apply`` may set on an algorithm before its masks exist."""
    return {
        "state": algorithm.state_dict(),
        "seed": algorithm.seed,
        "name": algorithm.name,
        "root": algorithm.root,
        "params": list(algorithm.sparse_params),
        "in_out": sorted(algorithm.in_out_params),
        "shapes": {n: list(s) for n, s in algorithm.layers.shapes.items()},
        "targets": dict(algorithm.mask_targets),
        "ever_active": dict(algorithm.ever_active),
        "version": algorithm.hooks.version,
    }


def test_one_dimensional_parameter_picked_by_a_glob_warns_naming_it() -> None:
    model = mlp([4, 6, 3], 0)
    with pytest.warns(UserWarning, match=r"1-D parameter '0\.bias'"):
        Static(0.5, param_filter="0.*").apply(model)


# ---------------------------------------------------------------------------- item 6: checkpoints


def _trained(make: Callable[[], Any], steps: int = 3) -> tuple[nn.Module, Any]:
    model = mlp([5, 8, 8, 3], 0)
    sparsity = make()
    model.apply(sparsity)
    run = Run(model, sparsity, torch.optim.Adam(model.parameters(), lr=0.01), OPTIMIZERS["adam"], 5)
    sparsity.apply(run.optimizer)
    for t in range(steps):
        plain_backward(run, t)
    return model, sparsity


def _frozen_state(model: nn.Module, sparsity: Any) -> dict[str, Any]:
    members = list(sparsity) if isinstance(sparsity, Group) else [sparsity]
    return {
        "algorithm": [(m.step, m.last_update_step, m.seed, dict(m.mask_targets)) for m in members],
        "ever_active": {n: m.clone() for n, m in sparsity.ever_active.items()},
        "masks": mask_buffers(model),
        "model": full_state(model),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["algorithm"] == b["algorithm"]
    for key in ("ever_active", "masks", "model"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key} {name}"


RIGL = dict(update={"freq": 2}, drop_fraction=0.3)
OTHER_RUNS: dict[str, Callable[[], SparsityAlgorithm]] = {
    "other_algorithm": lambda: SET(0.6, **RIGL),
    "other_params": lambda: RigL(0.6, param_filter="0.*", **RIGL),
    "other_sparsity": lambda: RigL(0.7, **RIGL),
    "other_drop_fraction": lambda: RigL(0.6, update={"freq": 2}, drop_fraction=0.5),
    "other_update": lambda: RigL(0.6, update={"freq": 3}, drop_fraction=0.3),
}


@pytest.mark.parametrize("other", sorted(OTHER_RUNS))
def test_state_of_another_run_is_a_value_error_and_changes_nothing(other: str) -> None:
    _, source = _trained(lambda: RigL(0.6, seed=1, **RIGL), steps=5)
    model, target = _trained(OTHER_RUNS[other], steps=3)
    before = _frozen_state(model, target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="checkpoint"):
            target.load_state_dict(source.state_dict())
    _assert_same(_frozen_state(model, target), before)
    assert target.step == 3


def _good_state() -> dict[str, Any]:
    return _trained(lambda: RigL(0.6, **RIGL), steps=5)[1].state_dict()


MALFORMED: dict[str, Callable[[dict[str, Any]], None]] = {
    "no_step": lambda s: s.pop("step"),
    "step_str": lambda s: s.update(step="5"),
    "step_none": lambda s: s.update(step=None),
    "last_update_str": lambda s: s.update(last_update_step="x"),
    "ever_active_shape": lambda s: s["ever_active"].update(
        {"0.weight": torch.ones(2, 2, dtype=torch.bool)}
    ),
    # the packed masks (one bit per element): refused before any mask or weight changes
    "mask_truncated": lambda s: s["masks"].update({"2.weight": s["masks"]["2.weight"][:-1]}),
    "mask_too_long": lambda s: s["masks"].update({"4.weight": torch.zeros(4, dtype=torch.uint8)}),
    "mask_dtype": lambda s: s["masks"].update({"2.weight": s["masks"]["2.weight"].int()}),
    "mask_missing": lambda s: s["masks"].pop("4.weight"),
    "mask_unknown": lambda s: s["masks"].update({"9.weight": torch.zeros(1, dtype=torch.uint8)}),
    "masks_not_a_dict": lambda s: s.update(masks=[1, 2]),
}


@pytest.mark.parametrize("defect", sorted(MALFORMED))
def test_malformed_state_is_rejected_atomically(defect: str) -> None:
    state = _good_state()
    MALFORMED[defect](state)
    model, target = _trained(lambda: RigL(0.6, **RIGL), steps=3)
    before = _frozen_state(model, target)
    with pytest.raises((KeyError, ValueError, TypeError)):
        target.load_state_dict(state)
    _assert_same(_frozen_state(model, target), before)


def _group() -> Group:
    return Group({"0.*": SET(0.5, **RIGL), "2.*": RigL(0.6, **RIGL)})


@pytest.mark.parametrize("defect", ["step_str", "ever_active_shape", "other_config", "mask"])
def test_group_with_a_bad_second_member_leaves_the_first_unchanged(defect: str) -> None:
    source_model, source = _trained(_group, steps=5)
    state = source.state_dict()
    second = state["groups"][1]
    if defect == "mask":
        second["masks"]["2.weight"] = second["masks"]["2.weight"][1:]
    elif defect == "other_config":
        second["config"]["sparsity"] = "Constant(0.9)"
    elif defect == "ever_active_shape":
        second["ever_active"]["2.weight"] = torch.ones(1, 1, dtype=torch.bool)
    else:
        second["step"] = "5"
    model, target = _trained(_group, steps=3)
    before = _frozen_state(model, target)
    with pytest.raises(ValueError):
        target.load_state_dict(state)
    _assert_same(_frozen_state(model, target), before)
    assert [m.step for m in target] == [3, 3]
    # ...and the same state, repaired, loads into both members.
    state["groups"][1] = source.state_dict()["groups"][1]
    target.load_state_dict(state)
    assert [m.step for m in target] == [5, 5]


# ---------------------------------------------------------------------------- item 6: default seed


def _masks_with_torch_seed(torch_seed: int, cls: type) -> dict[str, torch.Tensor]:
    model = mlp([6, 10, 10, 4], 0)  # identical weights in both runs
    torch.manual_seed(torch_seed)
    algorithm = cls(0.5) if cls is Static else cls(0.5, update={"freq": 1}, drop_fraction=0.5)
    model.apply(algorithm)
    run = Run(model, algorithm, torch.optim.SGD(model.parameters(), lr=0.1), OPTIMIZERS["adam"], 6)
    algorithm.apply(run.optimizer)
    for t in range(2):  # SET: regrowth draws from the seed too
        plain_backward(run, t)
    assert algorithm.seed == torch_seed
    return {n: sp.mask.clone() for n, sp in algorithm.sparse_params.items()}


@pytest.mark.parametrize("cls", [Static, SET])
@settings(max_examples=3, deadline=None)
@given(a=st.integers(0, 2**31), b=st.integers(0, 2**31))
def test_default_seed_is_the_experiments_torch_seed(cls: type, a: int, b: int) -> None:
    first, again = _masks_with_torch_seed(a, cls), _masks_with_torch_seed(a, cls)
    assert all(torch.equal(first[n], again[n]) for n in first)
    if a != b:
        other = _masks_with_torch_seed(b, cls)
        assert any(not torch.equal(first[n], other[n]) for n in first)


def _seed_worker(rank: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = mlp([6, 10, 4], 0)
        torch.manual_seed(100 + rank)  # the ranks are seeded differently
        seeded = torch.initial_seed()
        algorithm = Static(0.5)
        model.apply(algorithm)
        masks = {n: sp.mask.clone() for n, sp in algorithm.sparse_params.items()}
        torch.save(
            {
                "initial_seed": seeded,
                "resolved": resolve_seed(None),
                "seed": algorithm.seed,
                "masks": masks,
            },
            Path(outdir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_ranks_seeded_differently_agree_on_masks_under_torch_distributed(tmp_path: Path) -> None:
    mp.spawn(_seed_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert (r0["initial_seed"], r1["initial_seed"]) == (100, 101)
    assert r0["seed"] == r1["seed"] == r0["resolved"] == r1["resolved"] == 100
    assert r0["masks"].keys() == r1["masks"].keys() and r0["masks"]
    for name in r0["masks"]:
        assert torch.equal(r0["masks"][name], r1["masks"][name]), name
    # Without the broadcast rank 1 would have drawn from seed 101: a different mask.
    model = mlp([6, 10, 4], 0)
    own = Static(0.5, seed=101)
    model.apply(own)
    assert any(not torch.equal(sp.mask, r1["masks"][n]) for n, sp in own.sparse_params.items())


def _gmp_group() -> Group:
    return Group({"0.*": GMP(_cubic(0.6), update={"freq": 2}), "2.*": RigL(0.6, **RIGL)})


def test_group_rejection_restores_a_member_that_had_not_updated_yet() -> None:
    """The first member (GMP, no update yet: its masks are for the step-0 target) must keep the
    target its masks were built for when the second member's state is bad."""
    _, source = _trained(_gmp_group, steps=5)
    state = source.state_dict()
    state["groups"][1]["step"] = "5"
    model, target = _trained(_gmp_group, steps=1)
    assert target[0].last_update_step == -1 and target[0].mask_target("0.weight") == 0.0
    before = _frozen_state(model, target)
    with pytest.raises(ValueError):
        target.load_state_dict(state)
    _assert_same(_frozen_state(model, target), before)


def test_malformed_mask_targets_of_an_old_state_are_rejected_atomically() -> None:
    model, target = _trained(lambda: RigL(0.6, **RIGL), steps=1)
    before = _frozen_state(model, target)
    with pytest.raises(ValueError, match="mask_targets"):
        target.load_state_dict({"step": 7, "mask_targets": {"0.weight": "x"}})
    _assert_same(_frozen_state(model, target), before)


def test_a_swapped_out_optimizer_is_not_kept_alive_and_the_new_one_drives_the_step() -> None:
    """Plain-loop optimizer swap: the algorithm holds optimizers weakly."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    sparsity = RigL(0.5, update={"freq": 2})
    model.apply(sparsity)
    old = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sparsity.apply(old)
    x = torch.randn(4, 8)
    model(x).square().mean().backward()
    old.step()
    old.zero_grad()
    dropped = weakref.ref(old)
    new = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sparsity.apply(new)
    del old
    gc.collect()
    assert dropped() is None  # not kept alive (with its Adam state) by the algorithm
    assert sparsity.optimizers == [new]
    for _ in range(3):
        model(x).square().mean().backward()
        new.step()
        new.zero_grad()
    assert sparsity.step == 4
    for sp in sparsity.sparse_params.values():
        assert not sp.param.detach()[~sp.mask].any()
