"""Cerebras 2.0 API: configure_sparsity_wrapper and the drop-in SparsityWrapperOptimizer."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR, StepLR

from lightning_sparse.core import GMP, SET, Group, RigL, Static, configure
from lightning_sparse.core.schedules import Cycling, FreqSchedule, ListSchedule
from lightning_sparse.core.sparsity_wrapper import (
    SparsityWrapperOptimizer,
    configure_sparsity_wrapper,
)
from tests.helpers import TinyNet, assert_same_state

SPARSE = ["fc1.weight", "fc2.weight"]


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 16, (4, 9), generator=g) for _ in range(n)]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:].reshape(-1)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[torch.Tensor],
    scheduler: LRScheduler | None = None,
) -> None:
    for tokens in data:
        optimizer.zero_grad()
        loss_of(model, tokens).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def assert_sparse(sparsity: Group, level: float | dict[str, float]) -> None:
    assert sparsity.sparse_params
    for name, sp in sparsity.sparse_params.items():
        s = level if isinstance(level, float) else level[name]
        assert int(sp.mask.sum()) == int((1 - s) * sp.mask.numel()), name
        assert not sp.param[~sp.mask].any(), name


def wrapped(kind: str = "set", optimizer: str = "adamw", **kwargs: object) -> tuple:
    """(model, optimizer, wrapper): TinyNet at 0.75 sparsity, 2.0 ``schedule=2`` if dynamic."""
    torch.manual_seed(0)
    model = TinyNet()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    options = {"sparsity": 0.75, **({} if kind == "static" else {"schedule": 2}), **kwargs}
    return model, opt, configure_sparsity_wrapper(model, opt, kind, **options)


# ---------------------------------------------------------------- drop-in optimizer


def test_wrapper_shares_the_wrapped_optimizers_objects() -> None:
    model, opt, wrapper = wrapped()
    assert isinstance(wrapper, SparsityWrapperOptimizer)
    assert isinstance(wrapper, torch.optim.Optimizer)
    assert wrapper.optimizer is opt and isinstance(wrapper.sparsity, Group)
    assert wrapper.param_groups is opt.param_groups
    assert wrapper.state is opt.state and wrapper.defaults is opt.defaults
    train(model, wrapper, batches(2))
    opt.load_state_dict(opt.state_dict())  # torch rebinds state and param_groups here
    assert wrapper.param_groups is opt.param_groups and wrapper.state is opt.state
    assert "AdamW" in repr(wrapper) and "SET" in repr(wrapper)


@pytest.mark.parametrize("kind", ["static", "set", "rigl"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_pruned_weights_and_states_stay_zero(kind: str, optimizer: str) -> None:
    model, opt, wrapper = wrapped(kind, optimizer)
    assert list(wrapper.sparsity.sparse_params) == SPARSE  # the default filter
    before = {n: sp.mask.clone() for n, sp in wrapper.sparsity.sparse_params.items()}
    train(model, wrapper, batches(5))
    assert wrapper.sparsity.step == 5
    assert_sparse(wrapper.sparsity, 0.75)
    for sp in wrapper.sparsity.sparse_params.values():
        for value in opt.state[sp.param].values():
            if torch.is_tensor(value) and value.shape == sp.param.shape:
                assert not value[~sp.mask].any()
    after = wrapper.sparsity.sparse_params
    changed = any(not torch.equal(before[n], sp.mask) for n, sp in after.items())
    assert changed == (kind != "static")  # updates at steps 2 and 4


def test_step_closure_zero_grad_and_add_param_group() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if "lm_head" not in n], lr=0.1)
    wrapper = configure_sparsity_wrapper(model, opt, "static", sparsity=0.5)
    tokens = batches(1)[0]

    def closure() -> torch.Tensor:
        wrapper.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        return loss

    assert torch.is_tensor(wrapper.step(closure))
    assert model.fc1.weight.grad is not None
    wrapper.zero_grad(set_to_none=False)
    assert model.fc1.weight.grad is not None and not model.fc1.weight.grad.any()
    wrapper.zero_grad()
    assert model.fc1.weight.grad is None
    wrapper.add_param_group({"params": [model.lm_head.weight], "lr": 0.01})
    assert len(opt.param_groups) == 2 and wrapper.param_groups[1]["lr"] == 0.01
    assert wrapper.param_groups[1]["momentum"] == 0  # the wrapped optimizer's defaults filled in


def test_wrapper_step_hooks_run_around_the_sparse_step() -> None:
    model, _, wrapper = wrapped()
    seen: list[tuple[str, int]] = []
    algorithm = wrapper.sparsity
    pre = wrapper.register_step_pre_hook(lambda o, a, k: seen.append(("pre", algorithm.step)))
    wrapper.register_step_post_hook(lambda o, a, k: seen.append(("post", algorithm.step)))
    train(model, wrapper, batches(2))
    assert seen == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]
    pre.remove()
    train(model, wrapper, batches(1))
    assert seen[-1] == ("post", 3) and len(seen) == 5


def test_stepping_the_wrapped_optimizer_directly_keeps_sparsity() -> None:
    model, opt, wrapper = wrapped("rigl")
    train(model, opt, batches(3))
    assert wrapper.sparsity.step == 3
    assert_sparse(wrapper.sparsity, 0.75)


# ---------------------------------------------------------------- LR schedulers


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], LRScheduler]] = {
    "step": lambda o: StepLR(o, step_size=2, gamma=0.5),
    "onecycle": lambda o: OneCycleLR(o, max_lr=0.5, total_steps=10),
    "lambda": lambda o: LambdaLR(o, lambda epoch: 1.0 / (1 + epoch)),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_schedulers_drive_the_wrapped_optimizer(name: str) -> None:
    model, opt, wrapper = wrapped("set", "sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = SCHEDULERS[name](wrapper)
        lrs = [opt.param_groups[0]["lr"]]
        for tokens in batches(6):
            train(model, wrapper, [tokens], scheduler)
            lrs.append(opt.param_groups[0]["lr"])
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "lr_scheduler" in m], messages
    assert len(set(lrs)) > 2  # the LR really moved, on the wrapped optimizer
    # The same schedule as on a plain optimizer.
    reference_opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    reference = SCHEDULERS[name](reference_opt)
    expected = [reference_opt.param_groups[0]["lr"]]
    for _ in range(6):
        reference_opt.step()
        reference.step()
        expected.append(reference_opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(expected)
    assert_sparse(wrapper.sparsity, 0.75)


def test_scheduler_before_optimizer_step_still_warns() -> None:
    """The wrapper keeps torch's order check working rather than silencing it."""
    _, _, wrapper = wrapped("static", "sgd")
    scheduler = StepLR(wrapper, step_size=1)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)"):
        scheduler.step()


# ---------------------------------------------------------------- checkpoints


def test_state_dict_adds_sparsity_and_round_trips() -> None:
    model, opt, wrapper = wrapped()
    train(model, wrapper, batches(3))
    state = wrapper.state_dict()
    assert set(state) == {"state", "param_groups", "sparsity"}
    assert_same_state(state["sparsity"], wrapper.sparsity.state_dict())
    assert state["sparsity"]["groups"][0]["step"] == 3
    _, opt2, wrapper2 = wrapped()
    wrapper2.load_state_dict(state)
    assert "sparsity" in state  # the argument is not mutated
    assert wrapper2.sparsity.step == 3
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_dense_optimizer_state_loads_and_keeps_sparsity_state() -> None:
    model, opt, wrapper = wrapped()
    train(model, wrapper, batches(2))
    wrapper.load_state_dict(opt.state_dict())  # no "sparsity" key: as in Cerebras 2.0
    assert wrapper.sparsity.step == 2


def test_state_dict_hooks_registered_on_the_wrapper_run() -> None:
    _, _, wrapper = wrapped("static")
    calls: list[str] = []
    wrapper.register_state_dict_pre_hook(lambda o: calls.append("save"))
    wrapper.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    wrapper.register_load_state_dict_pre_hook(lambda o, sd: calls.append(sorted(sd)))
    wrapper.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    state = wrapper.state_dict()
    assert state["extra"] == 1
    wrapper.load_state_dict(state)
    assert calls == ["save", ["extra", "param_groups", "sparsity", "state"], "loaded"]


def test_resumed_run_equals_uninterrupted_run() -> None:
    data = batches(6)

    def setup() -> tuple[nn.Module, SparsityWrapperOptimizer, LRScheduler]:
        model, _, wrapper = wrapped("set", drop_fraction=0.5)
        return model, wrapper, StepLR(wrapper, step_size=2, gamma=0.5)

    model_a, wrapper_a, sched_a = setup()
    train(model_a, wrapper_a, data, sched_a)

    model_b, wrapper_b, sched_b = setup()
    train(model_b, wrapper_b, data[:3], sched_b)
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model_b.state_dict(),
            "optimizer": wrapper_b.state_dict(),
            "scheduler": sched_b.state_dict(),
        },
        buffer,
    )
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    model_c, wrapper_c, sched_c = setup()
    model_c.load_state_dict(checkpoint["model"])
    wrapper_c.load_state_dict(checkpoint["optimizer"])
    sched_c.load_state_dict(checkpoint["scheduler"])
    train(model_c, wrapper_c, data[3:], sched_c)

    assert wrapper_c.sparsity.step == wrapper_a.sparsity.step == 6
    for key, value in model_a.state_dict().items():
        assert torch.equal(value, model_c.state_dict()[key]), key
    assert wrapper_c.param_groups[0]["lr"] == wrapper_a.param_groups[0]["lr"]


# ---------------------------------------------------------------- 2.0 argument forms


def test_20_gmp_sparsity_schedule() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = configure_sparsity_wrapper(model, opt, "gmp", sparsity_schedule=[[0, 0.1], [6, 0.3]])
    gmp = wrapper.sparsity[0]
    assert type(gmp) is GMP and isinstance(gmp.sparsity, Cycling)
    assert gmp.sparsity.values == [0.1, 0.3]
    assert isinstance(gmp.update_schedule, ListSchedule) and gmp.update_schedule.steps == (0, 6)
    assert_sparse(wrapper.sparsity, 0.1)
    train(model, wrapper, batches(7))  # the step-6 update runs before the 7th optimizer step
    assert_sparse(wrapper.sparsity, 0.3)


@pytest.mark.parametrize(("schedule", "freq"), [(3, 3), (100, 100), ({"freq": 5, "stop": 50}, 5)])
def test_20_schedule_is_the_update_cadence(schedule: object, freq: int) -> None:
    _, _, wrapper = wrapped("rigl", schedule=schedule, drop_fraction=0.2)
    rigl = wrapper.sparsity[0]
    assert type(rigl) is RigL and isinstance(rigl.update_schedule, FreqSchedule)
    assert rigl.update_schedule.freq == freq and rigl.sparsity(0) == 0.75
    assert rigl.drop_fraction(0) == 0.2


def _sparsified(kind: str, **kwargs: object) -> list[str]:
    """The parameters ``configure_sparsity_wrapper(TinyNet, SGD, kind, sparsity=0.5, ...)``
    sparsifies."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = configure_sparsity_wrapper(model, optimizer, kind, sparsity=0.5, **kwargs)
    return list(wrapper.sparsity.sparse_params)


def test_20_param_name_patterns_and_filter() -> None:
    by_list = _sparsified("static", param_name_patterns=["fc2.weight", "lm_head"])
    assert by_list == ["fc2.weight", "lm_head.weight"]

    model = TinyNet()
    by_dict = configure_sparsity_wrapper(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        "set",
        sparsity=0.5,
        schedule=10,
        param_name_patterns={"fc1.weight": {"sparsity": 0.25}, r"fc\d.weight": None},
    )
    assert [type(a) for a in by_dict.sparsity] == [SET, SET]
    assert_sparse(by_dict.sparsity, {"fc1.weight": 0.25, "fc2.weight": 0.5})

    by_filter = _sparsified("static", sparse_param_filter=lambda name, p: name.startswith("lm_"))
    assert by_filter == ["lm_head.weight"]
    patterns_win = _sparsified(
        "static", param_name_patterns="fc1.weight", sparse_param_filter=lambda name, p: True
    )
    assert patterns_win == ["fc1.weight"]


def test_20_kwargs_build_the_same_algorithm_as_configure() -> None:
    _, _, wrapper = wrapped("set", drop_fraction=0.1, init_method="topk", seed=3)
    reference = configure(
        {
            "algorithm": "set",
            "sparsity": 0.75,
            "update": 2,
            "drop_fraction": 0.1,
            "init_method": "topk",
            "seed": 3,
        }
    )
    ours, theirs = wrapper.sparsity[0], reference[0]
    assert (repr(ours.update_schedule), repr(ours.drop_fraction), ours.init_method, ours.seed) == (
        repr(theirs.update_schedule),
        repr(theirs.drop_fraction),
        theirs.init_method,
        theirs.seed,
    )


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sparsity_type": "static", "sparsity": None}, ValueError, "dense"),
        ({"sparsity_type": "set", "sparsity": 0.5, "schedule": 2, "update": 2}, ValueError, "once"),
        ({"sparsity_type": "magic", "sparsity": 0.5}, ValueError, "unknown sparsity algorithm"),
        (
            {"sparsity_type": "set", "sparsity": 0.5, "drop_fractoin": 0.3},
            ValueError,
            "drop_fractoin",
        ),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        configure_sparsity_wrapper(model, opt, **kwargs)
    assert not [k for k in model.state_dict() if k.endswith("_mask")]  # nothing was modified


def test_wrapper_requires_the_sparsity_applied_to_the_optimizer() -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sparsity = Static(sparsity=0.5)
    model.apply(sparsity)
    with pytest.raises(ValueError, match="not applied"):
        SparsityWrapperOptimizer(opt, sparsity)
    sparsity.apply(opt)
    wrapper = SparsityWrapperOptimizer(opt, sparsity)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, wrapper, batches(1))
    assert sparsity.step == 1
