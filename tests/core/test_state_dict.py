"""Sparse state in plain PyTorch: the masks are the algorithm's state (packed bits), the model's
``state_dict()`` holds the pruned weights only; `checkpoint_masks`, `restore_masks` and
`strip_masks` read that layout and the one of earlier versions (``<param>_mask`` entries in the
model state dict), and ``load_state_dict`` into a model with sparsity applied takes either.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lightning_sparse.core import RigL, Static, restore_masks, strip_masks
from lightning_sparse.core.state_dict import checkpoint_masks, mask_keys
from tests.helpers import TinyNet, one_thread  # noqa: F401  (autouse fixture)

SPARSE = ("fc1.weight", "fc2.weight")
TOKENS = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))


def sparse_net(seed: int, steps: int, algorithm: str = "rigl") -> tuple[TinyNet, object, object]:
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
    return net, sparsity, optimizer


def owner(net: nn.Module, name: str) -> nn.Module:
    return net.get_submodule(name.rpartition(".")[0])


def assert_sparse_like(net: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """``net`` carries ``masks`` bit-exactly and is zero where they prune."""
    for name in SPARSE:
        module = owner(net, name)
        mask = module.weight_mask
        assert mask.dtype == torch.bool and torch.equal(mask, masks[name]), name
        assert torch.equal(module.weight.detach()[~mask], torch.zeros(int((~mask).sum()))), name


def old_layout(state: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> dict:
    """The state dict an earlier version saved: the masks as ``<param>_mask`` entries."""
    out = dict(state)
    for name, mask in masks.items():
        out[f"{name}_mask"] = mask.clone()
    return out


@pytest.fixture(scope="module")
def trained() -> dict[str, object]:
    net, sparsity, optimizer = sparse_net(seed=0, steps=3)
    with torch.no_grad():
        logits = net(TOKENS)
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "sparsity": sparsity.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # what a user's file holds
    masks = {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}
    state = {k: v.clone() for k, v in net.state_dict().items()}
    return {
        "net": net,
        "saved": saved,
        "masks": masks,
        "state": state,
        "logits": logits,
        "old": old_layout(state, masks),
    }


def test_the_model_state_dict_holds_no_masks_and_the_algorithm_state_packs_them(trained) -> None:
    saved, masks = trained["saved"], trained["masks"]
    assert not [k for k in saved["model"] if k.endswith("_mask")]
    assert set(saved["sparsity"]["masks"]) == set(SPARSE)
    for name in SPARSE:
        packed = saved["sparsity"]["masks"][name]
        assert packed.dtype == torch.uint8 and packed.numel() == (masks[name].numel() + 7) // 8
        assert not masks[name].all()
        weight = saved["model"][name]
        assert torch.equal(weight[~masks[name]], torch.zeros(int((~masks[name]).sum())))


def test_mask_keys_pairs_masks_with_their_parameters(trained) -> None:
    assert mask_keys(trained["old"]) == {f"{n}_mask": n for n in SPARSE}
    assert mask_keys(trained["state"]) == {}
    assert mask_keys({"a_mask": torch.ones(1)}) == {}  # no "a": not a parameter's mask


@pytest.mark.parametrize("layout", ["saved", "sparsity", "lightning", "old", "old-lightning"])
def test_checkpoint_masks_reads_every_layout(trained, layout: str) -> None:
    saved = trained["saved"]
    source = {
        "saved": saved,
        "sparsity": saved["sparsity"],
        "lightning": {"state_dict": saved["model"], "sparsity": {"RigL": saved["sparsity"]}},
        "old": trained["old"],
        "old-lightning": {"state_dict": trained["old"], "callbacks": {"RigL": {"step": 3}}},
    }[layout]
    got = checkpoint_masks(source)
    assert set(got) == set(SPARSE)
    for name in SPARSE:
        assert got[name].dtype == torch.bool and torch.equal(got[name], trained["masks"][name])
    assert checkpoint_masks(trained["state"]) == {}  # dense: no masks


def test_checkpoint_masks_refuses_a_corrupt_packed_mask(trained) -> None:
    state = copy.deepcopy(trained["saved"]["sparsity"])
    state["masks"]["fc1.weight"] = state["masks"]["fc1.weight"][:-1]
    with pytest.raises(ValueError, match=r"mask 'fc1.weight'.*bytes.*corrupt"):
        checkpoint_masks(state)


def test_strip_masks_loads_into_a_dense_model_and_leaves_the_live_model(trained) -> None:
    net, state, logits = trained["net"], trained["state"], trained["logits"]
    for source in (net, trained["old"]):
        stripped = strip_masks(source)
        assert list(stripped) == list(state)
        for name in SPARSE:
            mask = trained["masks"][name]
            assert torch.equal(stripped[name][~mask], torch.zeros(int((~mask).sum())))
            assert stripped[name].data_ptr() != net.get_parameter(name).data_ptr()  # a copy
        dense = TinyNet()
        dense.load_state_dict(stripped)  # strict
        with torch.no_grad():
            assert torch.equal(dense(TOKENS), logits)
    live = net.state_dict()  # the live model is untouched
    assert live.keys() == state.keys() and all(torch.equal(live[k], state[k]) for k in state)
    assert_sparse_like(net, trained["masks"])


def test_strip_masks_of_a_model_prunes_by_its_mask_buffers() -> None:
    layer = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -2.0], [3.0, 4.0]]))
    layer.register_buffer("weight_mask", torch.tensor([[True, False], [False, True]]), False)
    assert torch.equal(strip_masks(layer)["weight"], torch.tensor([[1.0, 0.0], [0.0, 4.0]]))
    assert layer.weight[0, 1] == -2.0


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


@pytest.mark.parametrize("layout", ["saved", "old"])
def test_restore_masks_then_load_gives_the_sparse_model(trained, layout: str) -> None:
    """New layout: masks from the sparsity state, weights from the model state dict. Old
    layout: ``restore_masks(model, sd); model.load_state_dict(sd)`` loads it as it is."""
    fresh = TinyNet()
    source = trained["saved"] if layout == "saved" else trained["old"]
    assert restore_masks(fresh, source) == [f"{n}_mask" for n in SPARSE]
    fresh.load_state_dict(trained["state"] if layout == "saved" else source)  # strict
    assert_sparse_like(fresh, trained["masks"])
    assert not [k for k in fresh.state_dict() if k.endswith("_mask")]  # non-persistent
    with torch.no_grad():
        assert torch.equal(fresh(TOKENS), trained["logits"])
    assert restore_masks(fresh, source) == []  # present masks are left as they are


def test_restored_masks_take_an_old_state_dict_loaded_later(trained) -> None:
    """A model `restore_masks` gave masks adopts the ``*_mask`` entries of a state dict it
    loads (all checked first), also through a parent module (prefixed keys)."""
    fresh = TinyNet()
    restore_masks(fresh, trained["saved"])
    with torch.no_grad():
        fresh.fc1.weight_mask.fill_(True)
    wrapper = nn.Sequential(fresh)
    wrapper.load_state_dict({f"0.{k}": v for k, v in trained["old"].items()})  # strict
    assert_sparse_like(fresh, trained["masks"])
    bad = {f"0.{k}": v for k, v in trained["old"].items()}
    bad["0.fc2.weight_mask"] = torch.ones(3, dtype=torch.bool)
    with torch.no_grad():
        fresh.fc1.weight_mask.fill_(True)
    with pytest.raises(ValueError, match=r"'0.fc2.weight_mask' has shape \(3,\)"):
        wrapper.load_state_dict(bad)
    assert fresh.fc1.weight_mask.all()  # every entry checked before any was adopted


def test_restore_masks_refuses_a_wrong_shape_before_registering_anything(trained) -> None:
    bad = dict(trained["old"], **{"fc2.weight_mask": torch.ones(3, 5, dtype=torch.bool)})
    fresh = TinyNet()
    with pytest.raises(
        ValueError,
        match=r"'fc2.weight_mask' has shape \(3, 5\) but 'fc2.weight'"
        r" has shape \(24, 40\)",
    ):
        restore_masks(fresh, bad)
    assert not any(name.endswith("_mask") for name, _ in fresh.named_buffers())  # fc1 neither
    other = copy.deepcopy(trained["saved"])
    other["sparsity"]["params"]["fc2.weight"] = [24, 41]  # a packed mask for another shape
    other["sparsity"]["masks"]["fc2.weight"] = torch.zeros(123, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'fc2.weight_mask' has shape \(24, 41\)"):
        restore_masks(fresh, other)
    assert not any(name.endswith("_mask") for name, _ in fresh.named_buffers())


def test_restore_masks_takes_0_1_masks_and_refuses_other_values(trained) -> None:
    old, masks = trained["old"], trained["masks"]
    as_float = dict(old, **{"fc1.weight_mask": old["fc1.weight_mask"].float()})
    fresh = TinyNet()
    restore_masks(fresh, as_float)
    assert fresh.fc1.weight_mask.dtype == torch.bool
    assert torch.equal(fresh.fc1.weight_mask, masks["fc1.weight"])
    half = dict(old, **{"fc2.weight_mask": old["fc2.weight_mask"].float() * 0.5})
    fresh = TinyNet()
    with pytest.raises(ValueError, match="'fc2.weight_mask' holds values other than 0/1"):
        restore_masks(fresh, half)
    assert not any(name.endswith("_mask") for name, _ in fresh.named_buffers())


@pytest.mark.parametrize("layout", ["model-then-sparsity", "sparsity-then-model", "old"])
@pytest.mark.parametrize("algorithm", ["static", "rigl"])
def test_load_into_a_sparse_model_then_a_step_keeps_the_loaded_masks(
    trained, algorithm: str, layout: str
) -> None:
    masks, saved = trained["masks"], trained["saved"]
    net, sparsity, optimizer = sparse_net(seed=5, steps=2, algorithm=algorithm)  # other masks
    newly_pruned = {n: owner(net, n).weight_mask & ~masks[n] for n in SPARSE}
    assert all(m.any() for m in newly_pruned.values())  # the step could revive these
    if layout == "old":
        net.load_state_dict(trained["old"])
    else:
        state = dict(
            saved["sparsity"], config=sparsity.config(), algorithm=type(sparsity).__name__.lower()
        )  # the masks of another configuration's run
        if layout == "model-then-sparsity":
            net.load_state_dict(saved["model"])
            sparsity.load_state_dict(state)
        else:
            sparsity.load_state_dict(state)
            net.load_state_dict(saved["model"])
    assert_sparse_like(net, masks)
    for name in SPARSE:  # bit-exact, either order
        assert torch.equal(net.get_parameter(name).detach(), trained["state"][name]), name
    with torch.no_grad():
        assert torch.equal(net(TOKENS), trained["logits"])
    net(TOKENS).square().mean().backward()
    optimizer.step()
    assert_sparse_like(net, masks)  # the step used the loaded masks, not the old ones
    for name in SPARSE:
        param = net.get_parameter(name)
        for value in optimizer.state[param].values():
            if value.shape == param.shape:
                assert not value[~masks[name]].any(), name
        assert param.detach()[newly_pruned[name]].eq(0).all()


def test_a_write_between_model_and_sparsity_load_is_not_undone(trained) -> None:
    """The values a model load zeroed are put back only while the weight is unchanged."""
    saved = trained["saved"]
    net, sparsity, _ = sparse_net(seed=5, steps=1)
    net.load_state_dict(saved["model"])
    with torch.no_grad():
        net.fc1.weight.fill_(0.5)
    state = dict(saved["sparsity"], config=sparsity.config())
    sparsity.load_state_dict(state)
    keep = trained["masks"]["fc1.weight"]
    expected = torch.where(keep, 0.5, 0.0)
    assert torch.equal(net.fc1.weight.detach(), expected)
    assert torch.equal(net.fc2.weight.detach(), trained["state"]["fc2.weight"])


def test_an_algorithm_replaces_restored_masks_and_from_zeros_keeps_their_pattern(trained) -> None:
    """Masks no algorithm owns (restored from a checkpoint) are replaced, not refused."""
    torch.manual_seed(5)
    fresh = TinyNet()
    restore_masks(fresh, trained["saved"])
    fresh.load_state_dict(trained["state"])
    sparsity = Static(0.5, param_filter=["fc*.weight"], init_method="from_zeros")
    fresh.apply(sparsity)
    assert sorted(sparsity.sparse_params) == sorted(SPARSE)
    assert_sparse_like(fresh, trained["masks"])
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    fresh(TOKENS).square().mean().backward()
    optimizer.step()
    assert_sparse_like(fresh, trained["masks"])  # the algorithm now owns the loaded pattern


def test_a_deep_copy_of_a_sparse_model_takes_a_new_algorithm_but_an_owned_mask_is_refused(
    trained,
) -> None:
    twin = copy.deepcopy(trained["net"])  # carries the masks; no algorithm owns the copy's
    sparsity = Static(0.5, param_filter=["fc*.weight"], init_method="from_zeros")
    twin.apply(sparsity)
    assert_sparse_like(twin, trained["masks"])
    with pytest.raises(RuntimeError, match="already has a mask"):
        twin.apply(Static(0.3, param_filter=["fc*.weight"]))
    assert_sparse_like(twin, trained["masks"])
