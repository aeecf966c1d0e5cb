"""Which parameters are sparsified: the default filter, globs, regexes and the opt-outs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sparse import Static, default_sparse_param_filter
from lightning_sparse.core.filters import glob_filter, make_param_filter, regex_filter
from lightning_sparse.models import Llama, LlamaConfig


def test_default_filter_on_hugging_face_style_llama() -> None:
    model = Llama(LlamaConfig.from_preset("tiny"))
    sparsity = Static(sparsity=0.5)
    model.apply(sparsity)
    chosen = set(sparsity.sparse_params)
    expected = {
        f"layers.{i}.{block}.{proj}.weight"
        for i in range(2)
        for block, projs in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for proj in (f"{p}_proj" if len(p) > 1 else f"{p}_proj" for p in projs)
    }
    assert chosen == expected


class _Renamed(nn.Module):
    """Names that give nothing away: only module types reveal embedding, norm and head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(10, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.LayerNorm(8)
        self.d = nn.Linear(8, 10, bias=False)
        self.d.weight = self.a.weight  # tied output head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(idx))))


def test_default_filter_decides_by_module_type_and_tying() -> None:
    sparsity = Static(sparsity=0.5)
    model = _Renamed()
    model.apply(sparsity)
    assert set(sparsity.sparse_params) == {"b.weight"}


def test_cerebras_name_rule() -> None:
    p = torch.zeros(4, 4)
    assert default_sparse_param_filter("layers.0.fc.weight", p)
    assert not default_sparse_param_filter("layers.0.fc.bias", torch.zeros(4))
    for name in ("embedding_layer.weight", "norm1.weight", "lm_head.weight", "pe_helper.w"):
        assert not default_sparse_param_filter(name, p), name


def test_globs_match_dots_and_regexes_search() -> None:
    p = torch.zeros(2, 2)
    assert glob_filter("*proj_[qkv]_dense_layer.weight")("a.b.proj_q_dense_layer.weight", p)
    assert not glob_filter("layers.*.weight")("xlayers.0.weight", p)  # full match
    assert regex_filter(".*linear_layer.weight")("ffn.0.linear_layer.weight", p)
    assert regex_filter("linear")("ffn.0.linear_layer.weight", p)  # re.search
    with pytest.raises(TypeError, match="param_filter=3"):
        make_param_filter(3)  # type: ignore[arg-type]


def test_param_and_module_requires_dense_opt_out() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    model[0].weight.requires_dense = True
    model[1].requires_dense = True  # the module and its children
    sparsity = Static(sparsity=0.5, param_filter="*")
    model.apply(sparsity)
    assert set(sparsity.sparse_params) == {"0.bias"}
    sparsity.remove()
    model[1].requires_dense = False
    sparsity = Static(sparsity=0.5, param_filter="*")
    model.apply(sparsity)
    assert set(sparsity.sparse_params) == {
        "0.bias",
        "1.0.weight",
        "1.0.bias",
        "1.1.weight",
        "1.1.bias",
    }


def test_optimizer_state_requires_dense_opt_out() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 6)
    sparsity = Static(sparsity=0.5)
    model.apply(sparsity)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sparsity.apply(optimizer)
    buf = torch.ones(6, 6)
    buf.requires_dense = True
    optimizer.state[model.weight]["momentum_buffer"] = buf
    extra = torch.ones(6, 6)
    optimizer.state[model.weight]["extra"] = extra
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    mask = model.weight_mask
    assert torch.all(extra[~mask] == 0)  # an ordinary same-shape state is pruned
    assert torch.all(optimizer.state[model.weight]["momentum_buffer"][~mask] != 0)  # opted out
    assert torch.all(model.weight[~mask] == 0)
