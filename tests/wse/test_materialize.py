"""A model built sparse (`wse.materialize`, ``on_wse(..., init=...)``) equals one built dense
with the same initialisation and pruned, and never holds two masked layers' dense weights."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sparse import RigL, SparsityAlgorithm, Static
from lightning_sparse.models.llama import Llama, LlamaConfig
from lightning_sparse.wse import materialize, on_wse
from lightning_sparse.wse.compact import is_placeholder

CFG = LlamaConfig.from_preset("tiny", vocab_size=64)


def _dense_build(cfg: LlamaConfig) -> Llama:
    """The reference: built on meta, made on the CPU, ``init_tensor`` over named_parameters."""
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:  # to_empty makes each module's tensor anew: the tie is lost
        model.lm_head.weight = model.embed_tokens.weight
    for name, buffer in model.named_buffers():
        model.init_tensor(name, buffer)
    model.reset_parameters()
    return model


def _train(
    sparse: bool, make: Callable[[], SparsityAlgorithm], cfg: LlamaConfig = CFG, steps: int = 5
) -> tuple[list[float], dict[str, Tensor], dict[str, Tensor], dict[str, int]]:
    """Losses, model state, masks and the compact layers' bytes after ``steps`` on the device."""
    torch.manual_seed(0)
    if sparse:
        with torch.device("meta"):
            model = Llama(cfg)
    else:
        model = _dense_build(cfg)
    algorithm = make()
    model.apply(algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    algorithm.apply(optimizer)
    batch = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    init = model.init_tensor if sparse else None
    with on_wse(model, optimizer=optimizer, init=init) as executor:
        for _ in range(steps):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert executor.compact is not None
        memory = executor.compact.memory()
    # A layer built sparse writes its weight as a sparse CSR tensor (it stays compact).
    state = {
        k: (v.to_dense() if v.layout == torch.sparse_csr else v).clone()
        for k, v in model.state_dict().items()
    }
    masks = {n: b.clone() for n, b in model.named_buffers() if n.endswith("_mask")}
    return losses, state, masks, memory


@pytest.mark.parametrize(
    "make",
    [
        lambda: RigL(0.9, update={"freq": 2}, drop_fraction=0.3, seed=3),
        lambda: Static(0.8, seed=3),
        lambda: RigL(0.9, update={"freq": 2}, seed=3, init_method="topk", track_itop=False),
    ],
    ids=["rigl", "static", "rigl-topk"],
)
def test_built_sparse_trains_as_built_dense(make: Callable[[], SparsityAlgorithm]) -> None:
    dense = _train(False, make)
    sparse = _train(True, make)
    assert sparse[0] == dense[0]  # losses, bit for bit
    assert sparse[1].keys() == dense[1].keys()
    for key in dense[1]:
        assert torch.equal(sparse[1][key], dense[1][key]), key
    assert len(dense[2]) == 14 and sparse[2].keys() == dense[2].keys()
    for key in dense[2]:
        assert torch.equal(sparse[2][key], dense[2][key]), key
    assert sparse[3] == dense[3]  # the same compact layers


def test_tied_embeddings_are_made_once() -> None:
    cfg = LlamaConfig.from_preset("tiny", vocab_size=64, tie_embeddings=True)
    dense = _train(False, lambda: Static(0.5, seed=3), cfg, steps=2)
    sparse = _train(True, lambda: Static(0.5, seed=3), cfg, steps=2)
    assert sparse[0] == dense[0]
    for key in dense[1]:
        assert torch.equal(sparse[1][key], dense[1][key]), key


def test_at_most_one_masked_weight_is_dense_at_a_time() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(CFG)
    algorithm = Static(0.9, seed=3)
    model.apply(algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    masked = [sp.module for sp in algorithm.sparse_params.values()]
    dense_at_init: list[int] = []

    def init(name: str, tensor: Tensor) -> None:
        dense_at_init.append(
            sum(not m.weight.is_meta and not is_placeholder(m.weight) for m in masked)
        )
        model.init_tensor(name, tensor)

    with on_wse(model, optimizer=optimizer, init=init):
        # Every masked weight is compact: no weight of its size is held.
        assert all(is_placeholder(m.weight) for m in masked)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert not any(id(m.weight) in params for m in masked)  # the kept values are stepped
    # When a masked layer's weight is initialised, at most that one is dense (the one being
    # made counts once it exists).
    assert max(dense_at_init) <= 1


def test_materialize_without_the_device_gives_the_dense_build() -> None:
    """Without an executor (the cpu path) the masked weights are made dense and pruned."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(CFG)
    reference = _dense_build(CFG)
    algorithm, expected = Static(0.7, seed=5), Static(0.7, seed=5)
    model.apply(algorithm)
    reference.apply(expected)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    materialize(model, model.init_tensor, [optimizer])
    assert model.state_dict().keys() == reference.state_dict().keys()
    for (name, got), want in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name
    for name, sp in algorithm.sparse_params.items():
        assert torch.equal(sp.mask, expected.sparse_params[name].mask), name
    assert {id(p) for p in model.parameters()} == {
        id(p) for group in optimizer.param_groups for p in group["params"]
    }


def test_a_mask_on_meta_that_no_algorithm_owns_is_refused_before_anything_is_made() -> None:
    with torch.device("meta"):
        layer = nn.Sequential(nn.Linear(8, 4))
    layer[0].register_buffer("weight_mask", torch.empty(4, 8, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match=r"'0\.weight_mask' is a mask on the meta device"):
        materialize(layer, lambda name, t: t.zero_(), [])
    assert layer[0].weight.is_meta and layer[0].bias.is_meta


def test_an_algorithm_cannot_draw_a_mask_for_a_weight_still_on_meta() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 4))
    algorithm = Static(0.5, seed=1)
    model.apply(algorithm)
    assert model[0].weight_mask.is_meta  # deferred
    with pytest.raises(ValueError, match=r"'0\.weight' is still on the meta device"):
        algorithm.materialize("0.weight")
    with pytest.raises(KeyError):
        algorithm.materialize("1.weight")


def test_an_update_keeps_the_new_masks_of_compact_layers_packed() -> None:
    """Between computing and installing, a held weight's new mask is packed bits (1 bit a
    weight), and installing it gives the masks the unpacked path gives."""
    from lightning_sparse.core.install import Packed

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(CFG)
    algorithm = RigL(0.9, update={"freq": 1}, seed=3)
    model.apply(algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    algorithm.apply(optimizer)
    with on_wse(model, optimizer=optimizer, init=model.init_tensor):
        batch = torch.randint(0, CFG.vocab_size, (2, 17))
        for _ in range(2):  # step 0, then the backward of step 1 (an update step)
            optimizer.zero_grad()
            F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
            if algorithm.step == 0:
                optimizer.step()
        assert algorithm.is_update_step()
        targets = {name: 0.9 for name in algorithm.sparse_params}
        with torch.no_grad():
            masks = algorithm.compute_masks(targets)
        assert masks and all(isinstance(m, Packed) for m in masks.values())
        for name, packed in masks.items():
            assert isinstance(packed, Packed)
            assert packed.bits.numel() == (algorithm.sparse_params[name].mask.numel() + 7) // 8
            assert packed.unpack().dtype == torch.bool


def test_build_sparse_refuses_a_model_of_ones_own() -> None:
    from lightning_sparse.models.lit_lm import LitCausalLM

    with pytest.raises(ValueError, match="build_sparse=True builds the default Llama"):
        LitCausalLM(model=nn.Linear(2, 2), build_sparse=True)
    lit = LitCausalLM(dim=32, n_layers=1, n_heads=4, max_seq_len=16, build_sparse=True)
    assert all(p.is_meta for p in lit.parameters())
    with pytest.raises(ValueError, match=r"knows the default Llama's tensors \(model\.\*\)"):
        lit.init_tensor("val_loss.weight", torch.empty(1))


def _built(algorithm: SparsityAlgorithm) -> tuple[Llama, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(CFG)
    model.apply(algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    algorithm.apply(optimizer)
    return model, optimizer


def _step(model: Llama, optimizer: torch.optim.Optimizer) -> float:
    batch = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def test_a_layer_built_sparse_stays_compact_and_the_next_executor_takes_it_over() -> None:
    model, optimizer = _built(Static(0.8, seed=1))
    with on_wse(model, optimizer=optimizer, init=model.init_tensor):
        _step(model, optimizer)
    masked = [m for m in model.modules() if hasattr(m, "weight_mask")]
    assert all(is_placeholder(m.weight) for m in masked)  # never dense, not even after the block
    with on_wse(model, optimizer=optimizer) as executor:
        _step(model, optimizer)
        assert executor.compact is not None
        assert executor.compact.memory()["state"] > 0  # this executor's layers: the same values
    assert all(is_placeholder(m.weight) for m in masked)


def test_a_sparse_csr_weight_that_does_not_fit_is_refused() -> None:
    model, optimizer = _built(Static(0.8, seed=1))
    with on_wse(model, optimizer=optimizer, init=model.init_tensor):
        state = model.state_dict()
        key = "layers.0.mlp.up_proj.weight"
        good = state[key]
        wrong = torch.zeros(3, 5).to_sparse_csr()
        with pytest.raises(RuntimeError, match=r"does not fit the layer's"):
            model.load_state_dict({**state, key: wrong})
        cols = good.col_indices().clone()
        cols[:2] = cols[:2].flip(0)  # two columns of the first row out of order
        unsorted = torch.sparse_csr_tensor(
            good.crow_indices(), cols, good.values(), good.shape, check_invariants=False
        )
        with pytest.raises(RuntimeError, match=r"not in row order with ascending"):
            model.load_state_dict({**state, key: unsorted})
        model.load_state_dict(state)  # its own state loads
