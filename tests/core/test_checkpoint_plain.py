"""Plain-PyTorch checkpoints, densify, the Cerebras 1.x converter, the report and the hooks."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_sparse import (
    SET,
    RigL,
    Static,
    convert_nan_checkpoint,
    densify,
    sparsity_report,
)
from tests.helpers import TinyNet, assert_state_equal

SPARSE = ["fc1.weight", "fc2.weight"]


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 16, (8, 9), generator=torch.Generator().manual_seed(step))


def _train(model: TinyNet, sparsity, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        tokens = _batch(step)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _setup(make) -> tuple[TinyNet, object, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    sparsity = make()
    model.apply(sparsity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    return model, sparsity, optimizer


@pytest.mark.parametrize(
    "make",
    [
        lambda: Static(sparsity=0.6),
        lambda: SET(sparsity=0.6, update={"freq": 2}, drop_fraction=[0.5, 0.2]),
        lambda: RigL(
            sparsity=0.6,
            update={"freq": 3},
            drop_fraction={"type": "cosine", "init": 0.4, "half_period": 6},
        ),
    ],
    ids=["static", "set-cycling-drop", "rigl-cosine"],
)
def test_state_dict_resume_is_bit_exact(make) -> None:
    model, sparsity, optimizer = _setup(make)
    _train(model, sparsity, optimizer, range(10))

    model_a, sparsity_a, optimizer_a = _setup(make)
    _train(model_a, sparsity_a, optimizer_a, range(5))
    saved = copy.deepcopy(
        {
            "model": model_a.state_dict(),
            "optim": optimizer_a.state_dict(),
            "sparsity": sparsity_a.state_dict(),
        }
    )
    model_b, sparsity_b, optimizer_b = _setup(make)  # fresh process stand-in: new objects
    model_b.load_state_dict(saved["model"])
    optimizer_b.load_state_dict(saved["optim"])
    sparsity_b.load_state_dict(saved["sparsity"])
    _train(model_b, sparsity_b, optimizer_b, range(5, 10))

    for key, value in model.state_dict().items():
        assert torch.equal(value, model_b.state_dict()[key]), key
    assert_state_equal(sparsity.state_dict(), sparsity_b.state_dict())


def test_dense_checkpoint_gets_masks_applied() -> None:
    torch.manual_seed(1)
    dense = TinyNet()
    model, sparsity, _ = _setup(lambda: Static(sparsity=0.5))
    masks = {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}
    model.load_state_dict(dense.state_dict())  # no *_mask keys: strict load still succeeds
    for name, sp in sparsity.sparse_params.items():
        assert torch.equal(sp.mask, masks[name])
        assert torch.all(sp.param[~sp.mask] == 0)
        assert torch.equal(sp.param[sp.mask], dense.state_dict()[name][sp.mask])


def test_masks_that_do_not_fit_are_a_clear_error() -> None:
    model, sparsity, _ = _setup(lambda: Static(sparsity=0.5))
    state = model.state_dict()
    before = copy.deepcopy(state)
    bad = dict(state)
    bad["fc1.weight_mask"] = torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"fc1\.weight_mask.*shape \(3, 3\).*\(40, 24\)"):
        model.load_state_dict(bad)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # nothing was modified
    foreign = dict(state)
    foreign["lm_head.weight_mask"] = torch.ones(16, 24, dtype=torch.bool)
    with pytest.raises(ValueError, match="lm_head.weight_mask.*leaves dense"):
        model.load_state_dict(foreign)


def test_densify_removes_masks_and_training_continues_dense() -> None:
    model, sparsity, optimizer = _setup(lambda: RigL(sparsity=0.8, update={"freq": 2}))
    _train(model, sparsity, optimizer, range(4))
    zeros_before = int((model.fc1.weight == 0).sum())
    assert densify(model) == 2
    assert not any(k.endswith("_mask") for k in model.state_dict())
    assert sparsity.sparse_params == {}
    _train(model, sparsity, optimizer, range(4, 6))
    assert int((model.fc1.weight == 0).sum()) < zeros_before // 10  # the zeros grew back


def test_convert_nan_checkpoint_round_trip() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    state = model.state_dict()
    pruned = state["fc1.weight"].clone()
    pruned[::2] = float("nan")
    optim_state = {"state": {0: {"exp_avg": pruned.clone()}}}
    converted = convert_nan_checkpoint({**state, "fc1.weight": pruned}, optim_state)
    mask = converted["fc1.weight_mask"]
    assert mask.dtype == torch.bool and int((~mask).sum()) == pruned[::2].numel()
    assert torch.all(converted["fc1.weight"][~mask] == 0)
    assert not optim_state["state"][0]["exp_avg"].isnan().any()
    assert "fc2.weight_mask" not in converted  # no NaN, no mask

    target, sparsity, _ = _setup(lambda: Static(sparsity=0.0, param_filter="fc1.weight"))
    target.load_state_dict(converted)
    assert torch.equal(target.fc1.weight_mask, mask)


def test_sparsity_report_counts_and_table() -> None:
    model, sparsity, _ = _setup(lambda: Static(sparsity=0.75))
    report = sparsity_report(model)
    rows = report.as_dict()["params"]
    assert rows["fc1.weight"]["nonzeros"] == int(0.25 * 960)
    assert rows["fc1.weight"]["masked"] and not rows["fc1.bias"]["masked"]
    totals = report.totals
    assert totals["sparse_params"] == 2 * 960
    assert totals["sparse_sparsity"] == pytest.approx(0.75)
    table = str(report)
    assert "fc1.weight" in table and "75.00%" in table and "(dense)" in table


def test_sparsity_hooks_report_target_and_computed() -> None:
    events: list[tuple[str, str, float]] = []
    sparsity = SET(sparsity=0.5, update={"freq": 1})
    sparsity.register_target_sparsity_hook(lambda a, n, v: events.append(("target", n, v)))
    handle = sparsity.register_computed_sparsity_hook(
        lambda a, n, v: events.append(("computed", n, float(v)))
    )
    torch.manual_seed(0)
    model = TinyNet()
    model.apply(sparsity)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sparsity.apply(optimizer)
    _train(model, sparsity, optimizer, range(2))
    # apply + the update before step 2 (step 1 completed)
    assert [e[0] for e in events if e[1] == "fc1.weight"] == ["target", "computed"] * 2
    assert all(v == pytest.approx(0.5) for _, _, v in events)
    handle.remove()
    events.clear()
    _train(model, sparsity, optimizer, range(2, 3))
    assert [e[0] for e in events] == ["target", "target"]


def test_cycling_schedule_reports_the_target_its_masks_were_built_for() -> None:
    """Cycling advances after each update; the reported target must not run ahead of the mask."""
    from lightning_sparse import GMP

    model, sparsity, optimizer = _setup(
        lambda: GMP(sparsity=[0.3, 0.5, 0.7], update={"steps": [0, 2, 4]})
    )
    for steps, expected in ((range(0, 1), 0.3), (range(1, 3), 0.5), (range(3, 5), 0.7)):
        _train(model, sparsity, optimizer, steps)
        target, actual = sparsity.overall_sparsity()
        assert target == pytest.approx(expected)
        assert float(actual) == pytest.approx(expected, abs=1e-2)
    restored = GMP(sparsity=[0.3, 0.5, 0.7], update={"steps": [0, 2, 4]})
    TinyNet().apply(restored)
    restored.load_state_dict(sparsity.state_dict())
    assert restored.mask_target("fc1.weight") == pytest.approx(0.7)
