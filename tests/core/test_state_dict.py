"""Sparse state dicts in plain PyTorch: `strip_masks`, `restore_masks`, and ``load_state_dict``
into a model with sparsity applied (the masks become the state dict's; the next step keeps them).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sparse.core import RigL, Static, restore_masks, strip_masks
from lightning_sparse.core.state_dict import mask_keys
from tests.helpers import TinyNet, one_thread  # noqa: F401  (autouse fixture)

SPARSE = ("fc1.weight", "fc2.weight")
TOKENS = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))


def sparse_net(
    seed: int, steps: int, algorithm: str = "rigl"
) -> tuple[TinyNet, torch.optim.Optimizer]:
    """A TinyNet 50% sparse (fc1, fc2) trained ``steps`` AdamW steps; RigL updates its masks
    after every step but the last (``stop=steps``), so the next step is no update step."""
    torch.manual_seed(seed)
    net = TinyNet()
    if algorithm == "rigl":
        sparsity = RigL(0.5, update={"freq": 1, "stop": steps}, param_filter=["fc*.weight"])
    else:
        sparsity = Static(0.5, param_filter=["fc*.weight"])
    net.apply(sparsity)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    for _ in range(steps):
        net(TOKENS).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return net, optimizer


def owner(net: nn.Module, name: str) -> nn.Module:
    return net.get_submodule(name.rpartition(".")[0])


def assert_sparse_like(net: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``net`` carries ``state``'s masks bit-exactly and is zero where they prune."""
    for name in SPARSE:
        module = owner(net, name)
        mask = module.weight_mask
        assert mask.dtype == torch.bool and torch.equal(mask, state[f"{name}_mask"]), name
        assert torch.equal(module.weight.detach()[~mask], torch.zeros(int((~mask).sum()))), name


@pytest.fixture(scope="module")
def trained() -> tuple[TinyNet, dict[str, torch.Tensor], torch.Tensor]:
    net, _ = sparse_net(seed=0, steps=3)
    with torch.no_grad():
        logits = net(TOKENS)
    return net, {k: v.clone() for k, v in net.state_dict().items()}, logits


def test_mask_keys_pairs_masks_with_their_parameters(trained) -> None:
    _, state, _ = trained
    assert mask_keys(state) == {f"{n}_mask": n for n in SPARSE}
    assert mask_keys({"a_mask": torch.ones(1)}) == {}  # no "a": not a parameter's mask


def test_strip_masks_loads_into_a_dense_model_and_leaves_the_live_model(trained) -> None:
    net, state, logits = trained
    stripped = strip_masks(net)
    assert list(stripped) == [k for k in state if not k.endswith("_mask")]
    for name in SPARSE:
        mask = state[f"{name}_mask"]
        assert not mask.all()
        assert torch.equal(stripped[name][~mask], torch.zeros(int((~mask).sum())))
        assert stripped[name].data_ptr() != net.get_parameter(name).data_ptr()  # a copy
    dense = TinyNet()
    dense.load_state_dict(stripped)  # strict
    with torch.no_grad():
        assert torch.equal(dense(TOKENS), logits)
    live = net.state_dict()  # the live model is untouched: masks and weights as before
    assert live.keys() == state.keys() and all(torch.equal(live[k], state[k]) for k in state)


def test_strip_masks_zeroes_pruned_weights_without_touching_the_source() -> None:
    weight = torch.tensor([[1.0, -2.0], [float("nan"), 4.0]])
    mask = torch.tensor([[True, False], [False, True]])
    source = {"w": weight, "w_mask": mask, "b": torch.ones(2)}
    out = strip_masks(source)
    assert list(out) == ["w", "b"] and out["b"] is source["b"]
    assert torch.equal(out["w"], torch.tensor([[1.0, 0.0], [0.0, 4.0]]))
    assert torch.isnan(weight[1, 0]) and weight[0, 1] == -2.0  # the source keeps its values


def test_strip_masks_refuses_a_corrupt_mask_naming_it() -> None:
    weight = torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"'w_mask' has shape \(4,\) but 'w' has shape \(2, 2\)"):
        strip_masks({"w": weight, "w_mask": torch.ones(4, dtype=torch.bool)})
    with pytest.raises(ValueError, match="'w_mask' holds values other than 0/1"):
        strip_masks({"w": weight, "w_mask": torch.full((2, 2), 0.5)})
    out = strip_masks({"w": weight, "w_mask": torch.tensor([[1.0, 0.0], [0.0, 1.0]])})
    assert torch.equal(out["w"], torch.eye(2))


def test_restore_masks_then_load_gives_the_sparse_model(trained) -> None:
    _, state, logits = trained
    fresh = TinyNet()
    assert restore_masks(fresh, state) == [f"{n}_mask" for n in SPARSE]
    fresh.load_state_dict(state)  # strict: the masks are expected keys now
    assert_sparse_like(fresh, state)
    with torch.no_grad():
        assert torch.equal(fresh(TOKENS), logits)
    assert restore_masks(fresh, state) == []  # present masks are left to load_state_dict


def test_restore_masks_refuses_a_wrong_shape_before_registering_anything(trained) -> None:
    _, state, _ = trained
    bad = dict(state, **{"fc2.weight_mask": torch.ones(3, 5, dtype=torch.bool)})
    fresh = TinyNet()
    with pytest.raises(
        ValueError,
        match=r"'fc2.weight_mask' has shape \(3, 5\) but 'fc2.weight'"
        r" has shape \(24, 40\)",
    ):
        restore_masks(fresh, bad)
    assert not any(name.endswith("_mask") for name, _ in fresh.named_buffers())  # fc1 neither


def test_restore_masks_takes_0_1_masks_and_refuses_other_values(trained) -> None:
    _, state, _ = trained
    as_float = dict(state, **{"fc1.weight_mask": state["fc1.weight_mask"].float()})
    fresh = TinyNet()
    restore_masks(fresh, as_float)
    assert fresh.fc1.weight_mask.dtype == torch.bool
    assert torch.equal(fresh.fc1.weight_mask, state["fc1.weight_mask"])
    half = dict(state, **{"fc2.weight_mask": state["fc2.weight_mask"].float() * 0.5})
    fresh = TinyNet()
    with pytest.raises(ValueError, match="'fc2.weight_mask' holds values other than 0/1"):
        restore_masks(fresh, half)
    assert not any(name.endswith("_mask") for name, _ in fresh.named_buffers())


@pytest.mark.parametrize("algorithm", ["static", "rigl"])
def test_load_into_a_sparse_model_then_a_step_keeps_the_loaded_masks(trained, algorithm) -> None:
    _, state, logits = trained
    net, optimizer = sparse_net(seed=5, steps=2, algorithm=algorithm)  # other masks, Adam state
    newly_pruned = {n: owner(net, n).weight_mask & ~state[f"{n}_mask"] for n in SPARSE}
    assert all(m.any() for m in newly_pruned.values())  # the step could revive these
    net.load_state_dict(state)
    assert_sparse_like(net, state)
    with torch.no_grad():
        assert torch.equal(net(TOKENS), logits)
    net(TOKENS).square().mean().backward()
    optimizer.step()
    assert_sparse_like(net, state)  # the step used the loaded masks, not the old ones
    for name in SPARSE:
        param = net.get_parameter(name)
        for value in optimizer.state[param].values():
            if value.shape == param.shape:
                assert not value[~state[f"{name}_mask"]].any(), name
        assert param.detach()[newly_pruned[name]].eq(0).all()


def test_an_algorithm_replaces_restored_masks_and_from_zeros_keeps_their_pattern(trained) -> None:
    """Masks no algorithm owns (restored from a checkpoint) are replaced, not refused."""
    _, state, _ = trained
    torch.manual_seed(5)
    fresh = TinyNet()
    restore_masks(fresh, state)
    fresh.load_state_dict(state)
    sparsity = Static(0.5, param_filter=["fc*.weight"], init_method="from_zeros")
    fresh.apply(sparsity)
    assert sorted(sparsity.sparse_params) == sorted(SPARSE)
    assert_sparse_like(fresh, state)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    fresh(TOKENS).square().mean().backward()
    optimizer.step()
    assert_sparse_like(fresh, state)  # the algorithm now owns and enforces the loaded pattern


def test_a_deep_copy_of_a_sparse_model_takes_a_new_algorithm_but_an_owned_mask_is_refused(
    trained,
) -> None:
    import copy

    net, state, _ = trained
    twin = copy.deepcopy(net)  # carries the masks; no algorithm owns the copy's
    sparsity = Static(0.5, param_filter=["fc*.weight"], init_method="from_zeros")
    twin.apply(sparsity)
    assert_sparse_like(twin, state)
    with pytest.raises(RuntimeError, match="already has a mask"):
        twin.apply(Static(0.3, param_filter=["fc*.weight"]))
    assert_sparse_like(twin, state)
