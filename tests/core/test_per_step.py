"""The per-step path at dense cost (`lightning_sparse.core.per_step`), checked for what it does,
not for how fast it is:

- a sparse step equals, bit for bit, a plain loop that masks by hand (gradients before the step,
  weights too), for Adam/AdamW with and without amsgrad or weight decay: holding Adam's pruned
  denominators at 1.0 during the step changes nothing, and never shows (after a step, in a state
  dict saved by a step that raised, after an optimizer-state load);
- an ordinary step masks gradients in backward and the weights in one fused pass, and touches
  the optimizer state only where Adam's denominators are held: it is pruned again only when
  masks, parameters or the state itself change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sparse import RigL, Static
from lightning_sparse.core import per_step
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.1),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.02, amsgrad=True),
    "adam_l2": lambda p: torch.optim.Adam(p, lr=0.02, weight_decay=0.05),
    "adam_foreach_maximize": lambda p: torch.optim.Adam(p, lr=0.02, foreach=True, maximize=True),
}


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def loss(model: nn.Module, t: int) -> torch.Tensor:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
    target = torch.randn(8, 3, generator=torch.Generator().manual_seed(100 + t))
    return (model(x) - target).pow(2).mean()


def assert_exactly_equal(a: Any, b: Any, what: str) -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b), what
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{what}: bits (+0 / -0)"
    else:
        assert a == b, what


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_sparse_step_equals_masking_by_hand_bit_for_bit(name: str) -> None:
    sparse, reference = mlp(0), mlp(0)
    sparsity = Static(0.7, seed=3)
    sparse.apply(sparsity)
    masks = {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}
    optimizer = OPTIMIZERS[name](sparse.parameters())
    sparsity.apply(optimizer)
    ref_optimizer = OPTIMIZERS[name](reference.parameters())
    ref_params = dict(reference.named_parameters())
    zero = torch.zeros(())
    for t in range(6):
        optimizer.zero_grad()
        loss(sparse, t).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        with torch.no_grad():  # the reference: pruned weights and gradients +0.0, then a step
            for n, mask in masks.items():
                ref_params[n].copy_(torch.where(mask, ref_params[n], zero))
        loss(reference, t).backward()
        for n, mask in masks.items():
            ref_params[n].grad = torch.where(mask, ref_params[n].grad, zero)
        ref_optimizer.step()
        for n, p in sparse.named_parameters():
            assert_exactly_equal(p.detach(), ref_params[n].detach(), f"step {t + 1}: {n}")
            state, ref_state = optimizer.state[p], ref_optimizer.state[ref_params[n]]
            for key, value in state.items():
                assert_exactly_equal(value, ref_state[key], f"step {t + 1}: {n} {key}")
    assert not torch.equal(sparse[0].weight, mlp(0)[0].weight * masks["0.weight"])  # it trained


def test_held_denominators_never_show() -> None:
    """Adam's pruned ``exp_avg_sq`` entries are 1.0 only inside ``optimizer.step()``: a step that
    raises leaves them held, but a state dict saved then shows zeros, and the next step (or an
    optimizer-state load) releases them."""
    model = mlp(1)
    sparsity = Static(0.6, seed=0)
    model.apply(sparsity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    sparsity.apply(optimizer)

    def pruned_state_entries() -> int:
        return sum(
            int(value[~sp.mask].count_nonzero())
            for sp in sparsity.sparse_params.values()
            for value in optimizer.state[sp.param].values()
            if value.shape == sp.param.shape
        )

    for t in range(2):
        optimizer.zero_grad()
        loss(model, t).backward()
        optimizer.step()
    assert pruned_state_entries() == 0

    def failing_closure() -> torch.Tensor:
        seen.append(pruned_state_entries())  # inside step(): held
        raise RuntimeError("closure failed")

    seen: list[int] = []
    with pytest.raises(RuntimeError, match="closure failed"):
        optimizer.step(failing_closure)
    assert seen and seen[0] > 0, "the denominators were not held during the step"
    saved = optimizer.state_dict()
    for sp in sparsity.sparse_params.values():
        index = [id(p) for p in model.parameters()].index(id(sp.param))
        for key in ("exp_avg_sq", "max_exp_avg_sq"):
            assert not saved["state"][index][key][~sp.mask].any(), key
    assert pruned_state_entries() == 0
    optimizer.zero_grad()
    loss(model, 3).backward()
    optimizer.step()
    assert pruned_state_entries() == 0
    for sp in sparsity.sparse_params.values():
        assert not sp.param.detach()[~sp.mask].any()


def test_an_ordinary_step_makes_one_weight_pass_and_prunes_state_only_when_masks_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, int]] = []
    state: list[int] = []
    zero, fill = per_step.zero_pruned_foreach_, per_step.fill_pruned_foreach_
    same_shape_state = per_step.same_shape_state

    def counting_zero(tensors: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        calls.append(("zero", len(tensors)))
        zero(tensors, masks)

    def counting_fill(tensors: list[torch.Tensor], masks: list[torch.Tensor], value: float) -> None:
        calls.append(("fill", len(tensors)))
        fill(tensors, masks, value)

    def counting_state(optimizer: Any, sps: Any) -> Any:
        state.append(len(sps))
        return same_shape_state(optimizer, sps)

    monkeypatch.setattr(per_step, "zero_pruned_foreach_", counting_zero)
    monkeypatch.setattr(per_step, "fill_pruned_foreach_", counting_fill)
    monkeypatch.setattr(per_step, "same_shape_state", counting_state)
    model = mlp(2)
    sparsity = RigL(0.7, update={"freq": 3}, seed=0)
    model.apply(sparsity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sparsity.apply(optimizer)
    for t in range(5):
        calls.clear()
        state.clear()
        optimizer.zero_grad()
        loss(model, t).backward()
        optimizer.step()
        if t == 3:  # the update step: masks changed, so gradients and state are pruned again
            # (the weights once when the new masks are installed, then weights and gradients)
            assert state == [3] and calls[:2] == [("zero", 3), ("zero", 6)], calls
        elif t in (2, 4):  # (step 1 creates Adam's state, which step 2 prunes once)
            # The gradients (3) in one pass when backward produced the last; the weights (3) in
            # one pass before the step; Adam's exp_avg_sq held (3) and released (3); the state
            # is left alone.
            expected = [("zero", 3), ("zero", 3), ("fill", 3), ("zero", 3)]
            assert calls == expected, f"step {t}: {calls}"
            assert state == [], f"step {t}: the state was pruned on an ordinary step"
    for sp in sparsity.sparse_params.values():
        for value in optimizer.state[sp.param].values():
            if value.shape == sp.param.shape:
                assert not value[~sp.mask].any()
