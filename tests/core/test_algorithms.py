"""Update rules of every algorithm: hand-computed cases, a reference implementation, contracts.

1. Hand-computed masks for GMP, SET, RigL and GraNet on 1x8 / 2x4 weights.
2. RigL and GMP against an independent reference written from the RigL paper (Evci et al. 2020,
   arXiv:1911.11134, Algorithm 1) and Cerebras' formulas (reference/cerebras_api.md §4), with a
   plain Python sort and the lower-index tie rule, on random inputs.
3. Contracts over every registered algorithm (a new algorithm must be added to ``CONTRACT``):
   pruned weights and Adam states are 0, the target count is met after every update, a resumed
   run equals an uninterrupted one, two runs are identical.
4. Gradient accumulation gives RigL the same dense gradient as one big batch (plain and Lightning).
5. Shapers (balanced groups, N:M, blocks) and distributions (ERK, global) inside algorithms.
6. Observability: update hooks, the ITOP rate, Lightning metrics.
7. A user-defined algorithm in a few lines, as a callback and through ``configure``.

Semantics used throughout: with ``update={"freq": f}`` masks change in ``update()`` when
``step > 0 and step % f == 0``; as in Cerebras, ``int((1 - drop_fraction) * active)`` of a
row's active weights survive the drop and the row regrows to ``n_target = int((1 - s) * n)``.
"""

from __future__ import annotations

import copy
import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import (
    GMP,
    SET,
    DropAndGrow,
    DynamicSparsityAlgorithm,
    GraNet,
    RigL,
    SparsityAlgorithm,
    Static,
    configure,
    core,
)
from lightning_sparse.core.configure import available_algorithms
from lightning_sparse.core.rng import generator_for
from lightning_sparse.core.shapers import NM, Blocks, OutputGroups
from tests.helpers import (  # one_thread: autouse fixture
    TinyLM,
    TinyNet,
    assert_state_equal,
    one_thread,  # noqa: F401
    token_loader,
    trainer,
)

# ============================================================================ helpers


class OneWeight(nn.Module):
    """A module holding one weight, so a hand case controls every value."""

    def __init__(self, weight: list[list[float]]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(weight, dtype=torch.float64))


def as_mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def fixed_mask(mask: torch.Tensor) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """An ``init_method`` returning ``mask`` whatever the sparsity (the hand case's start)."""
    return lambda p, sparsity: mask.clone()


def hand_update(
    algorithm: DynamicSparsityAlgorithm,
    weight: list[list[float]],
    step: int,
    grad: list[list[float]] | None = None,
) -> OneWeight:
    """Apply ``algorithm`` to one weight, then run ``update()`` at ``step`` with ``grad`` set."""
    model = OneWeight(weight)
    model.apply(algorithm)
    algorithm.autoupdate = False
    algorithm.step = step
    if grad is not None:
        model.weight.grad = torch.tensor(grad, dtype=torch.float64)
    algorithm.update()
    return model


def masks_of(sparsity: SparsityAlgorithm) -> dict[str, torch.Tensor]:
    return {name: sp.mask.clone() for name, sp in sparsity.sparse_params.items()}


# The weight and mask shared by the SET / RigL hand cases: 5 of 8 active, target s = 0.375
# (n_target = int(0.625 * 8) = 5), drop_fraction 0.4 (5 - int(0.6 * 5) = 2 dropped). The two
# smallest active |w| are at index 1 (0.1) and 4 (0.3), so {0, 2, 7} survive the drop.
W8 = [[0.9, -0.1, 0.5, 0.0, 0.3, 0.0, 0.0, -0.7]]
M8 = as_mask([[1, 1, 1, 0, 1, 0, 0, 1]])
SURVIVORS = {0, 2, 7}


def flat_set(mask: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask.reshape(-1)).reshape(-1).tolist())


# ============================================================================ 1. hand cases


def test_gmp_keeps_top_magnitudes_at_each_scheduled_sparsity() -> None:
    w = [[0.1, -0.8, 0.3, 0.05, -0.6, 0.2, 0.7, -0.4]]
    gmp = GMP({"type": "linear", "init": 0.0, "slope": 0.125}, update={"freq": 2}, seed=3)
    model = OneWeight(w)
    model.apply(gmp)
    gmp.autoupdate = False
    assert flat_set(model.weight_mask) == set(range(8))  # s(0) = 0: dense start
    # s(t) = t / 8: keep int((1 - t/8) * 8) of the largest |w| = 0.8, 0.7, 0.6, 0.4, 0.3, 0.2.
    expected = {2: {1, 6, 4, 7, 2, 5}, 4: {1, 6, 4, 7}, 6: {1, 6}}
    for step, kept in expected.items():
        gmp.step = step
        gmp.update()
        assert flat_set(model.weight_mask) == kept, f"step {step}"
        assert gmp.mask_target("weight") == step / 8
        original = torch.tensor(w, dtype=torch.float64)
        assert torch.equal(model.weight.detach(), torch.where(model.weight_mask, original, 0))


def test_gmp_shaper_ranks_each_row_separately() -> None:
    w = [[0.1, -0.8, 0.3, 0.05], [-0.6, 0.2, 0.7, -0.4]]
    schedule = {"type": "linear", "init": 0.0, "slope": 0.125}
    rows = hand_update(GMP(schedule, update={"freq": 4}, shaper=OutputGroups(2)), w, step=4)
    assert torch.equal(rows.weight_mask, as_mask([[0, 1, 1, 0], [1, 0, 1, 0]]))
    # Unstructured: the global top 4 (0.8, 0.7, 0.6, 0.4) leave row 0 a single weight.
    flat = hand_update(GMP(schedule, update={"freq": 4}), w, step=4)
    assert torch.equal(flat.weight_mask, as_mask([[0, 1, 0, 0], [1, 0, 1, 1]]))


def test_set_drops_smallest_active_and_regrows_from_its_random_stream() -> None:
    seed, step = 7, 3
    algorithm = SET(
        0.375, update={"freq": 3}, drop_fraction=0.4, seed=seed, init_method=fixed_mask(M8)
    )
    model = hand_update(algorithm, W8, step)
    new = flat_set(model.weight_mask)
    assert len(new) == 5
    assert SURVIVORS <= new  # the 3 largest |w| stay; indices 1 and 4 were the drop candidates
    grown = new - SURVIVORS
    assert len(grown) == 2 and grown <= {1, 3, 4, 5, 6}  # inactive or just dropped
    # Exactly: the top 2 of U(0, 1) scores from the (seed, step, name) stream among the rest.
    scores = torch.rand((1, 8), generator=generator_for(seed, step, "weight", torch.device("cpu")))
    candidates = sorted({1, 3, 4, 5, 6}, key=lambda i: (-float(scores[0, i]), i))
    assert grown == set(candidates[:2])


def test_set_on_a_long_row_grows_the_top_of_its_uniform_scores() -> None:
    # 128 x 256 = 32768 weights: one long CPU row (the sampled top-k), where SET's grow score is
    # the same tensor as on any row: U(0, 1) from the (seed, step, name) stream, like RigL's
    # |grad| (so SET and RigL differ by that one function).
    from lightning_sparse.core.mask_ops import drop_and_grow

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=gen, dtype=torch.float64)
    mask = torch.rand(128, 256, generator=gen) < 0.2
    seed, step, active = 4, 6, int(mask.sum())
    model = hand_update(
        SET(
            1 - active / w.numel(),
            update={"freq": 3},
            drop_fraction=0.3,
            seed=seed,
            init_method=fixed_mask(mask),
        ),
        torch.where(mask, w, 0).tolist(),
        step,
    )
    new = model.weight_mask
    assert int(new.sum()) == active  # the target count
    n_drop = active - int(0.7 * active)
    stream = generator_for(seed, step, "weight", torch.device("cpu"))
    scores = torch.rand(w.shape, generator=stream)
    flat = (w.abs().reshape(1, -1), scores.reshape(1, -1), mask.reshape(1, -1))
    expected = drop_and_grow(*flat, n_drop, active)
    assert torch.equal(new, expected.reshape(w.shape))


def test_set_drop_fraction_zero_changes_nothing_and_one_replaces_all() -> None:
    keep = hand_update(
        SET(0.375, update={"freq": 1}, drop_fraction=0.0, init_method=fixed_mask(M8)), W8, 1
    )
    assert torch.equal(keep.weight_mask, M8)
    every = hand_update(
        SET(0.375, update={"freq": 1}, drop_fraction=1.0, seed=1, init_method=fixed_mask(M8)), W8, 1
    )
    assert int(every.weight_mask.sum()) == 5  # all 5 dropped, 5 regrown from all 8 positions


@pytest.mark.parametrize(
    ("grad", "expected", "dropped", "grown"),
    [
        # Grow the two largest |grad| outside {0, 2, 7}: index 5 (0.8) and 3 (0.6).
        ([[5, 0.2, 9, 0.6, 0.1, 0.8, 0.4, 7]], {0, 2, 7, 5, 3}, 2, 2),
        # Index 1 was just dropped but has the largest |grad| among the candidates: it comes
        # straight back (paper: ArgTopK over i not in theta minus I_drop), a net change of 1.
        ([[5, -3.0, 9, 0.6, 0.1, -0.8, 0.4, 7]], {0, 2, 7, 1, 5}, 1, 1),
    ],
    ids=["grow-inactive", "regrow-just-dropped"],
)
def test_rigl_hand_case(
    grad: list[list[float]], expected: set[int], dropped: int, grown: int
) -> None:
    algorithm = RigL(0.375, update={"freq": 3}, drop_fraction=0.4, init_method=fixed_mask(M8))
    seen: list[tuple[int, dict]] = []
    algorithm.register_update_hook(lambda alg, step, stats: seen.append((step, stats)))
    model = hand_update(algorithm, W8, 3, grad)
    assert flat_set(model.weight_mask) == expected
    # Newly grown weights start at 0, dropped ones are zeroed, the rest are untouched.
    original = torch.tensor(W8, dtype=torch.float64)
    assert torch.equal(model.weight.detach(), torch.where(model.weight_mask, original, 0))
    [(step, stats)] = seen
    assert step == 3 and set(stats) == {"weight"}
    s = stats["weight"]
    assert {k for k in s} == {"dropped", "grown", "sparsity", "itop"}
    assert all(torch.is_tensor(v) and v.ndim == 0 for v in s.values())
    assert int(s["dropped"]) == dropped and int(s["grown"]) == grown
    assert float(s["sparsity"]) == pytest.approx(0.375)
    ever = flat_set(M8) | expected
    assert float(s["itop"]) == pytest.approx(len(ever) / 8)


def test_drop_and_grow_algorithms_share_one_constructor_and_differ_by_their_hooks() -> None:
    """SET, RigL, GraNet and a user's algorithm are `DropAndGrow` with a grow score (and
    GraNet's prune_to_target): the hand case drops |w| 0.1 and 0.3 of {0, 1, 2, 4, 7} and grows
    the two highest scores outside {0, 2, 7}: positions 6 and 5."""
    for cls in (SET, RigL, GraNet, GrowLast):
        assert cls.__init__ is core.DropAndGrow.__init__, cls
        assert cls.update_mask is core.DropAndGrow.update_mask, cls
    assert [c.prune_to_target for c in (SET, RigL, GraNet)] == [False, False, True]
    algorithm = GrowLast(0.375, update={"freq": 1}, drop_fraction=0.4, init_method=fixed_mask(M8))
    model = hand_update(algorithm, W8, 1)
    assert flat_set(model.weight_mask) == {0, 2, 5, 6, 7}
    assert algorithm.config()["drop_fraction"] == "Constant(value=0.4)"


def test_rigl_balanced_groups_hand_case() -> None:
    w = [[0.9, -0.1, 0.0, 0.0], [0.0, 0.3, 0.0, -0.7]]
    mask = as_mask([[1, 1, 0, 0], [0, 1, 0, 1]])
    grad = [[0, 0, 1, 0.5], [9, 0, 8, 0]]
    # Per row: n_target = 2, 2 - int(0.5 * 2) = 1 dropped: 0.1 / 0.3, grow by |grad| in-row.
    balanced = RigL(
        0.5,
        update={"freq": 1},
        drop_fraction=0.5,
        shaper=OutputGroups(2),
        init_method=fixed_mask(mask),
    )
    model = hand_update(balanced, w, 1, grad)
    assert torch.equal(model.weight_mask, as_mask([[1, 0, 1, 0], [1, 0, 0, 1]]))
    # Unstructured: n_target = 4, n_drop = 2, both grown in row 1 (|grad| 9 and 8).
    flat = hand_update(
        RigL(0.5, update={"freq": 1}, drop_fraction=0.5, init_method=fixed_mask(mask)), w, 1, grad
    )
    assert torch.equal(flat.weight_mask, as_mask([[1, 0, 0, 0], [1, 0, 1, 1]]))


@pytest.mark.parametrize(
    ("drop_fraction", "expected"),
    [
        # Surplus 2 plus 4 - int(0.5 * 4) = 2 dropped by |w| -> {0, 7}; grow 2 by |grad| -> 6, 3.
        (0.5, {0, 7, 6, 3}),
        # Only the surplus goes: pure magnitude pruning to the target, top-4 |w| of the active.
        (0.0, {0, 7, 2, 4}),
    ],
)
def test_granet_prunes_surplus_then_drops_and_regrows(
    drop_fraction: float, expected: set[int]
) -> None:
    w = [[0.9, -0.1, 0.5, 0.0, 0.3, 0.2, 0.0, -0.7]]
    mask = as_mask([[1, 1, 1, 0, 1, 1, 0, 1]])  # 6 active = int((1 - 0.25) * 8)
    grad = [[9, 0.2, 0.3, 0.6, 0.1, 0.05, 0.8, 9]]
    schedule = {"type": "cubic", "init": 0.25, "final": 0.5, "begin": 0, "end": 4}
    algorithm = GraNet(
        schedule, update={"freq": 4}, drop_fraction=drop_fraction, init_method=fixed_mask(mask)
    )
    model = hand_update(algorithm, w, 4, grad)  # s(4) = 0.5: n_target = 4, surplus = 2
    assert flat_set(model.weight_mask) == expected
    assert algorithm.mask_target("weight") == 0.5


# ============================================================================ 2. reference


def reference_rigl(
    w: torch.Tensor,
    grad: torch.Tensor,
    mask: torch.Tensor,
    sparsity: float,
    drop_fraction: float,
    groups: int,
) -> torch.Tensor:
    """RigL's update (Evci et al. 2020, Algorithm 1) per balance group, with plain sorts.

    Per row of ``reshape(groups, -1)``: keep the ``int((1 - d) * active)`` active weights of
    largest |w| (Cerebras' count), then grow ``n_target - kept`` connections of largest |grad|
    among all positions not kept (a just-dropped one included). Ties go to the lower index.
    """
    w_rows, g_rows, m_rows = (t.reshape(groups, -1).tolist() for t in (w, grad, mask))
    out = []
    for wr, gr, mr in zip(w_rows, g_rows, m_rows, strict=True):
        n = len(wr)
        n_target = int((1.0 - sparsity) * n)
        active = sorted((i for i in range(n) if mr[i]), key=lambda i: (-abs(wr[i]), i))
        kept = active[: int((1.0 - drop_fraction) * len(active))]
        candidates = sorted((i for i in range(n) if i not in kept), key=lambda i: (-abs(gr[i]), i))
        chosen = set(kept) | set(candidates[: max(n_target - len(kept), 0)])
        out.append([i in chosen for i in range(n)])
    return torch.tensor(out, dtype=torch.bool).reshape(w.shape)


def reference_topk(w: torch.Tensor, sparsity: float, groups: int) -> torch.Tensor:
    """GMP's mask: per row, the ``int((1 - s) * n)`` largest |w| (ties to the lower index)."""
    out = []
    for row in w.reshape(groups, -1).tolist():
        n = len(row)
        order = sorted(range(n), key=lambda i: (-abs(row[i]), i))
        chosen = set(order[: int((1.0 - sparsity) * n)])
        out.append([i in chosen for i in range(n)])
    return torch.tensor(out, dtype=torch.bool).reshape(w.shape)


@st.composite
def update_inputs(draw: st.DrawFn) -> dict[str, Any]:
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    numel = rows * cols
    groups = draw(st.sampled_from([g for g in range(1, numel + 1) if numel % g == 0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # Coarse values make ties, which must go to the lower index; fine ones make none.
    coarse = draw(st.booleans())

    def values() -> torch.Tensor:
        x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
        return (x * 2).round() / 2 if coarse else x

    mask = torch.rand(rows, cols, generator=gen) < draw(st.floats(0.0, 1.0))
    return {
        "w": torch.where(mask, values(), 0.0),
        "grad": values(),
        "mask": mask,
        "sparsity": draw(st.floats(0.0, 0.99)),
        "drop_fraction": draw(st.floats(0.0, 1.0)),
        "groups": groups,
    }


REFERENCE_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@REFERENCE_SETTINGS
@given(case=update_inputs())
def test_rigl_matches_reference(case: dict[str, Any]) -> None:
    algorithm = RigL(
        case["sparsity"],
        update={"freq": 1},
        drop_fraction=case["drop_fraction"],
        shaper=OutputGroups(case["groups"]),
        init_method=fixed_mask(case["mask"]),
    )
    model = hand_update(algorithm, case["w"].tolist(), 1, case["grad"].tolist())
    expected = reference_rigl(
        case["w"],
        case["grad"],
        case["mask"],
        case["sparsity"],
        case["drop_fraction"],
        case["groups"],
    )
    assert torch.equal(model.weight_mask, expected)


@REFERENCE_SETTINGS
@given(case=update_inputs())
def test_gmp_matches_reference(case: dict[str, Any]) -> None:
    s = case["sparsity"]
    algorithm = GMP(
        lambda step: s,
        update={"freq": 1},
        shaper=OutputGroups(case["groups"]),
        init_method=fixed_mask(case["mask"]),
    )
    model = hand_update(algorithm, case["w"].tolist(), 1)
    assert torch.equal(model.weight_mask, reference_topk(case["w"], s, case["groups"]))


# ============================================================================ 3. contracts


class KeepFirst(DynamicSparsityAlgorithm):
    """Keep the first ``int((1 - s) * n)`` weights in flat order: a user algorithm, 4 lines."""

    def update_mask(
        self, name: str, p: torch.Tensor, mask: torch.Tensor, sparsity: float
    ) -> torch.Tensor:
        keep = int((1 - sparsity) * p.numel())
        return (torch.arange(p.numel(), device=p.device) < keep).reshape(p.shape)


class GrowLast(DropAndGrow):
    """A user drop-and-grow algorithm: one grow score (the last positions first), nothing else."""

    def grow_score(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return torch.arange(p.numel(), dtype=p.dtype, device=p.device).reshape(p.shape)


CUBIC = {"type": "cubic", "init": 0.0, "final": 0.7, "begin": 0, "end": 8}
CONTRACT: dict[str, Callable[[], SparsityAlgorithm]] = {
    "static": lambda: Static(0.6, seed=1),
    "set": lambda: SET(0.6, update={"freq": 2}, drop_fraction=0.4, seed=1),
    "rigl": lambda: RigL(
        0.6,
        update={"freq": 2},
        seed=1,
        drop_fraction={"type": "cosine", "init": 0.5, "half_period": 8},
    ),
    "gmp": lambda: GMP(CUBIC, update={"freq": 2}),
    "granet": lambda: GraNet({**CUBIC, "init": 0.3}, update={"freq": 2}, drop_fraction=0.3),
    "growlast": lambda: GrowLast(0.6, update={"freq": 2}, drop_fraction=0.3, seed=1),
    "keepfirst": lambda: KeepFirst(
        {"type": "linear", "init": 0.3, "slope": 0.04}, update={"freq": 3}
    ),
}


def registered() -> list[str]:
    """Library algorithms plus the ones defined here (other test modules' classes excluded)."""
    return [
        name
        for name, cls in available_algorithms().items()
        if cls.__module__.startswith("lightning_sparse") or cls.__module__ == __name__
    ]


def make(name: str) -> SparsityAlgorithm:
    if name not in CONTRACT:
        pytest.fail(f"algorithm {name!r} is registered but has no entry in CONTRACT; add one")
    return CONTRACT[name]()


def test_contract_table_covers_the_registry() -> None:
    assert {"static", "set", "rigl", "gmp", "granet", "growlast", "keepfirst"} <= set(registered())
    missing = set(registered()) - set(CONTRACT)
    assert not missing, f"registered algorithms without a CONTRACT entry: {sorted(missing)}"


def lm_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 16, (8, 9), generator=torch.Generator().manual_seed(step))


def lm_setup(name: str) -> tuple[TinyNet, SparsityAlgorithm, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    sparsity = make(name)
    model.apply(sparsity)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    return model, sparsity, optimizer


def lm_step(model: TinyNet, optimizer: torch.optim.Optimizer, step: int) -> None:
    tokens = lm_batch(step)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def assert_core_invariants(
    sparsity: SparsityAlgorithm, optimizer: torch.optim.Optimizer, when: str
) -> None:
    assert sparsity.sparse_params, "nothing sparsified: the test checks nothing"
    for name, sp in sparsity.sparse_params.items():
        pruned = ~sp.mask
        assert not sp.param.detach()[pruned].any(), f"{when}: {name} pruned weight != 0"
        state = optimizer.state[sp.param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert not state[key][pruned].any(), f"{when}: {name} Adam {key} != 0 where pruned"
        if sp.param.grad is not None:
            assert not sp.param.grad[pruned].any(), f"{when}: {name} pruned grad != 0"
        n = sp.mask.numel()
        expected = int((1 - sparsity.mask_target(name)) * n)
        assert int(sp.mask.sum()) == expected, f"{when}: {name} keeps {int(sp.mask.sum())}"


@pytest.mark.parametrize("name", registered())
def test_contract_invariants_every_step(name: str) -> None:
    model, sparsity, optimizer = lm_setup(name)
    initial = masks_of(sparsity)
    updates: list[int] = []
    sparsity.register_update_hook(lambda alg, step, stats: updates.append(step))
    for step in range(10):
        lm_step(model, optimizer, step)
        assert sparsity.step == step + 1
        assert_core_invariants(sparsity, optimizer, f"{name} after step {step + 1}")
    if name != "static":  # every other registered algorithm updates on its cadence
        freq = sparsity.update_schedule.freq
        assert updates == [t for t in range(1, 10) if t % freq == 0]
        assert any(not torch.equal(m, initial[n]) for n, m in masks_of(sparsity).items())
    else:
        assert updates == []
        assert all(torch.equal(m, initial[n]) for n, m in masks_of(sparsity).items())


class InvariantCheck(pl.Callback):
    """Checks the core invariants at the end of every training batch (after its optimizer step)."""

    def __init__(self, sparsity: SparsityAlgorithm) -> None:
        self.sparsity = sparsity
        self.checked = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        when = f"{self.sparsity!r} after Lightning step {self.sparsity.step}"
        assert_core_invariants(self.sparsity, trainer.optimizers[0], when)
        self.checked += 1


@pytest.mark.parametrize("name", registered())
def test_contract_invariants_every_step_under_lightning(tmp_path: Path, name: str) -> None:
    sparsity = make(name)
    check = InvariantCheck(sparsity)
    trainer(tmp_path, max_steps=5, callbacks=[sparsity, check]).fit(TinyLM(), token_loader())
    assert check.checked == 5 and sparsity.step == 5


@pytest.mark.parametrize("split", [4, 5], ids=["resume-at-update-step", "resume-between"])
@pytest.mark.parametrize("name", registered())
def test_contract_resume_equals_uninterrupted(name: str, split: int) -> None:
    model, sparsity, optimizer = lm_setup(name)
    for step in range(10):
        lm_step(model, optimizer, step)

    model_a, sparsity_a, optimizer_a = lm_setup(name)
    for step in range(split):
        lm_step(model_a, optimizer_a, step)
    saved = copy.deepcopy(
        {
            "model": model_a.state_dict(),
            "optimizer": optimizer_a.state_dict(),
            "sparsity": sparsity_a.state_dict(),
        }
    )
    model_b, sparsity_b, optimizer_b = lm_setup(name)  # fresh objects, as in a new process
    model_b.load_state_dict(saved["model"])
    optimizer_b.load_state_dict(saved["optimizer"])
    sparsity_b.load_state_dict(saved["sparsity"])
    for step in range(split, 10):
        lm_step(model_b, optimizer_b, step)

    assert_state_equal(model.state_dict(), model_b.state_dict(), "model")  # weights and masks
    assert_state_equal(sparsity.state_dict(), sparsity_b.state_dict(), "sparsity")
    assert_state_equal(optimizer.state_dict(), optimizer_b.state_dict(), "optimizer")


@pytest.mark.parametrize("name", registered())
def test_contract_two_runs_are_identical(name: str) -> None:
    runs = []
    for global_seed in (1, 2):  # the algorithm must not draw from torch's global generator
        model, sparsity, optimizer = lm_setup(name)
        torch.manual_seed(global_seed)
        for step in range(6):
            lm_step(model, optimizer, step)
        runs.append((masks_of(sparsity), model.state_dict()))
    assert_state_equal(runs[0][0], runs[1][0], "masks")
    assert_state_equal(runs[0][1], runs[1][1], "model")


# ============================================================================ 4. accumulation


def mlp64() -> nn.Sequential:
    """No batch-dependent layers, so a mean loss splits exactly over micro-batches."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3)
    ).double()


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(48, 6, generator=g, dtype=torch.float64),
        torch.randn(48, 3, generator=g, dtype=torch.float64),
    )


def make_rigl() -> RigL:
    return RigL(0.7, update={"freq": 2}, drop_fraction=0.5, seed=4)


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp64()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def plain_accumulation_run(micro_batches: int) -> tuple[dict[str, torch.Tensor], dict]:
    """3 SGD steps of 16 samples; the update step (step 2) accumulates ``micro_batches``.

    Returns the masks after the update and the expected masks from the reference RigL fed with
    an independently computed dense full-batch gradient.
    """
    x, y = regression_data()
    model = Regression()  # plain nn.Module use; same parameter names ("net.0.weight") as below
    sparsity = make_rigl()
    model.apply(sparsity)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sparsity.apply(optimizer)
    expected = {}
    for t in range(3):
        xb, yb = x[16 * t : 16 * (t + 1)], y[16 * t : 16 * (t + 1)]
        optimizer.zero_grad()
        if t == 2:
            # Reference: the dense gradient of the full batch on a plain copy of the weights.
            plain = Regression()
            plain.load_state_dict(model.state_dict(), strict=False)  # no *_mask buffers
            nn.functional.mse_loss(plain.net(xb), yb).backward()
            grads = dict(plain.named_parameters())
            expected = {
                name: reference_rigl(sp.param.detach(), grads[name].grad, sp.mask, 0.7, 0.5, 1)
                for name, sp in sparsity.sparse_params.items()
            }
            for xm, ym in zip(xb.chunk(micro_batches), yb.chunk(micro_batches), strict=True):
                (nn.functional.mse_loss(model.net(xm), ym) / micro_batches).backward()
        else:
            nn.functional.mse_loss(model.net(xb), yb).backward()
        optimizer.step()
    return masks_of(sparsity), expected


def test_plain_accumulated_gradients_give_the_big_batch_rigl_masks() -> None:
    big, expected = plain_accumulation_run(1)
    accumulated, _ = plain_accumulation_run(4)
    assert_state_equal(big, expected, "big batch vs reference")
    assert_state_equal(accumulated, expected, "accumulated vs reference")


def test_lightning_accumulate_grad_batches_gives_the_big_batch_rigl_masks(tmp_path: Path) -> None:
    masks = []
    for batch_size, accumulate in ((16, 1), (4, 4)):
        module, callback = Regression(), make_rigl()
        loader = DataLoader(TensorDataset(*regression_data()), batch_size=batch_size)
        trainer(
            tmp_path, max_steps=3, accumulate_grad_batches=accumulate, callbacks=[callback]
        ).fit(module, loader)
        assert callback.step == 3 and callback.last_update_step == 2
        masks.append(masks_of(callback))
    plain, expected = plain_accumulation_run(1)
    assert_state_equal(masks[0], plain, "lightning big batch vs plain")
    assert_state_equal(masks[1], expected, "lightning accumulated vs reference")


# ============================================================================ 5. shapers


def shaped_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def train_plain(
    model: nn.Module,
    sparsity: SparsityAlgorithm,
    steps: int,
    check: Callable[[int], None] | None = None,
) -> torch.optim.Optimizer:
    model.apply(sparsity)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    sparsity.apply(optimizer)
    if check is not None:
        check(0)
    for t in range(steps):
        x = torch.randn(16, model[0].in_features, generator=torch.Generator().manual_seed(t))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        if check is not None:
            check(t + 1)
    return optimizer


def test_rigl_balance_out_groups_keeps_equal_counts_per_row_block() -> None:
    sparsity = RigL(0.75, update={"freq": 1}, drop_fraction=0.5, shaper=OutputGroups(4))
    model = shaped_model()
    changed = []

    def check(step: int) -> None:
        for name, sp in sparsity.sparse_params.items():
            per_block = sp.mask.reshape(4, -1).sum(-1)  # 4 blocks of output rows
            keep = int(0.25 * (sp.mask.numel() // 4))
            assert per_block.tolist() == [keep] * 4, f"{name} step {step}: {per_block.tolist()}"
        changed.append(masks_of(sparsity))

    train_plain(model, sparsity, 4, check)
    assert any(not torch.equal(changed[0][n], changed[-1][n]) for n in changed[0])


NM_ALGORITHMS = {
    "static": lambda: Static(0.5, shaper=NM(2, 4)),  # type: ignore[call-arg]
    "set": lambda: SET(0.5, update={"freq": 1}, drop_fraction=0.5, shaper=NM(2, 4)),
    "rigl": lambda: RigL(0.5, update={"freq": 1}, drop_fraction=0.5, shaper=NM(2, 4)),
}


@pytest.mark.parametrize("name", sorted(NM_ALGORITHMS))
def test_nm_2_4_keeps_two_of_every_four_inputs(name: str) -> None:
    sparsity = NM_ALGORITHMS[name]()
    model = shaped_model()

    def check(step: int) -> None:
        for pname, sp in sparsity.sparse_params.items():
            out_dim, in_dim = sp.mask.shape
            runs = sp.mask.reshape(out_dim, in_dim // 4, 4).sum(-1)
            assert bool((runs == 2).all()), f"{pname} step {step}: {runs.tolist()}"

    train_plain(model, sparsity, 4, check)


@pytest.mark.parametrize("cls", [SET, RigL])
def test_blocks_2x2_keeps_whole_blocks(cls: type) -> None:
    sparsity = cls(0.5, update={"freq": 1}, drop_fraction=0.5, shaper=Blocks(2, 2))
    model = shaped_model()
    history = []

    def check(step: int) -> None:
        for name, sp in sparsity.sparse_params.items():
            out_dim, in_dim = sp.mask.shape
            blocks = sp.mask.reshape(out_dim // 2, 2, in_dim // 2, 2).sum((1, 3))
            assert set(blocks.unique().tolist()) <= {0, 4}, f"{name} step {step}: split block"
            assert int((blocks == 4).sum()) == int(0.5 * blocks.numel()), f"{name} step {step}"
        history.append(masks_of(sparsity))

    train_plain(model, sparsity, 4, check)
    assert any(not torch.equal(history[0][n], history[-1][n]) for n in history[0])


def erk_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64))


ERK_ALGORITHMS = {
    "static": lambda: Static(0.8, distribution="erk", param_filter="*weight"),
    "set": lambda: SET(0.8, update={"freq": 1}, distribution="erk", param_filter="*weight"),
    "rigl": lambda: RigL(0.8, update={"freq": 1}, distribution="erk", param_filter="*weight"),
}


@pytest.mark.parametrize("name", sorted(ERK_ALGORITHMS))
def test_erk_distribution_mean_is_target_and_small_layers_are_denser(name: str) -> None:
    sparsity = ERK_ALGORITHMS[name]()
    model = erk_model()

    def check(step: int) -> None:
        targets = {n: sparsity.mask_target(n) for n in sparsity.sparse_params}
        sizes = {n: sp.mask.numel() for n, sp in sparsity.sparse_params.items()}
        mean = sum(targets[n] * sizes[n] for n in sizes) / sum(sizes.values())
        assert mean == pytest.approx(0.8, abs=1e-9)
        # Density grows with (fan_in + fan_out) / numel: 4x8 > 8x64 > 64x64 (the small one dense).
        assert targets["0.weight"] < targets["2.weight"] < targets["4.weight"]
        for n, sp in sparsity.sparse_params.items():
            assert int(sp.mask.sum()) == int((1 - targets[n]) * sizes[n]), f"{n} step {step}"

    train_plain(model, sparsity, 3, check)


def global_reference(weights: dict[str, torch.Tensor], sparsity: float) -> dict[str, torch.Tensor]:
    """Top ``int((1 - s) * total)`` of |w| over all layers; ties to the earlier layer / index."""
    flat = [
        (abs(v), li, i)
        for li, w in enumerate(weights.values())
        for i, v in enumerate(w.reshape(-1).tolist())
    ]
    chosen = {
        (li, i)
        for _, li, i in sorted(flat, key=lambda t: (-t[0], t[1], t[2]))[
            : int((1 - sparsity) * len(flat))
        ]
    }
    return {
        name: torch.tensor([(li, i) in chosen for i in range(w.numel())]).reshape(w.shape)
        for li, (name, w) in enumerate(weights.items())
    }


def test_static_global_distribution_is_a_global_magnitude_mask() -> None:
    model = erk_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("weight")}
    sparsity = Static(0.8, distribution="global", param_filter="*weight")
    model.apply(sparsity)
    expected = global_reference(before, 0.8)
    assert_state_equal(masks_of(sparsity), expected)
    kept = {n: int(m.sum()) for n, m in expected.items()}
    assert len(set(kept.values())) == 3  # layers end up at different sparsities


def test_gmp_global_distribution_ranks_all_layers_together() -> None:
    schedule = {"type": "cubic", "init": 0.0, "final": 0.9, "begin": 0, "end": 6}
    sparsity = GMP(schedule, update={"freq": 2}, distribution="global", param_filter="*weight")
    model = erk_model()
    model.apply(sparsity)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    sparsity.apply(optimizer)
    sparsity.autoupdate = False
    updated = 0
    for t in range(7):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(t))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        if sparsity.is_update_step():
            weights = {n: sp.param.detach().clone() for n, sp in sparsity.sparse_params.items()}
            sparsity.update(optimizer)
            target = float(sparsity.sparsity(t))
            assert_state_equal(masks_of(sparsity), global_reference(weights, target), f"step {t}")
            updated += 1
        optimizer.step()
    assert updated == 3  # steps 2, 4, 6


# ============================================================================ 6. observability


def test_set_update_hook_counts_and_itop_grow_monotonically() -> None:
    drop = 0.3
    sparsity = SET(0.75, update={"freq": 1}, drop_fraction=drop, seed=2)
    model = shaped_model()
    seen: list[tuple[int, dict]] = []
    sparsity.register_update_hook(lambda alg, step, stats: seen.append((step, stats)))
    itop = [float(sparsity.itop_rate())]
    ever = {}

    def check(step: int) -> None:
        if step == 0:
            ever.update(masks_of(sparsity))
            return
        for name, m in masks_of(sparsity).items():
            ever[name] = ever[name] | m
        itop.append(float(sparsity.itop_rate()))

    train_plain(model, sparsity, 6, check)
    assert [step for step, _ in seen] == [1, 2, 3, 4, 5]  # step 0 is never an update
    for step, stats in seen:
        assert set(stats) == set(sparsity.sparse_params)
        for name, s in stats.items():
            n = sparsity.sparse_params[name].mask.numel()
            n_target = int(0.25 * n)
            n_drop = n_target - int((1 - drop) * n_target)
            # A connection dropped and regrown at once counts in neither (net change).
            assert int(s["dropped"]) == int(s["grown"]) <= n_drop, f"step {step} {name}"
            assert float(s["sparsity"]) == pytest.approx(1 - int(0.25 * n) / n)
    assert any(int(s["dropped"]) > 0 for _, stats in seen for s in stats.values())
    assert all(b >= a for a, b in zip(itop, itop[1:], strict=False)), itop
    assert itop[-1] > itop[0]
    total = sum(m.numel() for m in ever.values())
    assert itop[-1] == pytest.approx(sum(int(m.sum()) for m in ever.values()) / total)


def test_lightning_logs_update_metrics(tmp_path: Path) -> None:
    callback = SET(0.75, update={"freq": 3}, drop_fraction=0.5, seed=1)
    totals: dict[int, tuple[float, float, float]] = {}

    def record(alg: SparsityAlgorithm, step: int, stats: dict) -> None:
        dropped = sum(float(s["dropped"]) for s in stats.values())
        grown = sum(float(s["grown"]) for s in stats.values())
        totals[step] = (dropped, grown, float(alg.itop_rate()))

    callback.register_update_hook(record)
    t = trainer(
        tmp_path,
        max_steps=7,
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=1,
        callbacks=[callback],
    )
    t.fit(TinyLM(), token_loader())
    assert sorted(totals) == [3, 6]
    with open(Path(t.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    by_step = {int(r["step"]): r for r in rows if r.get("sparsity/target")}
    keys = ("sparsity/dropped", "sparsity/grown", "sparsity/itop")
    assert all(k in rows[0] for k in keys), sorted(rows[0])
    # Nothing before the first update; then the update's own numbers in the row of its step
    # (the logger's step of the batch whose optimizer step ran the update).
    for step in range(0, 3):
        assert all(by_step[step][k] == "" for k in keys), by_step[step]
    for step, (dropped, grown, itop) in totals.items():
        row = by_step[step]
        assert float(row["sparsity/dropped"]) == dropped > 0
        assert float(row["sparsity/grown"]) == grown
        assert float(row["sparsity/itop"]) == pytest.approx(itop)


# ============================================================================ 7. user algorithm


def first_half(sparsity: SparsityAlgorithm) -> None:
    for name, sp in sparsity.sparse_params.items():
        n = sp.mask.numel()
        expected = torch.arange(n).reshape(sp.mask.shape) < n // 2
        assert torch.equal(sp.mask, expected), name
        assert not sp.param.detach()[~sp.mask].any()


def test_custom_algorithm_as_lightning_callback(tmp_path: Path) -> None:
    callback = KeepFirst(0.5, update={"freq": 2}, seed=3)
    module = TinyLM()
    trainer(tmp_path, max_steps=3, callbacks=[callback]).fit(module, token_loader())
    assert set(callback.sparse_params) == {"net.fc1.weight", "net.fc2.weight"}
    assert callback.last_update_step == 2
    first_half(callback)


def test_custom_algorithm_through_configure(tmp_path: Path) -> None:
    assert available_algorithms()["keepfirst"] is KeepFirst
    group = configure({"algorithm": "keepfirst", "sparsity": 0.5, "update": {"freq": 2}})
    assert group is not None and type(group[0]) is KeepFirst
    module = TinyLM()
    trainer(tmp_path, max_steps=3, callbacks=[group]).fit(module, token_loader())
    assert math.isclose(group.overall_sparsity()[0], 0.5)
    first_half(group[0])


# ---------------------------------------------------------------------------- unused layers
class Branchy(nn.Module):
    """``branch`` takes part in the forward on even calls only (a layer used on some steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.branch, self.b = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = torch.relu(self.a(x))
        if self.calls % 2 == 0:
            x = torch.relu(self.branch(x))
        return self.b(x)


@pytest.mark.parametrize("kind", ["rigl", "granet"])
def test_a_layer_unused_on_an_update_step_keeps_its_mask_and_the_others_update(
    kind: str,
) -> None:
    """RigL and GraNet grow by the gradient: a weight with none at an update (its layer took no
    part in that forward) keeps its mask, with a warning naming it; the others update, and the
    step runs (it used to raise inside ``optimizer.step()``, telling the user to run backward)."""
    torch.manual_seed(0)
    model = Branchy()
    sparsity = (
        RigL(0.75, update={"freq": 2}, seed=1)
        if kind == "rigl"
        else GraNet(
            {"type": "cubic", "init": 0.5, "final": 0.75, "begin": 0, "end": 4},
            update={"freq": 2},
            seed=1,
        )
    )
    model.apply(sparsity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    x = torch.randn(8, 16)
    for step in range(6):  # updates in steps 2 and 4 (from 0), calls 3 and 5: the branch unused
        masks = {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}
        model(x).square().mean().backward()
        if step in (2, 4):
            with pytest.warns(UserWarning, match=r"no gradient.*'branch\.weight'.*param_filter"):
                optimizer.step()
            assert torch.equal(sparsity.sparse_params["branch.weight"].mask, masks["branch.weight"])
            assert not torch.equal(sparsity.sparse_params["a.weight"].mask, masks["a.weight"])
        else:
            optimizer.step()
        optimizer.zero_grad()
        for sp in sparsity.sparse_params.values():
            assert not sp.param[~sp.mask].any()
    assert sparsity.step == 6 and sparsity.last_update_step == 4


def test_an_update_with_no_gradient_at_all_says_to_run_backward() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    sparsity = RigL(0.5, update={"freq": 1})
    model.apply(sparsity)
    sparsity.step = 1
    with pytest.raises(RuntimeError, match="needs the dense gradient of '0.weight'.*run backward"):
        sparsity.update()
