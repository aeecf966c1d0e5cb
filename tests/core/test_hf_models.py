"""Hugging Face models built from tiny configs (random weights, nothing downloaded): the default
filter keeps every output head dense, GPT-2's Conv1D is costed and shaped like an nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_sparse import Static  # noqa: E402
from lightning_sparse.core.flops import model_flops  # noqa: E402
from lightning_sparse.core.layouts import is_hf_conv1d  # noqa: E402
from lightning_sparse.core.shapers import NM, InputGroups, OutputGroups  # noqa: E402

IDS = dict(bos_token_id=0, eos_token_id=0)  # GPT-2's defaults (50256) exceed the tiny vocab
BERT = dict(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=32,
)
LLAMA = dict(BERT, num_key_value_heads=2, pad_token_id=0)


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, **IDS
    )
    return transformers.GPT2LMHeadModel(config)


def sparsified(model: nn.Module, **kwargs: object) -> set[str]:
    algorithm = Static(sparsity=0.5, **kwargs)
    model.apply(algorithm)
    return set(algorithm.sparse_params)


def test_gpt2_conv1d_layers_sparsified_tied_lm_head_dense() -> None:
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    chosen = sparsified(model)
    conv1d = {f"{n}.weight" for n, m in model.named_modules() if is_hf_conv1d(m)}
    assert len(conv1d) == 8  # c_attn, c_proj, mlp.c_fc, mlp.c_proj per layer
    assert chosen == conv1d


def test_untied_lm_head_dense_by_structure() -> None:
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=128, tie_word_embeddings=False, **IDS
    )
    model = transformers.GPT2LMHeadModel(config)
    model.lm_head.weight = nn.Parameter(torch.randn(128, 32))  # untie for sure
    model.out = model.lm_head  # the head under a name the name rule does not catch
    del model.lm_head
    model.get_output_embeddings = lambda: model.out  # type: ignore[method-assign]
    assert "out.weight" not in sparsified(model)


def test_bert_classifier_and_pooler_dense() -> None:
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT))
    chosen = sparsified(model)
    assert not {n for n in chosen if "classifier" in n or "pooler" in n}
    assert "bert.encoder.layer.0.attention.self.query.weight" in chosen
    assert "bert.encoder.layer.0.output.dense.weight" in chosen


def test_llama_score_dense() -> None:
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**LLAMA))
    chosen = sparsified(model)
    assert "score.weight" not in chosen
    assert "model.layers.0.self_attn.q_proj.weight" in chosen
    assert len(chosen) == 7


def test_qa_outputs_dense() -> None:
    model = transformers.BertForQuestionAnswering(transformers.BertConfig(**BERT))
    chosen = sparsified(model)
    assert not {n for n in chosen if "qa_outputs" in n}
    assert "bert.encoder.layer.0.intermediate.dense.weight" in chosen


def test_num_labels_head_dense_by_structure() -> None:
    """A classification head under a neutral name is found as the num_labels projection."""
    config = transformers.BertConfig(**BERT, num_labels=3)
    model = transformers.BertForSequenceClassification(config)
    model.proj = model.classifier
    del model.classifier
    chosen = sparsified(model)
    assert "proj.weight" not in chosen


def test_gpt2_flops_count_conv1d_like_linear() -> None:
    model = gpt2()
    dense = model_flops(model, 16)
    model.apply(Static(sparsity=0.8))
    report = model_flops(model, 16, include_embeddings=False)
    conv = [m.weight for m in model.modules() if is_hf_conv1d(m)]
    kept = sum(int((1 - 0.8) * w.numel()) for w in conv)
    numel = sum(w.numel() for w in conv)
    head = model.lm_head.weight.numel()
    assert report.forward_flops_per_token == 2 * (kept + head)
    assert report.dense_forward_flops_per_token == 2 * (numel + head)
    assert dense.dense_forward_flops_per_token > report.dense_forward_flops_per_token
    assert report.inference_reduction > 1.5  # was 1.00x when Conv1D was not counted


@pytest.mark.parametrize("n_layers", [1])
def test_conv1d_nm_keeps_two_of_four_consecutive_inputs(n_layers: int) -> None:
    config = transformers.GPT2Config(n_layer=n_layers, n_embd=32, n_head=2, vocab_size=128, **IDS)
    model = transformers.GPT2LMHeadModel(config)
    algorithm = Static(sparsity=0.5, shaper=NM(2, 4))
    model.apply(algorithm)
    for name, sp in algorithm.sparse_params.items():
        mask = sp.mask  # Conv1D: [in, out]; runs of 4 consecutive inputs per output column
        assert is_hf_conv1d(sp.module), name
        runs = mask.t().reshape(mask.shape[1], -1, 4).sum(-1)
        assert (runs == 2).all(), name
        # the [out, in] reading of the stored tensor would not balance the rows:
        assert not (mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all(), name


def test_conv1d_group_shapers_balance_inputs_and_outputs() -> None:
    model = gpt2()
    algorithm = Static(sparsity=0.75, shaper=InputGroups(4))
    model.apply(algorithm)
    mask = algorithm.sparse_params["transformer.h.0.mlp.c_fc.weight"].mask  # [32 in, 128 out]
    per_input_block = mask.reshape(4, 8, 128).sum((1, 2))
    assert per_input_block.tolist() == [256] * 4
    model = gpt2()
    algorithm = Static(sparsity=0.75, shaper=OutputGroups(4))
    model.apply(algorithm)
    mask = algorithm.sparse_params["transformer.h.0.mlp.c_fc.weight"].mask
    per_output_block = mask.reshape(32, 4, 32).sum((0, 2))
    assert per_output_block.tolist() == [256] * 4


@pytest.mark.parametrize("name", ["RigL", "SET", "GMP"])
def test_conv1d_nm_holds_through_mask_updates(name: str) -> None:
    import lightning_sparse

    model = gpt2()
    kwargs = {"sparsity": 0.5, "update": {"freq": 1}, "shaper": NM(2, 4)}
    if name == "GMP":
        kwargs["sparsity"] = {"type": "cubic", "init": 0.0, "final": 0.5, "begin": 0, "end": 2}
    algorithm = getattr(lightning_sparse, name)(**kwargs)
    model.apply(algorithm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm.apply(optimizer)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert algorithm.step == 3
    for pname, sp in algorithm.sparse_params.items():
        runs = sp.mask.t().reshape(sp.mask.shape[1], -1, 4).sum(-1)
        assert (runs == 2).all(), pname
        assert not sp.param[~sp.mask].any(), pname
