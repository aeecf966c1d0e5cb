"""Property-based invariants of the per-step path (plain PyTorch usage).

After every optimizer step, for random small models, algorithms and optimizers:
- every pruned weight is exactly 0, and so is its gradient;
- every optimizer state tensor of the parameter's shape is exactly 0 at pruned positions;
- each mask keeps ``int((1 - s) * n)`` entries, ``s`` the target at the last update step
  (recomputed here from the documented schedule formulas, not read from the algorithm).

Also: ``model.apply(sparsity)`` equals ``sparsity.apply(model)``; a tied parameter is sparsified
once; sparsity 0 trains bit for bit like dense; ``autoupdate=False`` changes masks only on
``update()``; regrown connections start at weight 0 with zero optimizer state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_sparse import GMP, SET, GraNet, Group, RigL, SparsityAlgorithm, Static
from tests.helpers import mask_buffers, one_thread  # noqa: F401  (autouse fixture)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
N_STEPS = 6


# ---------------------------------------------------------------------------- optimizers


class DenseNudge(torch.optim.Optimizer):
    """An optimizer whose update is dense even where the gradient is 0, with lazily made state.

    Exercises the post-step guard (weights re-pruned after every step) and the pruning of state
    that an optimizer creates inside its first ``step``.
    """

    def __init__(self, params: list[nn.Parameter], lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "trace" not in state:
                    state["trace"] = torch.ones_like(p)
                p.add_(group["lr"]).add_(state["trace"], alpha=group["lr"])
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd_nesterov_wd": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2
    ),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
    "sgd_foreach_dampening": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.5, dampening=0.3, weight_decay=1e-2, foreach=True, maximize=True
    ),
    # A nonzero initial accumulator creates dense state eagerly, before the first step.
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(
        p, lr=0.01, centered=True, momentum=0.9
    ),
    "dense_update": lambda p: DenseNudge(p, lr=0.01),
}

# ---------------------------------------------------------------------------- models


class EmbedMLP(nn.Module):
    """Embedding + Linear stack over token ids."""

    def __init__(self, vocab: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.embed(idx))))


@dataclass
class Case:
    """A model, a batch generator and the parameter filter to sparsify with."""

    model: nn.Module
    batch: Callable[[int], torch.Tensor]
    loss: Callable[[torch.Tensor, int], torch.Tensor]
    param_filter: str | None


def _mse_loss(out: torch.Tensor, step: int) -> torch.Tensor:
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 + step))
    return (out - target).pow(2).mean()


@st.composite
def cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["mlp", "conv", "embed"]))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    if kind == "mlp":
        widths = draw(st.lists(st.integers(2, 12), min_size=2, max_size=4))
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(a, b), nn.Tanh()]
        model = nn.Sequential(*layers[:-1])
        d_in = widths[0]

        def batch(step: int) -> torch.Tensor:
            return torch.randn(4, d_in, generator=torch.Generator().manual_seed(step))

        return Case(model, batch, _mse_loss, draw(st.sampled_from([None, "*"])))
    if kind == "conv":
        c_in, c_out, k = draw(st.integers(1, 3)), draw(st.integers(2, 5)), draw(st.integers(1, 3))
        side = 5
        model = nn.Sequential(
            nn.Conv2d(c_in, c_out, k),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(c_out * (side - k + 1) ** 2, 3),
        )

        def batch(step: int) -> torch.Tensor:
            return torch.randn(2, c_in, side, side, generator=torch.Generator().manual_seed(step))

        return Case(model, batch, _mse_loss, None)
    vocab, dim, hidden = draw(st.integers(3, 10)), draw(st.integers(2, 8)), draw(st.integers(2, 8))
    model = EmbedMLP(vocab, dim, hidden)

    def tokens(step: int) -> torch.Tensor:
        return torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(step))

    def ce(out: torch.Tensor, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        target = torch.randint(0, vocab, out.shape[:-1], generator=g)
        return nn.functional.cross_entropy(out.reshape(-1, vocab), target.reshape(-1))

    # "*weight" also sparsifies the embedding, which the default filter keeps dense.
    return Case(model, tokens, ce, draw(st.sampled_from([None, "*weight"])))


# ---------------------------------------------------------------------------- algorithms


def cubic(init: float, final: float, begin: int, end: int) -> Callable[[int], float]:
    """Reference cubic ramp (Zhu & Gupta 2017), written from the documented formula."""

    def value(t: int) -> float:
        if t <= begin:
            return init
        if t >= end:
            return final
        return final + (init - final) * (1.0 - (t - begin) / (end - begin)) ** 3

    return value


@dataclass
class AlgoSpec:
    """An algorithm plus the independent expectations the test checks it against."""

    algorithm: SparsityAlgorithm
    target: Callable[[int], float]  # step -> sparsity
    is_update: Callable[[int], bool]  # step -> update at this step (dynamic only)


@st.composite
def algo_specs(draw: st.DrawFn, name: str, param_filter: str | None) -> AlgoSpec:
    s = draw(st.floats(0.0, 0.95))
    init_method = draw(st.sampled_from(["random", "topk", "checkerboard"]))
    seed = draw(st.integers(0, 1000))
    freq = draw(st.integers(1, 3))
    common = dict(init_method=init_method, param_filter=param_filter, seed=seed)
    every = {"freq": freq}

    def on_freq(t: int) -> bool:
        return t % freq == 0

    if name == "static":
        return AlgoSpec(Static(s, **common), lambda t: s, lambda t: False)
    drop = draw(st.floats(0.0, 1.0))
    if name == "set":
        return AlgoSpec(SET(s, update=every, drop_fraction=drop, **common), lambda t: s, on_freq)
    if name == "rigl":
        return AlgoSpec(RigL(s, update=every, drop_fraction=drop, **common), lambda t: s, on_freq)
    init = draw(st.floats(0.0, s)) if name == "granet" else 0.0
    end = draw(st.integers(1, N_STEPS))
    schedule = {"type": "cubic", "init": init, "final": s, "begin": 0, "end": end}

    def on_freq_or_end(t: int) -> bool:  # GMP/GraNet also update at the ramp's end
        return t % freq == 0 or t == end

    if name == "gmp":
        return AlgoSpec(
            GMP(schedule, update=every, **common), cubic(init, s, 0, end), on_freq_or_end
        )
    algorithm = GraNet(schedule, update=every, drop_fraction=drop, **common)
    return AlgoSpec(algorithm, cubic(init, s, 0, end), on_freq_or_end)


# ---------------------------------------------------------------------------- checks


def assert_pruned_state_is_zero(
    sparsity: SparsityAlgorithm, optimizer: torch.optim.Optimizer, when: str
) -> None:
    """Weights, gradients and same-shape optimizer states are exactly 0 where the mask is False."""
    assert sparsity.sparse_params, "nothing was sparsified: the test would check nothing"
    for name, sp in sparsity.sparse_params.items():
        mask = sp.mask
        assert mask.dtype == torch.bool and mask.shape == sp.param.shape
        pruned = ~mask
        assert torch.count_nonzero(sp.param.detach()[pruned]) == 0, f"{when}: {name} weight"
        if sp.param.grad is not None:
            assert torch.count_nonzero(sp.param.grad[pruned]) == 0, f"{when}: {name} grad"
        for key, value in optimizer.state.get(sp.param, {}).items():
            if torch.is_tensor(value) and value.shape == sp.param.shape:
                bad = torch.count_nonzero(value[pruned])
                assert bad == 0, f"{when}: {name} optimizer state {key!r}: {bad} nonzero pruned"


def assert_counts(sparsity: SparsityAlgorithm, target: float, when: str) -> None:
    for name, sp in sparsity.sparse_params.items():
        n = sp.mask.numel()
        expected = int((1 - target) * n)
        assert int(sp.mask.sum()) == expected, f"{when}: {name} keeps {int(sp.mask.sum())}"


# ---------------------------------------------------------------------------- the property


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("algorithm_name", ["static", "set", "rigl", "gmp", "granet"])
@SETTINGS
@given(data=st.data())
def test_every_step_keeps_pruned_weights_and_states_zero_and_counts_exact(
    optimizer_name: str, algorithm_name: str, data: st.DataObject
) -> None:
    case = data.draw(cases(), label="case")
    spec = data.draw(algo_specs(algorithm_name, case.param_filter), label="algorithm")
    model, sparsity = case.model, spec.algorithm

    model.apply(sparsity)  # the Cerebras spelling; acts once, on the root
    optimizer = OPTIMIZERS[optimizer_name](list(model.parameters()))
    sparsity.apply(optimizer)
    last_update = 0  # dynamic algorithms start sparse: step 0 is on every freq cadence
    assert_counts(sparsity, spec.target(last_update), "after apply")
    assert_pruned_state_is_zero(sparsity, optimizer, "after apply")

    for t in range(N_STEPS):
        assert sparsity.step == t
        optimizer.zero_grad()
        case.loss(model(case.batch(t)), t).backward()
        if t > 0 and spec.is_update(t):
            last_update = t
        optimizer.step()
        when = f"after step {t + 1} ({sparsity!r})"
        assert sparsity.step == t + 1
        assert_pruned_state_is_zero(sparsity, optimizer, when)
        assert_counts(sparsity, spec.target(last_update), when)


# ---------------------------------------------------------------------------- apply spellings


def nested_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 10)), nn.ReLU(), nn.Linear(10, 3)
    )


def make_static() -> SparsityAlgorithm:
    return Static(0.6, seed=3)


def make_set() -> SparsityAlgorithm:
    return SET(0.7, update={"freq": 2}, seed=5)


def make_group() -> SparsityAlgorithm:
    return Group({"0.*": Static(0.5, seed=1), "2.weight": RigL(0.8, seed=2)})


@pytest.mark.parametrize("make", [make_static, make_set, make_group])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_model_apply_equals_sparsity_apply(
    make: Callable[[], SparsityAlgorithm], seed: int
) -> None:
    a_model, b_model = nested_model(seed), nested_model(seed)
    a, b = make(), make()
    a_model.apply(a)
    b.apply(b_model)
    assert list(a.sparse_params) == list(b.sparse_params)
    a_state, b_state = a_model.state_dict(), b_model.state_dict()
    assert a_state.keys() == b_state.keys()
    for key in a_state:
        assert torch.equal(a_state[key], b_state[key]), key
    # Filters saw full dotted names from the root, not names relative to a child module.
    names = set(a.sparse_params)
    if make is make_group:
        assert names == {"0.0.weight", "0.0.bias", "0.2.weight", "0.2.bias", "2.weight"}
    else:
        assert names == {"0.0.weight", "0.2.weight", "2.weight"}


def test_group_glob_sees_full_names_under_model_apply() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    group = Group({"0.*": Static(0.5)})
    model.apply(group)
    assert set(group.sparse_params) == {"0.weight", "0.bias"}
    assert sorted(mask_buffers(model)) == ["0.bias_mask", "0.weight_mask"]
    assert int(model[0].weight_mask.sum()) == int(0.5 * 32)


def test_calling_the_sparsity_directly_or_in_a_nested_walk_acts_once_on_its_model() -> None:
    """``sparsity(model)`` is ``sparsity.apply(model)``; ``model.apply(sparsity)`` run from inside
    another ``model.apply`` walk acts on its own model, with names from it, once."""
    direct, reference = nested_model(0), nested_model(0)
    called, applied = make_static(), make_static()
    called(direct)
    applied.apply(reference)
    assert (
        list(called.sparse_params)
        == list(applied.sparse_params)
        == [
            "0.0.weight",
            "0.2.weight",
            "2.weight",
        ]
    )
    assert called.root is direct
    outer = nested_model(1)
    inner = make_static()
    visits: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        visits.append(module)
        if module is outer[0]:
            module.apply(inner)  # a walk over the inner Sequential, inside the outer walk

    outer.apply(visit)
    assert len(visits) == 7 and inner.root is outer[0]  # 3 + 1 inner, 2 + 1 outer
    assert list(inner.sparse_params) == ["0.weight", "2.weight"]
    assert sorted(mask_buffers(outer)) == ["0.0.weight_mask", "0.2.weight_mask"]


class OwnApply(nn.Sequential):
    """A container whose ``apply`` is its own (logging, a library's wrapper) and calls
    ``super().apply(fn)``."""

    def apply(self, fn: Callable[[nn.Module], None]) -> OwnApply:  # type: ignore[override]
        return super().apply(fn)


@pytest.mark.parametrize("make", [make_static, make_group])
def test_model_apply_through_a_submodule_that_overrides_apply_acts_once_on_the_model(
    make: Callable[[], SparsityAlgorithm],
) -> None:
    """A submodule's own ``apply`` (calling ``super().apply``) is part of the walk: only the
    model's call acts, with full names, as ``sparsity.apply(model)`` does (it once acted on that
    submodule first, then raised 'already applied', a half-sparsified model left behind)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            OwnApply(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 8)
        )

    walked, reference = build(), build()
    a, b = make(), make()
    walked.apply(a)
    b.apply(reference)
    assert a.root is walked
    assert list(a.sparse_params) == list(b.sparse_params)
    assert "2.weight" in a.sparse_params and "0.0.weight" in a.sparse_params
    for key, value in reference.state_dict().items():
        assert torch.equal(walked.state_dict()[key], value), key
    # The overriding module as the model itself: its own call acts.
    alone, own = OwnApply(nn.Linear(8, 8), nn.Linear(8, 8)), make_static()
    alone.apply(own)
    assert own.root is alone and list(own.sparse_params) == ["0.weight", "1.weight"]


# ---------------------------------------------------------------------------- tied weights


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 12, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.body(self.embed(idx))))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Static(0.5, param_filter="*weight"),
        lambda: RigL(0.5, update=None, param_filter="*weight"),
    ],
)
def test_tied_parameter_is_sparsified_once(make: Callable[[], SparsityAlgorithm]) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    sparsity = make()
    model.apply(sparsity)
    tied = model.embed.weight
    entries = [n for n, sp in sparsity.sparse_params.items() if sp.param is tied]
    assert len(entries) == 1
    assert sorted(sparsity.sparse_params) == ["body.weight", "embed.weight"]
    assert sorted(mask_buffers(model)) == ["body.weight_mask", "embed.weight_mask"]
    assert "weight_mask" not in model.lm_head._buffers
    assert int(model.embed.weight_mask.sum()) == int(0.5 * tied.numel())

    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    sparsity.apply(optimizer)
    for t in range(4):
        optimizer.zero_grad()
        idx = torch.randint(0, 12, (3, 4), generator=torch.Generator().manual_seed(t))
        target = torch.randint(0, 12, (3, 4), generator=torch.Generator().manual_seed(t + 50))
        logits = model(idx)
        nn.functional.cross_entropy(logits.reshape(-1, 12), target.reshape(-1)).backward()
        optimizer.step()
        assert model.lm_head.weight is model.embed.weight
        assert_pruned_state_is_zero(sparsity, optimizer, f"tied, step {t + 1}")
        assert_counts(sparsity, 0.5, f"tied, step {t + 1}")


# ---------------------------------------------------------------------------- sparsity 0 == dense


def _train(model: nn.Module, sparsity: SparsityAlgorithm | None, steps: int = 5) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    if sparsity is not None:
        model.apply(sparsity)
        sparsity.apply(optimizer)
    for t in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
        _mse_loss(model(x), t).backward()
        optimizer.step()


@pytest.mark.parametrize(
    "make",
    [lambda: Static(0.0), lambda: SET(0.0, update=None), lambda: RigL(0.0, update=None)],
    ids=["static", "set", "rigl"],
)
def test_zero_sparsity_trains_bit_for_bit_like_dense(make: Callable[[], SparsityAlgorithm]) -> None:
    dense = nested_model(7)
    sparse = copy.deepcopy(dense)
    _train(dense, None)
    sparsity = make()
    _train(sparse, sparsity)
    assert sparsity.sparse_params and sparsity.step == 5
    dense_params = dict(dense.named_parameters())
    for name, p in sparse.named_parameters():
        assert torch.equal(p, dense_params[name]), name
    # ...and training moved the weights (so equality is not trivially of untouched tensors).
    assert not torch.equal(dense[2].weight, nested_model(7)[2].weight)


# ---------------------------------------------------------------------------- autoupdate / regrowth


def _masks(sparsity: SparsityAlgorithm) -> dict[str, torch.Tensor]:
    return {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}


def _backward(model: nn.Module, t: int) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
    _mse_loss(model(x), t).backward()


@pytest.mark.parametrize("cls", [SET, RigL])
def test_autoupdate_false_changes_masks_only_when_update_is_called(cls: type) -> None:
    model = nested_model(0)
    sparsity = cls(0.6, update=None, drop_fraction=0.5)  # every step is an update step
    model.apply(sparsity)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    sparsity.apply(optimizer)
    sparsity.autoupdate = False
    initial = _masks(sparsity)
    for t in range(3):
        optimizer.zero_grad()
        _backward(model, t)
        optimizer.step()
        assert sparsity.step == t + 1
        for name, mask in _masks(sparsity).items():
            assert torch.equal(mask, initial[name]), f"mask {name} changed without update()"
        # Skipping update() on an update step must not leak dense gradients into the state.
        assert_pruned_state_is_zero(sparsity, optimizer, f"no update, step {t + 1}")
    optimizer.zero_grad()
    _backward(model, 3)
    sparsity.update(optimizer)
    changed = [n for n, m in _masks(sparsity).items() if not torch.equal(m, initial[n])]
    assert changed, "update() on an update step changed no mask"
    optimizer.step()
    assert_pruned_state_is_zero(sparsity, optimizer, "after manual update")
    assert_counts(sparsity, 0.6, "after manual update")


@pytest.mark.parametrize("cls", [SET, RigL, GraNet])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_regrown_connections_start_at_zero_weight_and_state(cls: type, optimizer_name: str) -> None:
    model = nested_model(1)
    sparsity = cls(0.7, update={"freq": 2}, drop_fraction=0.5)
    model.apply(sparsity)
    optimizer = OPTIMIZERS[optimizer_name](list(model.parameters()))
    sparsity.apply(optimizer)
    sparsity.autoupdate = False
    grown_total = 0
    for t in range(6):
        optimizer.zero_grad()
        _backward(model, t)
        before = _masks(sparsity)
        sparsity.update(optimizer)
        for name, sp in sparsity.sparse_params.items():
            grown = sp.mask & ~before[name]
            grown_total += int(grown.sum())
            assert torch.count_nonzero(sp.param.detach()[grown]) == 0, f"{name} grown weight"
            for key, value in optimizer.state.get(sp.param, {}).items():
                if torch.is_tensor(value) and value.shape == sp.param.shape:
                    assert torch.count_nonzero(value[grown]) == 0, f"{name} grown state {key}"
            # Dropped connections are zero as soon as the mask changes.
            dropped = before[name] & ~sp.mask
            assert torch.count_nonzero(sp.param.detach()[dropped]) == 0, f"{name} dropped"
        optimizer.step()
        assert_pruned_state_is_zero(sparsity, optimizer, f"regrowth, step {t + 1}")
        assert_counts(sparsity, 0.7, f"regrowth, step {t + 1}")
    assert grown_total > 0, "no connection was ever regrown: the test checked nothing"


# ------------------------------------------------------- the post-step re-prune and its skip


class SGDSubclass(torch.optim.SGD):
    """A subclass may change the update, so it never counts as zero-keeping."""


def test_state_keeps_zero_only_for_exact_known_optimizers() -> None:
    """Optimizers outside the table (Adamax, Rprop, subclasses) get state re-pruned each step."""
    from lightning_sparse.core.per_step import state_keeps_zero

    params = [nn.Parameter(torch.zeros(2, 2))]
    assert state_keeps_zero(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True))
    assert state_keeps_zero(torch.optim.AdamW(params, fused=True))
    assert state_keeps_zero(torch.optim.RMSprop(params))
    assert not state_keeps_zero(torch.optim.Adamax(params))
    assert not state_keeps_zero(torch.optim.Rprop(params))
    assert not state_keeps_zero(SGDSubclass(params, lr=0.1))


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: SGDSubclass(p, lr=0.1),
        lambda p: DenseNudge(p, lr=0.01),
    ],
)
def test_weights_written_through_data_are_zero_after_the_step(
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> None:
    """Whatever wrote a weight (here ``.data``, invisible to version counters), every
    optimizer's step leaves pruned weights at exactly 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    sparsity = Static(0.75)
    model.apply(sparsity)
    optimizer = make(list(model.parameters()))
    sparsity.apply(optimizer)
    for _ in range(4):
        model[0].weight.data.normal_()  # rewritten after apply, dense
        model(torch.randn(5, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        for sp in sparsity.sparse_params.values():
            assert torch.count_nonzero(sp.param.detach()[~sp.mask]) == 0, sp.name


@pytest.mark.parametrize("name", ["Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta"])
def test_eps_zero_never_leaves_nan_at_pruned_positions(name: str) -> None:
    """With ``eps=0`` these compute 0 / 0 at pruned positions: the weights are re-pruned."""
    from lightning_sparse.core.per_step import state_keeps_zero

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    sparsity = Static(0.75, seed=0)
    model.apply(sparsity)
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.01, eps=0.0)
    assert not state_keeps_zero(optimizer)
    sparsity.apply(optimizer)
    for _ in range(3):
        model(torch.randn(5, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        for sp in sparsity.sparse_params.values():
            pruned = sp.param.detach()[~sp.mask]
            assert torch.count_nonzero(pruned) == 0 and not pruned.isnan().any(), sp.name


def test_backward_twice_through_a_retained_graph() -> None:
    """The gradient hook prunes the weight through ``.data``: a retained graph stays usable."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    sparsity = Static(0.5, seed=0)
    model.apply(sparsity)
    loss = model(torch.randn(5, 8)).square().sum()
    loss.backward(retain_graph=True)
    first = {n: sp.param.grad.clone() for n, sp in sparsity.sparse_params.items()}
    loss.backward()
    for name, sp in sparsity.sparse_params.items():
        torch.testing.assert_close(sp.param.grad, 2 * first[name])
        assert torch.count_nonzero(sp.param.grad[~sp.mask]) == 0
