"""``LitCausalLM(build_sparse=True)`` under Lightning: made one layer at a time on the device
(compact from the start), the same masks as the cpu accelerator's build, compact checkpoints
that resume bit-exactly, and a compact checkpoint loaded into a dense model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_sparse import RigL
from lightning_sparse.models.lit_lm import LitCausalLM
from lightning_sparse.wse.compact import is_placeholder
from tests.helpers import mask_buffers, trainer

VOCAB, SEQ = 64, 17


def _lit() -> LitCausalLM:
    torch.manual_seed(0)
    return LitCausalLM(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=32, warmup_steps=1,
        max_steps=8, build_sparse=True,
    )  # fmt: skip


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    one = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return DataLoader(one.repeat(16, 1), batch_size=2)  # the same batch: resume sees the same data


def _rigl() -> RigL:
    return RigL(0.9, update={"freq": 2}, seed=3)


def _fit(accelerator: str, steps: int, root: Path | None = None, ckpt: str | None = None) -> tuple:
    lit, algorithm = _lit(), _rigl()
    kwargs: dict = {}
    if root is not None:
        kwargs = dict(default_root_dir=str(root), enable_checkpointing=True)
    t = trainer(
        accelerator=accelerator, max_steps=steps, callbacks=[algorithm],
        num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip
    t.fit(lit, _loader(), ckpt_path=ckpt)
    return lit, algorithm


def _dense(lit: LitCausalLM) -> dict[str, Tensor]:
    return {
        k: (v.to_dense() if v.layout == torch.sparse_csr else v).clone()
        for k, v in lit.state_dict().items()
    }


def test_built_sparse_on_the_device_trains_as_on_the_cpu() -> None:
    device, _ = _fit("wse", 4)
    cpu, _ = _fit("cpu", 4)
    assert mask_buffers(device).keys() == mask_buffers(cpu).keys()
    for name, mask in mask_buffers(cpu).items():
        assert torch.equal(mask_buffers(device)[name], mask), name
    got, want = _dense(device), _dense(cpu)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=key)
    # The device's masked layers never held their dense weight and stay compact after fit.
    masked = [m for m in device.model.modules() if hasattr(m, "weight_mask")]
    assert len(masked) == 14 and all(is_placeholder(m.weight) for m in masked)
    assert not any(is_placeholder(m.weight) for m in cpu.model.modules() if hasattr(m, "weight"))


def test_checkpoint_is_compact_and_resumes_bit_exactly(tmp_path: Path) -> None:
    straight, straight_alg = _fit("wse", 8)
    _fit("wse", 4, tmp_path / "a")
    (ckpt,) = (tmp_path / "a").rglob("*.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    state = saved["state_dict"]
    csr = {k: v for k, v in state.items() if v.layout == torch.sparse_csr}
    assert len(csr) == 14  # every masked weight, as a sparse CSR tensor
    masked_numel = sum(v.shape[0] * v.shape[1] for v in csr.values())
    kept = sum(v.values().numel() for v in csr.values())
    assert kept == pytest.approx(0.1 * masked_numel, rel=0.02)
    # The optimizer's moments of those layers are kept [nnz] too: weights and moments of the
    # masked layers take 16 bytes a kept weight against 12 a weight dense (0.13x at 90%).
    optimizer = saved["optimizer_states"][0]
    decayed = optimizer["param_groups"][0]["params"]  # matrices: the masked layers and the head
    moments = [
        t
        for i in decayed
        for k, t in optimizer["state"][i].items()
        if k in ("exp_avg", "exp_avg_sq") and t.dim() == 1
    ]
    assert sum(t.numel() for t in moments) == 2 * kept
    compact_bytes = sum(
        v.values().nbytes + v.col_indices().nbytes + v.crow_indices().nbytes for v in csr.values()
    ) + sum(t.nbytes for t in moments)
    assert compact_bytes <= 0.2 * 12 * masked_numel

    resumed, resumed_alg = _fit("wse", 8, tmp_path / "b", ckpt=str(ckpt))
    for name, mask in mask_buffers(straight).items():
        assert torch.equal(mask_buffers(resumed)[name], mask), name
    got, want = _dense(resumed), _dense(straight)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert resumed_alg.step == straight_alg.step == 8


def test_a_compact_checkpoint_loads_into_a_dense_model(tmp_path: Path) -> None:
    lit, _ = _fit("wse", 2, tmp_path)
    (ckpt,) = tmp_path.rglob("*.ckpt")
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    torch.manual_seed(5)
    dense = LitCausalLM(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    dense.on_load_checkpoint({"state_dict": state})
    dense.load_state_dict(state)
    want = _dense(lit)
    for key, value in dense.state_dict().items():
        assert value.layout == torch.strided
        assert torch.equal(value, want[key]), key


def test_the_device_refuses_a_module_left_on_the_meta_device() -> None:
    """A LightningModule built on meta whose configure_model does not make it: the error names
    the fix, before Lightning moves it (Lightning's teardown then fails to move the meta module
    to the CPU, with this error as its context)."""

    class OnMeta(LitCausalLM):
        def configure_model(self) -> None:  # does not make it
            pass

    torch.manual_seed(0)
    lit = OnMeta(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, max_seq_len=32, build_sparse=True)
    t = trainer(accelerator="wse", max_steps=1, num_sanity_val_steps=0)
    with pytest.raises(Exception) as raised:  # noqa: PT011 (the chain is checked below)
        t.fit(lit, _loader())
    chain, err = [], raised.value
    while err is not None:
        chain.append(err)
        err = err.__context__
    messages = [str(e) for e in chain if isinstance(e, ValueError)]
    assert any(
        re.search(
            r"still has tensors on the meta device .*accelerator\.materialize\(trainer, init\)", m
        )
        for m in messages
    )
