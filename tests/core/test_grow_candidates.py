"""`DropAndGrow.grow_candidates`: what a mask update reads of the dense gradient outside
the mask. RigL and GraNet grow the same positions from a gradient that keeps, outside the mask,
only the top ``grow_candidates`` positions by ``|grad|`` (ties to the lower index) and is zero
elsewhere: what the device keeps in place of the dense gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sparse.core import SET, DropAndGrow, GraNet, RigL, SparsityAlgorithm, Static
from lightning_sparse.core.shapers import OutputGroups


def _top_outside(grad: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """``grad`` at the kept positions and at its top ``count`` outside the mask (by |grad|,
    ties to the lower index: a stable sort), zero elsewhere; by a full sort, independently of
    the device's selection."""
    flat, outside = grad.reshape(-1), ~mask.reshape(-1)
    score = torch.where(outside, flat.abs(), torch.full_like(flat, -1.0))
    order = torch.sort(score, descending=True, stable=True).indices[:count]
    keep = mask.reshape(-1).clone()
    keep[order] = True
    return torch.where(keep, flat, torch.zeros_like(flat)).view_as(grad)


def _algorithms() -> dict[str, SparsityAlgorithm]:
    return {
        "rigl": RigL(0.8, update={"freq": 2}, drop_fraction=0.3, seed=0),
        "rigl-drop-all": RigL(0.8, update={"freq": 2}, drop_fraction=1.0, seed=0),
        "granet": GraNet(
            {"type": "cubic", "init": 0.5, "final": 0.9, "begin": 0, "end": 6},
            update={"freq": 2},
            drop_fraction=0.3,
            seed=0,
        ),
    }


@pytest.mark.parametrize("kind", ["rigl", "rigl-drop-all", "granet"])
@pytest.mark.parametrize("ties", [False, True])
def test_the_update_grows_the_same_from_the_top_candidates_only(kind: str, ties: bool) -> None:
    masks = {}
    for trimmed in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 20))
        algorithm = _algorithms()[kind]
        model.apply(algorithm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        algorithm.apply(optimizer)
        algorithm.autoupdate = False
        algorithm.step = 2
        assert algorithm.dense_grad_needed
        generator = torch.Generator().manual_seed(1)
        for name, sp in algorithm.sparse_params.items():
            grad = torch.randn(sp.param.shape, generator=generator)
            if ties:  # many equal magnitudes: the cut falls inside a tie
                grad = grad.round()
            count = algorithm.grow_candidates(name)
            assert count is not None and 0 < count <= int((~sp.mask).sum())
            sp.param.grad = _top_outside(grad, sp.mask, count) if trimmed else grad
        algorithm.update()
        masks[trimmed] = [sp.mask.clone() for sp in algorithm.sparse_params.values()]
    assert all(torch.equal(a, b) for a, b in zip(masks[False], masks[True], strict=True))


def test_a_smaller_count_would_change_the_masks() -> None:
    """The count is tight: with a gradient that is zero at the kept positions (so no dropped
    weight is grown back), one candidate fewer grows a different mask."""
    torch.manual_seed(0)
    layer = nn.Linear(40, 30)
    algorithm = RigL(0.8, update={"freq": 2}, drop_fraction=0.3, seed=0)
    layer.apply(algorithm)
    algorithm.apply(torch.optim.SGD(layer.parameters(), lr=0.1))
    algorithm.autoupdate = False
    algorithm.step = 2
    ((name, sp),) = algorithm.sparse_params.items()
    before = sp.mask.clone()
    grad = torch.randn(sp.param.shape, generator=torch.Generator().manual_seed(1)) * ~before
    count = algorithm.grow_candidates(name)
    sp.param.grad = _top_outside(grad, before, count - 1)
    algorithm.update()
    full = sp.mask.clone()
    sp.mask.copy_(before)
    algorithm.last_update_step = -1
    sp.param.grad = grad
    algorithm.update()
    assert not torch.equal(full, sp.mask)


@pytest.mark.parametrize(
    "algorithm",
    [SET(0.8, update={"freq": 2}), RigL(0.8, update={"freq": 2}, shaper=OutputGroups(2))],
    ids=["set", "rigl-output-groups"],
)
def test_rules_that_read_more_or_nothing_say_none(algorithm: DropAndGrow) -> None:
    layer = nn.Linear(40, 30)
    layer.apply(algorithm)
    assert algorithm.grow_candidates(next(iter(algorithm.sparse_params))) is None


def test_only_drop_and_grow_names_grow_candidates() -> None:
    """The grow count is drop-and-grow's: an algorithm that grows nothing has none (the device
    then keeps the whole dense gradient of an update that reads one)."""
    assert not hasattr(Static(0.8), "grow_candidates")
