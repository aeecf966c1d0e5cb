"""Schedules are checked over the training range when an algorithm is built (and by the
Lightning layer up to ``max_steps``); GMP and GraNet reach their final sparsity whatever the
cadence."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_sparse.core import GMP, SET, GraNet, RigL, Static
from tests.helpers import TinyLM, token_loader, trainer


def cubic(final: float, end: int, init: float = 0.0) -> dict:
    return {"type": "cubic", "init": init, "final": final, "begin": 0, "end": end}


def test_cubic_ending_at_one_is_refused_when_built() -> None:
    with pytest.raises(ValueError) as info:
        GMP(cubic(1.0, 1000), update={"freq": 100})
    message = str(info.value)
    assert "gives 1 at step 1000" in message and "[0, 1)" in message and "final" in message


def test_growing_exp_is_refused_when_built_within_the_cadence() -> None:
    """Overflow (math.exp) inside the cadence's range: a ValueError naming the step, not an
    OverflowError hundreds of steps into training."""
    schedule = {"type": "exp", "init": 0.5, "gamma": 1.0, "final": 0.0}
    with pytest.raises(ValueError, match=r"(fails|gives) .* at step \d+"):
        RigL(schedule, update={"freq": 1, "stop": 5000})


def test_sparsity_leaving_the_range_midway_is_refused_with_its_step() -> None:
    with pytest.raises(ValueError, match="at step 600"):
        SET({"type": "linear", "init": 0.4, "slope": 0.001}, update={"freq": 100, "stop": 2000})


def test_drop_fraction_schedule_leaving_unit_interval_is_refused() -> None:
    with pytest.raises(ValueError, match=r"drop_fraction schedule .* gives -?[0-9.]+ at step \d+"):
        RigL(
            0.8,
            update={"freq": 10, "stop": 1000},
            drop_fraction={"type": "linear", "init": 0.3, "slope": -0.001},
        )


def test_granet_needs_a_nondecreasing_schedule() -> None:
    with pytest.raises(ValueError, match="decreases"):
        GraNet(cubic(0.2, 100, init=0.8), update={"freq": 10})


def test_static_rejects_out_of_range_sparsity_before_any_model() -> None:
    for bad in (1.0, 1.2, -0.1):
        with pytest.raises(ValueError, match=rf"sparsity={bad}"):
            Static(bad)


def test_open_ended_schedule_is_checked_up_to_max_steps_at_setup(tmp_path) -> None:  # noqa: ANN001
    """No cadence end: Lightning's ``max_steps`` is the range, checked before the first step."""
    from lightning_sparse import RigL as RigLCallback

    schedule = {"type": "linear", "init": 0.5, "slope": 0.01}  # reaches 1.0 at step 50
    callback = RigLCallback(schedule, update={"freq": 5})  # fine at build: no known end
    module = TinyLM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match="at step 50"):
        trainer(tmp_path, max_steps=80, callbacks=[callback]).fit(module, token_loader())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert not callback.sparse_params


def test_value_is_checked_again_when_used() -> None:
    """A plain loop past every horizon: the update raises a clear error, masks untouched."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    sparsity = SET({"type": "linear", "init": 0.5, "slope": 0.2}, update={"freq": 1}, seed=0)
    model.apply(sparsity)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sparsity.apply(optimizer)
    with pytest.raises(ValueError, match="at step 3"):
        for _ in range(5):
            masks = {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
    assert sparsity.step == 3 and sparsity.last_update_step == 2  # step 3's update refused
    for name, sp in sparsity.sparse_params.items():
        assert torch.equal(masks[name], sp.mask), name


@pytest.mark.parametrize(("freq", "end"), [(300, 1000), (7, 50), (100, 100), (64, 1)])
def test_gmp_reaches_its_final_sparsity_whatever_the_cadence(freq: int, end: int) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    sparsity = GMP(cubic(0.8, end), update={"freq": freq})
    model.apply(sparsity)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sparsity.apply(optimizer)
    for _ in range(end + 1):  # the update for step `end` runs before optimizer step end + 1
        model(torch.randn(4, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert sparsity.last_update_step == end
    for name, sp in sparsity.sparse_params.items():
        assert sparsity.mask_target(name) == 0.8
        assert int(sp.mask.sum()) == int(0.2 * sp.mask.numel()), name
    assert math.isclose(sparsity.overall_sparsity()[0], 0.8)


def test_static_itop_rate_is_its_density() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    sparsity = Static(0.75, seed=0)
    model.apply(sparsity)
    assert math.isclose(float(sparsity.itop_rate()), 0.25, abs_tol=1e-6)
