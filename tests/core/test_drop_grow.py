"""`algorithms/drop_grow.py`'s rule where it lives: the one drop count (hand-computed, int and
per-row tensor alike) and its users (the per-weight path, the stacked path of same-shape weights,
the device's grow count) agreeing with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sparse.core import SET, GraNet, RigL
from lightning_sparse.core.algorithms.drop_grow import DropAndGrow, drop_count


@pytest.mark.parametrize(
    ("active", "n_total", "drop", "prune_to_target", "expected"),
    [
        (10, 10, 0.3, False, 3),  # 10 - int(0.7 * 10)
        (10, 10, 0.25, False, 3),  # 10 - int(7.5): truncated
        (12, 10, 0.3, False, 4),  # a denser row drops from its own count: 12 - int(8.4)
        (12, 10, 0.3, True, 5),  # GraNet: the surplus too, 12 - int(0.7 * 10)
        (8, 10, 0.5, True, 4),  # below the target the cap changes nothing
        (10, 10, 0.0, False, 0),
        (10, 10, 1.0, False, 10),
        (10, 10, 1.5, False, 10),  # clamped to [0, 1]
        (0, 10, 0.3, False, 0),
    ],
)
def test_drop_count_hand_cases_and_the_same_per_row(
    active: int, n_total: int, drop: float, prune_to_target: bool, expected: int
) -> None:
    assert drop_count(active, n_total, drop, prune_to_target) == expected
    rows = torch.tensor([active, active], dtype=torch.int32)
    per_row = drop_count(rows, n_total, drop, prune_to_target)
    assert per_row.dtype == torch.int64 and per_row.tolist() == [expected, expected]


class TwoLayers(nn.Module):
    """Two same-shape weights: one stack for the stacked path, unless their counts differ."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8, bias=False)
        self.b = nn.Linear(16, 8, bias=False)


def _masks_keeping(counts: dict[str, int], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Masks keeping the first ``count`` positions of every row."""
    return {
        name: (torch.arange(shape[1]) < count).expand(shape).clone()
        for name, count in counts.items()
    }


@pytest.mark.parametrize("algorithm", ["rigl", "set", "granet"])
@pytest.mark.parametrize(
    "counts",
    [{"a.weight": 6, "b.weight": 6}, {"a.weight": 6, "b.weight": 9}],
    ids=["same-counts", "different-counts"],
)
def test_each_weight_of_a_stack_gets_the_mask_it_gets_alone(
    algorithm: str, counts: dict[str, int]
) -> None:
    """Same-shape weights at one target are updated together only where every row of every
    mask keeps one count; two masks keeping different counts must each equal the single-weight
    update (`mask_of` without the counts read for the stack)."""
    torch.manual_seed(0)
    model = TwoLayers()
    target = {"type": "cubic", "init": 0.5, "final": 0.6, "begin": 0, "end": 4}
    sparsity: DropAndGrow = {
        "rigl": lambda: RigL(0.5, update={"freq": 2}, seed=3),
        "set": lambda: SET(0.5, update={"freq": 2}, seed=3),
        "granet": lambda: GraNet(target, update={"freq": 2}, seed=3),
    }[algorithm]()
    model.apply(sparsity)
    for name, mask in _masks_keeping(counts, (8, 16)).items():
        sparsity.sparse_params[name].mask.copy_(mask)
    for layer in (model.a, model.b):
        layer.weight.grad = torch.randn_like(layer.weight)
    sparsity.step = 2
    targets = {name: sparsity.target_sparsity(name, 2) for name in sparsity.sparse_params}
    together = sparsity.compute_masks(targets)
    for name in sparsity.sparse_params:
        alone = sparsity.mask_of(name, targets[name])
        assert torch.equal(together[name], alone), name
        assert not torch.equal(alone, sparsity.sparse_params[name].mask), f"{name}: no update"


def test_grow_candidates_is_the_drop_counts_grow_count() -> None:
    """The device's grow count: the target minus the survivors of the drop (`drop_count`),
    capped at the positions outside the mask."""
    layer = nn.Linear(10, 10, bias=False)
    sparsity = RigL(0.8, update={"freq": 2}, drop_fraction=0.3, seed=0)
    layer.apply(sparsity)
    sp = sparsity.sparse_params["weight"]
    sparsity.step = 2
    assert sparsity.grow_candidates("weight") == 20 - (20 - drop_count(20, 20, 0.3, False))
    sp.mask.fill_(False)
    sp.mask.view(-1)[:30] = True  # a denser mask (30 kept): it only shrinks to the target
    assert sparsity.grow_candidates("weight") == max(20 - (30 - drop_count(30, 20, 0.3, False)), 0)
