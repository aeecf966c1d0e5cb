"""Which parameters are sparsified: the default filter, globs, regexes and the opt-outs."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_sparse import Group, Static, default_sparse_param_filter
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


# ---------------------------------------------------------------- config mistakes are loud


def _lm() -> nn.Module:
    """A Llama-style block: names like ``layers.0.self_attn.v_proj.weight``."""
    return Llama(LlamaConfig.from_preset("tiny"))


def _warnings(call: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught]


def test_a_glob_of_a_list_that_matches_nothing_is_named_with_the_closest_name() -> None:
    """A typo among valid globs used to be silent: the other globs still select parameters."""
    model, sparsity = _lm(), Static(0.5, param_filter=["*q_proj.weight", "*v_prj.weight"])
    messages = _warnings(lambda: model.apply(sparsity))
    assert len(sparsity.sparse_params) == 2  # the valid glob still selects
    typo = [m for m in messages if "'*v_prj.weight'" in m]
    assert len(typo) == 1, messages
    assert "param_filter glob '*v_prj.weight' matches no parameter" in typo[0]
    assert "closest parameter name: 'layers.0.self_attn.v_proj.weight'" in typo[0]
    assert not any("'*q_proj.weight'" in m for m in messages)


def test_legacy_regex_that_matches_nothing_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    sparsity = Static(0.5, param_filter=regex_filter([r"0\.weight", "fc9"]))
    messages = _warnings(lambda: model.apply(sparsity))
    assert any("param_name_patterns regex 'fc9' matches no parameter" in m for m in messages)
    assert set(sparsity.sparse_params) == {"0.weight"}


def test_filters_that_select_something_say_nothing() -> None:
    model = _lm()
    messages = _warnings(lambda: model.apply(Static(0.5, param_filter=["*_proj.weight"])))
    messages += _warnings(lambda: _lm().apply(Static(0.5)))
    assert not messages


def test_group_pattern_shadowed_by_an_earlier_one_is_named() -> None:
    """``Group({"*.weight": a, "0.weight": b})`` gives ``b`` nothing; it used to be silent."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    a, b = Static(0.5), Static(0.3)
    group = Group({"*.weight": a, "0.weight": b})
    messages = _warnings(lambda: group.apply(model))
    assert not b.sparse_params and set(a.sparse_params) == {"0.weight", "2.weight"}
    assert len(messages) == 1, messages
    shadowed = f"sparsity_group[1] ({b.name}): param_filter glob '0.weight' selects nothing"
    assert shadowed in messages[0]
    assert f"go to sparsity_group[0] ({a.name})" in messages[0] and "first matching" in messages[0]


def test_group_reports_each_unselected_pattern_of_a_list_and_each_empty_callable() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    first, second, third = Static(0.5), Static(0.3), Static(0.2)
    group = Group(
        {
            "0.*": first,
            ("2.weight", "0.bias", "3.weight"): second,  # 0.bias shadowed, 3.weight a typo
            (lambda name, p: name == "0.weight"): third,  # shadowed
        }
    )
    messages = _warnings(lambda: group.apply(model))
    assert set(second.sparse_params) == {"2.weight"} and not third.sparse_params
    assert len(messages) == 3, messages
    assert "glob '0.bias' selects nothing" in messages[0] and "sparsity_group[0]" in messages[0]
    assert "glob '3.weight' matches no parameter" in messages[1]
    assert "<lambda> selects nothing" in messages[2] and "'0.weight'" in messages[2]


def test_group_member_whose_filter_matches_nothing_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    group = Group({"0.*": Static(0.5), "encoder.*": Static(0.3)})
    messages = _warnings(lambda: group.apply(model))
    assert any("glob 'encoder.*' matches no parameter" in m for m in messages), messages
