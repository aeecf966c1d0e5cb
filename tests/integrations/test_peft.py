"""PEFT (LoRA) on a sparse base: the frozen base weights keep fixed masks and stay exactly sparse
while dense adapters train (plain loop and Lightning), whether sparsity is applied after
``get_peft_model`` (``param_filter="*base_layer.weight"``) or before it; what merging gives
(``merge_and_unload`` then ``densify``, re-pruning with the old masks, or new top-k masks)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_sparse import RigL as LitRigL  # noqa: E402
from lightning_sparse.core import RigL, Static, densify, strip_masks  # noqa: E402
from lightning_sparse.models import LitCausalLM  # noqa: E402
from lightning_sparse.models.hf import HFCausalLM  # noqa: E402
from tests.helpers import hf_llama_fields, one_torch_thread, trainer  # noqa: E402

LLAMA = hf_llama_fields()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE = "*base_layer.weight"  # the frozen weights LoRA wraps
EVERY_STEP = {"freq": 1}  # RigL would update every step: frozen masks must not move


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def with_lora(model: nn.Module) -> nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
    return peft.get_peft_model(model, config)


def tokens(n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4, 9), generator=g) for _ in range(n)]


def train(model: nn.Module, sparsity: RigL | Static, steps: int = 6) -> None:
    """AdamW on the trainable (adapter) parameters, with the sparsity's per-step hooks."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sparsity.apply(optimizer)
    for batch in tokens(steps):
        logits = model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def snapshot(sparsity: RigL | Static) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        n: (sp.param.detach().clone(), sp.mask.clone()) for n, sp in sparsity.sparse_params.items()
    }


def assert_base_unchanged_and_exactly_sparse(
    sparsity: RigL | Static, before: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    assert set(sparsity.sparse_params) == set(before)
    for name, sp in sparsity.sparse_params.items():
        weight, mask = before[name]
        assert not sp.param.requires_grad
        assert torch.equal(sp.mask, mask), name  # fixed mask
        assert torch.equal(sp.param, weight), name  # frozen: bit-identical
        assert int((sp.param == 0).sum()) == int((~mask).sum()) == mask.numel() // 2, name


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def assert_adapters_trained(before: dict[str, torch.Tensor], model: nn.Module) -> None:
    after = adapters(model)
    assert after.keys() == before.keys() and len(after) == 2 * len(TARGETS) * 2
    assert all(not torch.equal(after[n], before[n]) for n in after)  # every A and B moved


def logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch).logits


# ---------------------------------------------------------------- after get_peft_model


def with_lora_and_saved_modules(model: nn.Module) -> nn.Module:
    """LoRA on every projection but ``down_proj``, whose layers are trained as full copies
    (``modules_to_save``: trainable 2-D weights that are not base weights)."""
    config = peft.LoraConfig(
        r=4, target_modules=TARGETS[:-1], modules_to_save=["down_proj"], lora_dropout=0.0
    )
    return peft.get_peft_model(model, config)


def test_default_filter_never_selects_peft_adapters_and_warns_of_the_frozen_base(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With LoRA the base weights are frozen, so the default filter selects nothing trainable:
    before, it silently sparsified the LoRA A/B weights and the ``modules_to_save`` copies."""
    model = with_lora_and_saved_modules(llama())
    adapters_before = {
        n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad
    }
    assert any(".lora_A." in n for n in adapters_before)
    assert any(".modules_to_save." in n for n in adapters_before)
    sparsity = Static(0.5)
    with caplog.at_level(logging.WARNING, logger="lightning_sparse"):
        with pytest.warns(UserWarning, match="no parameter"):
            model.apply(sparsity)
    assert not sparsity.sparse_params
    assert all(
        torch.equal(p, adapters_before[n])
        for n, p in model.named_parameters()
        if n in adapters_before
    )
    frozen = [r for r in caplog.records if "frozen parameter(s) dense" in r.getMessage()]
    assert len(frozen) == 1 and frozen[0].levelno == logging.WARNING
    message = frozen[0].getMessage()
    # 6 LoRA-wrapped projections and the frozen original of the saved down_proj, per layer.
    assert "left 14 frozen parameter(s) dense: " in message and "and 11 more" in message
    assert "'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight'" in message
    assert 'param_filter="*base_layer.weight"' in message


def test_default_filter_selects_exactly_the_trainable_base_weights_of_a_peft_model() -> None:
    """Base weights made trainable again are ordinary weights; adapters never are."""
    model = with_lora_and_saved_modules(llama())
    unfrozen = {
        n
        for n, p in model.named_parameters()
        if n.endswith("q_proj.base_layer.weight") or n.endswith("down_proj.original_module.weight")
    }
    for name, p in model.named_parameters():
        p.requires_grad_(p.requires_grad or name in unfrozen)
    sparsity = Static(0.5)
    model.apply(sparsity)
    assert set(sparsity.sparse_params) == unfrozen and len(unfrozen) == 4


def test_default_filter_skips_the_adapters_of_other_tuners() -> None:
    """LoHa's ``hada_*`` factors (2-D, trainable) are found by peft's tuner-layer class."""
    config = peft.LoHaConfig(r=4, target_modules=TARGETS)
    model = peft.get_peft_model(llama(), config)
    assert any(".hada_w1_a." in n and p.ndim == 2 for n, p in model.named_parameters())
    for name, p in model.named_parameters():
        p.requires_grad_(p.requires_grad or name.endswith("o_proj.base_layer.weight"))
    sparsity = Static(0.5)
    model.apply(sparsity)
    assert set(sparsity.sparse_params) == {
        f"base_model.model.model.layers.{i}.self_attn.o_proj.base_layer.weight" for i in range(2)
    }


def test_after_peft_base_stays_exactly_sparse_while_adapters_train_plain_loop() -> None:
    model = with_lora(llama())
    sparsity = RigL(0.5, update=EVERY_STEP, param_filter=BASE)
    model.apply(sparsity)
    assert len(sparsity.sparse_params) == 2 * len(TARGETS)
    assert all(n.endswith(".base_layer.weight") for n in sparsity.sparse_params)
    before, lora_before = snapshot(sparsity), adapters(model)
    train(model, sparsity)
    assert sparsity.step == 6
    assert_base_unchanged_and_exactly_sparse(sparsity, before)
    assert_adapters_trained(lora_before, model)
    # The model and sparsity states load into a fresh wrapped model, masks bit-exact.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = with_lora(llama(seed=1))
    fresh_sparsity = RigL(0.5, update=EVERY_STEP, param_filter=BASE)
    fresh.apply(fresh_sparsity)
    fresh.load_state_dict(state)
    fresh_sparsity.load_state_dict(sparsity.state_dict())
    for name, sp in fresh_sparsity.sparse_params.items():
        assert torch.equal(sp.mask, before[name][1]) and torch.equal(sp.param, before[name][0])


class Snapshot(pl.Callback):
    """The sparse parameters and masks when training starts (after setup applied sparsity)."""

    def __init__(self, sparsity: LitRigL) -> None:
        super().__init__()
        self.sparsity = sparsity
        self.before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = snapshot(self.sparsity)


def test_after_peft_base_stays_exactly_sparse_under_lightning(tmp_path: object) -> None:
    torch.manual_seed(0)
    hf = HFCausalLM(config={"model_type": "llama", **LLAMA})
    hf.model = with_lora(hf.model)
    lit = LitCausalLM(model=hf, lr=1e-2, warmup_steps=1, max_steps=6)
    sparsity = LitRigL(0.5, update=EVERY_STEP, param_filter=BASE)
    probe = Snapshot(sparsity)
    dense = {
        n: p.detach().clone() for n, p in lit.named_parameters() if n.endswith("base_layer.weight")
    }
    lora_before = adapters(lit)
    loader = torch.utils.data.DataLoader(torch.cat(tokens()), batch_size=4)
    fit = trainer(tmp_path, max_steps=6, callbacks=[sparsity, probe])
    fit.fit(lit, loader)
    assert sparsity.step == 6 and fit.global_step == 6
    assert set(sparsity.sparse_params) == set(dense) and len(dense) == 2 * len(TARGETS)
    assert_base_unchanged_and_exactly_sparse(sparsity, probe.before)
    for name, sp in sparsity.sparse_params.items():  # pruned at setup, never touched again
        assert torch.equal(sp.param, torch.where(sp.mask, dense[name], torch.zeros(())))
    assert_adapters_trained(lora_before, lit)


def lora_lit() -> LitCausalLM:
    torch.manual_seed(0)
    hf = HFCausalLM(config={"model_type": "llama", **LLAMA})
    hf.model = with_lora(hf.model)
    return LitCausalLM(model=hf, lr=1e-2, warmup_steps=1, max_steps=6)


def test_after_peft_lightning_resume_keeps_masks_and_base_bit_exact(tmp_path: Path) -> None:
    loader = torch.utils.data.DataLoader(torch.cat(tokens()), batch_size=4)
    first, first_sparsity = lora_lit(), LitRigL(0.5, update=EVERY_STEP, param_filter=BASE)
    fit = trainer(tmp_path, max_steps=3, callbacks=[first_sparsity])
    fit.fit(first, loader)
    fit.save_checkpoint(tmp_path / "mid.ckpt")
    saved = snapshot(first_sparsity)
    # A new process with another torch seed: its masks at setup differ until the checkpoint
    # (the masks, and the algorithm's seed) is loaded.
    second, second_sparsity = lora_lit(), LitRigL(0.5, update=EVERY_STEP, param_filter=BASE)
    torch.manual_seed(7)
    fit = trainer(tmp_path, max_steps=6, callbacks=[second_sparsity])
    fit.fit(second, loader, ckpt_path=tmp_path / "mid.ckpt")
    assert second_sparsity.step == 6 and second_sparsity.seed == first_sparsity.seed
    assert_base_unchanged_and_exactly_sparse(second_sparsity, saved)


# ---------------------------------------------------------------- before get_peft_model


def test_masks_applied_before_peft_move_with_the_wrapped_layer_and_hooks_follow() -> None:
    model = llama()
    sparsity = RigL(0.5, update=EVERY_STEP)  # default filter: the 14 projections, trainable now
    model.apply(sparsity)
    owners = {name: sp.module for name, sp in sparsity.sparse_params.items()}
    wrapped = with_lora(model)
    # peft keeps the original nn.Linear as `base_layer`: the mask buffer is on it.
    for name, module in owners.items():
        path = "base_model.model." + name.removesuffix(".weight")
        assert wrapped.get_submodule(path + ".base_layer") is module
        assert torch.equal(wrapped.get_buffer(path + ".base_layer.weight_mask"), module.weight_mask)
    masks = [k for k, _ in wrapped.named_buffers() if k.endswith("_mask")]
    assert len(masks) == 14 and all(k.endswith(".base_layer.weight_mask") for k in masks)
    assert sparsity.hooks.rebind() is False  # the hooks hold the very parameters and masks
    before, lora_before = snapshot(sparsity), adapters(wrapped)
    train(wrapped, sparsity)  # the optimizer's adapters belong to the sparsified model
    assert sparsity.step == 6
    assert_base_unchanged_and_exactly_sparse(sparsity, before)
    assert_adapters_trained(lora_before, wrapped)


def test_masks_applied_before_peft_load_through_the_wrapper() -> None:
    """An earlier version's state dict (mask entries) finds the masks where peft moved them."""
    model = llama()
    sparsity = Static(0.5)
    model.apply(sparsity)
    wrapped = with_lora(model)
    state = {k: v.clone() for k, v in wrapped.state_dict().items()}
    state.update({k: v.clone() for k, v in wrapped.named_buffers() if k.endswith("_mask")})
    masks = {k: v for k, v in state.items() if k.endswith("base_layer.weight_mask")}
    assert len(masks) == len(sparsity.sparse_params) > 0
    for key in masks:  # other masks, as a checkpoint of a later step would hold
        state[key] = torch.roll(state[key], 1, dims=0)
    wrapped.load_state_dict(state)
    for name, sp in sparsity.sparse_params.items():
        moved = name.replace(".weight", ".base_layer.weight_mask")
        key = next(k for k in masks if k.endswith(moved))
        assert torch.equal(sp.mask, state[key]), name
        assert not sp.param.detach()[~sp.mask].any(), name


# ---------------------------------------------------------------- merging


def trained_after_peft() -> tuple[nn.Module, RigL, dict[str, torch.Tensor]]:
    """A LoRA model on a 50% sparse base, adapters trained; with each base weight's delta."""
    model = with_lora(llama())
    sparsity = RigL(0.5, update=EVERY_STEP, param_filter=BASE)
    model.apply(sparsity)
    train(model, sparsity)
    deltas = {}
    for name in sparsity.sparse_params:
        layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
        deltas[name] = layer.get_delta_weight("default").detach().clone()
    return model, sparsity, deltas


def test_merge_then_densify_equals_the_unmerged_model_and_is_dense() -> None:
    model, sparsity, deltas = trained_after_peft()
    batch = tokens(1, seed=5)[0]
    unmerged = logits(model, batch)
    merged = model.merge_and_unload()
    assert densify(model) == 14  # the model the algorithm was applied to: the PeftModel
    assert not [k for k in merged.state_dict() if k.endswith("_mask")]
    torch.testing.assert_close(logits(merged, batch), unmerged, rtol=0, atol=1e-5)
    for name, weight in merged_weights(merged, deltas).items():
        assert float((weight != 0).float().mean()) > 0.99, name  # the delta filled the pruned zeros


def merged_weights(merged: nn.Module, deltas: dict[str, torch.Tensor]) -> dict:
    """The merged weights, keyed like ``deltas`` (PeftModel names -> merged names)."""
    return {
        name: merged.get_parameter(
            name.removeprefix("base_model.model.").replace(".base_layer", "")
        )
        for name in deltas
    }


def test_merge_then_reprune_keeps_the_masks_exactly_and_drops_the_pruned_delta() -> None:
    model, sparsity, deltas = trained_after_peft()
    before = snapshot(sparsity)
    batch = tokens(1, seed=5)[0]
    unmerged = logits(model, batch)
    merged = model.merge_and_unload()
    with torch.no_grad():
        for sp in sparsity.sparse_params.values():  # the old masks, still on the base layers
            sp.prune_()
    weights = merged_weights(merged, deltas)
    for name, (weight, mask) in before.items():
        assert torch.equal(sparsity.sparse_params[name].mask, mask)
        expected = torch.where(mask, weight + deltas[name], torch.zeros(()))
        assert torch.equal(weights[name], expected), name  # kept: W + BA exactly; pruned: 0
    # Export: the mask-free state dict of the merged model is the same sparse weights.
    exported = strip_masks(merged)
    assert all(torch.equal(exported[k], merged.state_dict()[k]) for k in exported)
    # Not exact: the adapter's delta at pruned positions is gone, so the logits move.
    reference = llama(seed=3)
    reference.load_state_dict(exported)
    merged_logits = logits(merged, batch)
    torch.testing.assert_close(logits(reference, batch), merged_logits, rtol=0, atol=1e-6)
    assert (merged_logits - unmerged).abs().max() > 1e-4
    # In a new process: a Static with init_method="from_zeros" on the exported weights takes
    # back the same masks (no kept weight is exactly 0 here), now on trainable weights.
    again = Static(0.5, init_method="from_zeros", param_filter="*layers.*_proj.weight")
    reference.apply(again)
    for name, (_, mask) in before.items():
        merged_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(again.sparse_params[merged_name].mask, mask), merged_name


def test_merge_then_topk_gives_the_same_sparsity_with_masks_from_the_merged_weights() -> None:
    model, sparsity, _ = trained_after_peft()
    old = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): sp.mask.clone()
        for n, sp in sparsity.sparse_params.items()
    }
    merged = model.merge_and_unload()
    densify(model)
    dense = {n: merged.get_parameter(n).detach().clone() for n in old}
    resparsify = Static(0.5, init_method="topk", param_filter="*layers.*_proj.weight")
    merged.apply(resparsify)
    assert set(resparsify.sparse_params) == set(old)
    for name, sp in resparsify.sparse_params.items():
        pruned = sp.mask.logical_not()
        assert int(pruned.sum()) == sp.mask.numel() // 2  # exactly as sparse as before
        assert torch.equal(sp.param[pruned], torch.zeros_like(sp.param[pruned]))
        magnitude = dense[name].abs()  # kept: the largest merged magnitudes
        assert float(magnitude[sp.mask].min()) >= float(magnitude[pruned].max()), name
        assert torch.equal(sp.param[sp.mask], dense[name][sp.mask])
        assert float((old[name] == sp.mask).float().mean()) > 0.5  # mostly the old support
