"""Bad input raises before anything is modified, with a message naming the value, rule and fix.

"Nothing modified" is checked on the model's ``state_dict`` (keys and values) and, where the
model was dense before the failing call, by training it one step next to an untouched twin: a
stray mask, gradient hook or optimizer hook would make the two differ.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_sparse import GMP, SET, GraNet, Group, RigL, SparsityAlgorithm, Static, configure
from lightning_sparse.core.shapers import OutputGroups
from tests.helpers import full_state, mask_buffers

ALL_ALGORITHMS = ["static", "set", "rigl", "gmp", "granet"]
INIT_METHODS = ["checkerboard", "from_zeros", "random", "topk"]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return full_state(model)


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = full_state(model)
    assert list(after) == list(before), f"keys changed: {sorted(set(after) ^ set(before))}"
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} changed"


def assert_trains_like_untouched(model: nn.Module, seed: int = 0) -> None:
    """One SGD step on ``model`` and on a fresh ``mlp(seed)`` give identical parameters."""
    twin = mlp(seed)
    for m in (model, twin):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        m(x).pow(2).mean().backward()
        optimizer.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: the failed call left something behind"


def make(name: str, sparsity: object, **kwargs: object) -> SparsityAlgorithm:
    """Construct algorithm ``name`` with ``sparsity`` (GMP/GraNet need a schedule)."""
    cls = {"static": Static, "set": SET, "rigl": RigL, "gmp": GMP, "granet": GraNet}[name]
    return cls(sparsity, **kwargs)


# ---------------------------------------------------------------------------- sparsity values


@pytest.mark.parametrize(
    "value, error",
    [
        (1.2, ValueError),
        (-0.1, ValueError),
        (1.0, ValueError),
        (float("nan"), ValueError),
        ("0.5", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
    ids=["1.2", "-0.1", "1.0", "nan", "str", "bool", "none"],
)
def test_static_rejects_bad_sparsity(value: object, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        Static(sparsity=value)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(value) in message, "the message must name the value"
    assert "[0, 1)" in message, "the message must state the rule"
    assert "e.g." in message or "fraction of zeros" in message, "the message must hint the fix"


@pytest.mark.parametrize("name", ["set", "rigl", "granet"])
@pytest.mark.parametrize("value", [1.2, -0.1, "0.5", True], ids=["1.2", "-0.1", "str", "bool"])
def test_dynamic_algorithms_reject_bad_sparsity(name: str, value: object) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        make(name, value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("name", ["set", "rigl", "gmp", "granet"])
def test_schedule_at_or_above_one_at_step_0_raises_when_built(name: str) -> None:
    schedule = {"type": "linear", "init": 1.0, "slope": 0.0}
    with pytest.raises(ValueError, match=r"gives 1 at step 0.*\[0, 1\)"):
        make(name, schedule, update={"freq": 2})


@pytest.mark.parametrize("name", ["set", "rigl", "granet"])
@pytest.mark.parametrize("value", [1.5, -0.2])
def test_drop_fraction_outside_unit_interval_is_rejected(name: str, value: float) -> None:
    """drop_fraction is a share of the active weights: outside [0, 1] it means nothing."""
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        make(name, 0.5, drop_fraction=value)


# ---------------------------------------------------------------------------- names and types


@pytest.mark.parametrize("name", ALL_ALGORITHMS)
def test_unknown_init_method_lists_valid_names(name: str) -> None:
    sparsity = (
        0.5
        if name not in ("gmp", "granet")
        else {"type": "cubic", "init": 0.0, "final": 0.5, "begin": 0, "end": 4}
    )
    with pytest.raises(ValueError) as info:
        make(name, sparsity, init_method="randm")
    message = str(info.value)
    assert "'randm'" in message
    for valid in INIT_METHODS:
        assert valid in message


def test_unknown_schedule_type_lists_valid_types() -> None:
    with pytest.raises(ValueError) as info:
        GMP({"type": "cubik", "init": 0.0, "final": 0.8, "begin": 0, "end": 10})
    message = str(info.value)
    assert "'cubik'" in message
    for valid in ("constant", "cosine", "cubic", "cycling", "exp", "linear", "polynomial", "power"):
        assert valid in message


def test_unknown_update_key_and_zero_freq_are_rejected() -> None:
    with pytest.raises(ValueError, match="'frequency'"):
        SET(0.5, update={"frequency": 2})
    with pytest.raises(ValueError, match="freq must be >= 1, got 0"):
        SET(0.5, update={"freq": 0})


@pytest.mark.parametrize(
    "config",
    [{"algorithm": "rigg", "sparsity": 0.5}, {"algorithm": "rigg"}],
    ids=["with-sparsity", "bare"],
)
def test_configure_unknown_algorithm_lists_valid_names(config: dict) -> None:
    with pytest.raises(ValueError) as info:
        configure(config)
    message = str(info.value)
    assert "'rigg'" in message, message
    for valid in ALL_ALGORITHMS:
        assert valid in message


def test_bad_seed_and_filter_types() -> None:
    with pytest.raises(TypeError, match="seed='0'"):
        Static(0.5, seed="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="param_filter=42"):
        Static(0.5, param_filter=42)  # type: ignore[arg-type]


def test_rigl_rejects_both_balance_options() -> None:
    """Cerebras' balance_* shorthands live at the config boundary (they become ``shaper``)."""
    with pytest.raises(ValueError) as info:
        configure(
            {"algorithm": "rigl", "sparsity": 0.5, "balance_in_groups": 2, "balance_out_groups": 4}
        )
    message = str(info.value)
    assert "balance_in_groups=2" in message and "balance_out_groups=4" in message
    assert "mutually exclusive" in message


@pytest.mark.parametrize("sparsity", [0.8, {"type": "constant", "value": 0.8}])
def test_gmp_rejects_constant_sparsity(sparsity: object) -> None:
    with pytest.raises(ValueError) as info:
        GMP(sparsity, update={"freq": 10})
    message = str(info.value)
    assert "0.8" in message and "Static" in message and "cubic" in message


# ---------------------------------------------------------------------------- apply


def test_filter_matching_nothing_warns_and_modifies_nothing() -> None:
    model = mlp()
    before = snapshot(model)
    sparsity = Static(0.5, param_filter="encoder.*")
    with pytest.warns(UserWarning, match="param_filter"):
        model.apply(sparsity)
    assert not sparsity.sparse_params
    assert_unchanged(model, before)

    group = Group({"encoder.*": Static(0.5), "decoder.*": SET(0.5)})
    model = mlp()
    with pytest.warns(UserWarning, match="no parameter"):
        group.apply(model)
    assert not group.sparse_params
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", ALL_ALGORITHMS)
@pytest.mark.parametrize("spelling", ["model.apply", "sparsity.apply"])
def test_applying_the_same_algorithm_twice_raises_and_modifies_nothing(
    name: str, spelling: str
) -> None:
    schedule = {"type": "cubic", "init": 0.2, "final": 0.5, "begin": 0, "end": 4}
    algorithm = make(name, schedule if name in ("gmp", "granet") else 0.5)
    model = mlp()
    model.apply(algorithm)
    names = list(algorithm.sparse_params)
    before = snapshot(model)
    for target in (model, mlp(1)):  # the same model again, or a second model
        untouched = snapshot(target)
        with pytest.raises(RuntimeError, match="already applied"):
            if spelling == "model.apply":
                target.apply(algorithm)
            else:
                algorithm.apply(target)
        assert_unchanged(target, untouched)
    assert_unchanged(model, before)
    assert list(algorithm.sparse_params) == names


@pytest.mark.parametrize("make_algorithm", [lambda: Static(0.5), lambda: Group({"*": Static(0.5)})])
def test_a_wrapped_algorithm_in_model_apply_says_it_acted_on_the_first_submodule(
    make_algorithm: Callable[[], SparsityAlgorithm | Group],
) -> None:
    """``model.apply(lambda m: sparsity(m))`` calls the algorithm on every submodule: the first
    call acts on the first leaf, the next one is refused, saying why and what to write instead."""
    algorithm, model = make_algorithm(), mlp()
    with pytest.raises(RuntimeError, match=r"already applied.*submodule.*model\.apply\(sparsity\)"):
        model.apply(lambda module: algorithm(module))
    plain = Static(0.5)
    plain.apply(mlp())
    with pytest.raises(RuntimeError, match="already applied") as refused:
        plain.apply(mlp())  # a second, unrelated model: no hint about walks
    assert "submodule" not in str(refused.value)


def test_second_algorithm_on_an_already_sparse_parameter_raises_and_modifies_nothing() -> None:
    model = mlp()
    Static(0.5).apply(model)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="already has a mask"):
        Static(0.3).apply(model)
    assert_unchanged(model, before)


def test_group_member_on_an_already_sparse_parameter_modifies_nothing() -> None:
    """The conflict is with the *second* member; the first must not have been applied."""
    model = mlp()
    Static(0.5, param_filter="2.weight").apply(model)
    before = snapshot(model)
    group = Group({"0.*": Static(0.5), "2.*": Static(0.3)})
    with pytest.raises(RuntimeError, match="already has a mask"):
        group.apply(model)
    assert_unchanged(model, before)


def test_group_with_an_already_applied_member_raises() -> None:
    member = Static(0.5)
    mlp().apply(member)
    model = mlp()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="already applied"):
        Group({"*weight": member}).apply(model)
    assert_unchanged(model, before)


def wrong_shape_mask(p: torch.Tensor, sparsity: float) -> torch.Tensor:
    return torch.ones(3, dtype=torch.bool)


@pytest.mark.parametrize(
    "members",
    [
        # 2.weight has 64 elements: not divisible into 3 balanced groups.
        lambda: {"0.*": Static(0.5), "2.weight": RigL(0.5, shaper=OutputGroups(3))},
        # the second member's init method returns a mask of the wrong shape
        lambda: {"0.weight": SET(0.5), "2.weight": Static(0.5, init_method=wrong_shape_mask)},
    ],
    ids=["shaper", "init_method"],
)
def test_group_member_failing_validation_leaves_no_mask(
    members: Callable[[], dict[str, SparsityAlgorithm]],
) -> None:
    model = mlp()
    before = snapshot(model)
    group = Group(members())
    with pytest.raises(ValueError):
        model.apply(group)
    assert not mask_buffers(model)
    assert_unchanged(model, before)
    assert not group.sparse_params
    assert_trains_like_untouched(model)


def test_apply_rejects_other_types() -> None:
    sparsity = Static(0.5)
    for bad in ("string", 42, [nn.Linear(2, 2)]):
        with pytest.raises(TypeError) as info:
            sparsity.apply(bad)  # type: ignore[arg-type]
        message = str(info.value)
        assert type(bad).__name__ in message and "nn.Module" in message and "Optimizer" in message
    model = mlp()
    before = snapshot(model)
    model.apply(sparsity)  # the failures did not mark it as applied
    assert set(sparsity.sparse_params) == {"0.weight", "2.weight"}
    assert list(full_state(model)) != list(before)


def test_optimizer_before_model_raises_and_registers_nothing() -> None:
    model = mlp()
    sparsity = SET(0.5, update=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="model first"):
        sparsity.apply(optimizer)
    assert_trains_like_untouched(model)
    assert sparsity.step == 0, "the failed apply(optimizer) left a step hook behind"

    model.apply(sparsity)
    sparsity.apply(optimizer)  # the intended order works, with exactly one set of hooks
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    assert sparsity.step == 1


@pytest.mark.parametrize("foreign_only", [True, False], ids=["foreign", "mixed"])
def test_optimizer_over_foreign_parameters_raises_and_registers_nothing(foreign_only: bool) -> None:
    model, other = mlp(), mlp(1)
    sparsity = Static(0.5)
    model.apply(sparsity)
    params = list(other.parameters()) + ([] if foreign_only else list(model.parameters()))
    optimizer = torch.optim.SGD(params, lr=0.1)
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        sparsity.apply(optimizer)
    message = str(info.value)
    assert "does not own" in message and "parameters()" in message
    assert_unchanged(model, before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other(torch.randn(2, 8)).sum().backward()
        optimizer.step()
    assert sparsity.step == 0, "the failed apply(optimizer) left a step hook behind"


def test_calls_an_algorithm_cannot_answer_say_why() -> None:
    """A random mask drawn before ``apply`` has resolved ``seed=None``: an error naming the
    rule, not a None deep inside. (A drop fraction is drop-and-grow's alone: an algorithm that
    replaces no weights has none to ask for.)"""
    from lightning_sparse.core import RigL, Static

    assert not hasattr(Static(0.8), "drop_fraction") and hasattr(RigL(0.8), "drop_fraction_at")
    with pytest.raises(RuntimeError, match=r"no seed yet \(seed=None is resolved by apply"):
        RigL(0.8).initial_mask("w", torch.zeros(4, 4))


def test_a_failed_attach_leaves_the_model_and_a_restored_mask_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """All or nothing: when installing the per-step hooks fails inside ``apply``, the masks it
    registered are removed and a mask registered earlier without an algorithm (`restore_masks`
    of a checkpoint) is put back, bit for bit; nothing is pruned."""
    from lightning_sparse.core.per_step import StepHooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    restored = torch.rand(16, 16) < 0.5
    model[0].register_buffer("weight_mask", restored.clone())
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def fail(self: StepHooks, *args: object, **kwargs: object) -> None:
        raise RuntimeError("no hooks today")

    monkeypatch.setattr(StepHooks, "install", fail)
    with pytest.raises(RuntimeError, match="no hooks today"):
        Static(0.5).apply(model)
    after = model.state_dict()
    assert set(after) == set(before), set(after) ^ set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert model[0].weight_mask is not None and torch.equal(model[0].weight_mask, restored)


def test_a_layer_rounded_down_to_no_kept_weight_is_named_in_a_warning() -> None:
    """``int((1 - 0.8) * 4) = 0``: Linear(2, 2) at 0.8 keeps nothing; the warning names it (and
    only it), the apply goes on as Cerebras' rounding rule says."""
    model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 2))
    with pytest.warns(UserWarning, match=r"keeps none of the 4 weights of '1\.weight'") as caught:
        model.apply(Static(0.8))
    assert not any("'0.weight'" in str(w.message) for w in caught)
    assert int(model[1].weight_mask.sum()) == 0 and int(model[0].weight_mask.sum()) == 1
