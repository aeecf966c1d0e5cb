"""Tests for the Llama decoder: shapes, causality, names, tying, GQA, rotary, sampling."""

import pytest
import torch

from lightning_sparse.models.llama import Llama, LlamaConfig, apply_rope, generate, rope_tables


def tiny(**overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", **overrides))


def test_forward_shape():
    model = tiny()
    idx = torch.randint(0, 256, (3, 17))
    assert model(idx).shape == (3, 17, 256)


def test_causal_future_tokens_do_not_change_past_logits():
    model = tiny()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_huggingface_parameter_names():
    names = {n for n, _ in tiny().named_parameters()}
    for expected in [
        "embed_tokens.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.1.mlp.down_proj.weight",
        "layers.1.input_layernorm.weight",
        "layers.1.post_attention_layernorm.weight",
        "norm.weight",
        "lm_head.weight",
    ]:
        assert expected in names
    assert not any("rope" in n for n in tiny().state_dict())  # rotary tables are not saved


def test_tied_embeddings_share_one_tensor():
    model = tiny(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.num_params() == tiny().num_params() - 256 * 32


def test_init_is_deterministic_and_scales_residual_projections():
    a, b = tiny(n_layers=8), tiny(n_layers=8)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    big = Llama(LlamaConfig(dim=256, n_layers=8, n_heads=4))
    assert big.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(0.005, rel=0.05)


def test_grouped_query_attention_equals_repeated_kv_heads():
    """A GQA model computes the same as full MHA whose K/V heads are copies (reference)."""
    gqa = tiny(n_heads=4, n_kv_heads=2)
    mha = tiny(n_heads=4, n_kv_heads=4)
    state = gqa.state_dict()
    head_dim = 8
    for key, value in state.items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            heads = value.view(2, head_dim, -1)
            state[key] = heads.repeat_interleave(2, dim=0).reshape(4 * head_dim, -1)
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(gqa(idx), mha(idx))


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(head_dim=8, max_seq_len=32, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(i: int, j: int) -> torch.Tensor:
        qi = apply_rope(q.view(1, 1, 1, 8), cos[i : i + 1], sin[i : i + 1])
        kj = apply_rope(k.view(1, 1, 1, 8), cos[j : j + 1], sin[j : j + 1])
        return (qi * kj).sum()

    torch.testing.assert_close(score(5, 2), score(20, 17))
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_generate_length_and_greedy_determinism():
    model = tiny()
    prompt = torch.randint(0, 256, (2, 5))
    out = model.generate(prompt, max_new_tokens=7, top_k=10)
    assert out.shape == (2, 12) and torch.equal(out[:, :5], prompt)
    # Longer than max_seq_len: the context is cropped, generation still works.
    assert model.generate(prompt, max_new_tokens=70, temperature=0).shape == (2, 75)
    g1, g2 = model.generate(prompt, 6, temperature=0), model.generate(prompt, 6, temperature=0)
    assert torch.equal(g1, g2)


def test_too_long_input_and_bad_config_raise():
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(dim=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="preset"):
        LlamaConfig.from_preset("huge")


def test_default_ffn_hidden_is_rounded_swiglu_width():
    assert LlamaConfig(dim=256).ffn_hidden == 704  # 8/3 * 256 = 682.7 -> multiple of 32
    assert LlamaConfig(dim=256, ffn_hidden=100).ffn_hidden == 100


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_kv_cache_logits_equal_the_full_forward(kv_heads: int | None) -> None:
    model = tiny(n_heads=4, n_kv_heads=kv_heads).eval()
    idx = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(2)
        parts = [model(idx[:, :7], cache=cache)]  # prompt from position 0
        parts += [model(idx[:, i : i + 1], cache=cache) for i in range(7, 12)]  # one by one
        parts.append(model(idx[:, 12:], cache=cache))  # a chunk of 8 after a prefix
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cached_generate_gives_the_uncached_tokens() -> None:
    model = tiny().eval()
    prompt = torch.randint(0, 256, (2, 5))

    def uncached(idx: torch.Tensor) -> torch.Tensor:  # no new_cache: the full-context path
        return model(idx)

    limit = model.config.max_seq_len
    for new in (9, 70):  # 70: past max_seq_len = 64, where the window is re-encoded
        cached = generate(model, prompt, new, limit, temperature=0)
        reference = generate(uncached, prompt, new, limit, temperature=0)
        assert torch.equal(cached, reference), new
    g = torch.Generator().manual_seed(1)
    sampled = generate(model, prompt, 12, limit, temperature=0.8, top_k=20, generator=g)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sampled, generate(uncached, prompt, 12, limit, 0.8, 20, g))


def test_kv_cache_overflow_and_oversized_window_raise() -> None:
    model = tiny().eval()
    cache = model.new_cache(1)
    model(torch.zeros(1, 60, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache of 64 positions"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, 100)
