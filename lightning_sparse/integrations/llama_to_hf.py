"""This package's `Llama` as a `transformers.LlamaForCausalLM`: the config and the weight names.

The two models compute the same function, checked line by line against transformers' Llama:

- RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps))`` in float32, cast back before the gain, in both;
- RoPE: both rotate *halves* (``rotate_half``: ``cat(-x2, x1)``) with the frequencies
  ``theta^(-2i/head_dim)`` repeated twice, so q/k projection rows need no permutation (a
  checkpoint in Meta's interleaved-pairs layout would);
- grouped-query attention: KV head ``j`` serves query heads ``j*r .. j*r + r - 1`` in both
  (``repeat_interleave`` here, ``repeat_kv`` there), scaled by ``head_dim ** -0.5``, causal;
- SwiGLU: ``down(silu(gate(x)) * up(x))``, no biases anywhere, no embedding scaling.

The weight names are transformers' minus its ``model.`` prefix (``lm_head.weight`` keeps none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_sparse.models.llama import Llama, LlamaConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["hf_llama_config", "hf_llama_name", "to_hf_llama"]


def hf_llama_name(name: str) -> str:
    """``layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj.weight``."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def hf_llama_config(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> Any:
    """The `transformers.LlamaConfig` of a model built from ``cfg`` (weights in ``dtype``).

    Raises:
        ValueError: ``cfg`` holds a value transformers' Llama cannot represent.
    """
    import transformers

    problems = [
        f"{field}={value!r} (must be a positive number)"
        for field, value in (("rope_theta", cfg.rope_theta), ("norm_eps", cfg.norm_eps))
        if not value > 0
    ]
    if cfg.n_kv_heads is None or cfg.n_heads % cfg.n_kv_heads or cfg.dim % cfg.n_heads:
        problems.append(f"n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, dim={cfg.dim}")
    if problems:
        raise ValueError(
            f"transformers' Llama cannot represent this model: {'; '.join(problems)}; "
            "export a model built with a valid LlamaConfig"
        )
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_width,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        # Byte-level vocabularies have no special tokens; transformers' defaults (1, 2) would lie.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
        dtype=dtype,
    )


def to_hf_llama(model: Llama, state_dict: Mapping[str, torch.Tensor]) -> PreTrainedModel:
    """A new `transformers.LlamaForCausalLM` holding ``state_dict`` (``model``'s, mask-free).

    Args:
        model: the source of the config (``model.config``); it is not modified.
        state_dict: ``model``'s mask-free state dict (`strip_masks`), this package's names.

    Raises:
        ValueError: the config is not representable (see `hf_llama_config`), or the state dict's
            names or shapes are not those of a plain `Llama` (a module was replaced or added).
    """
    import transformers

    dtype = model.embed_tokens.weight.dtype
    hf_config = hf_llama_config(model.config, dtype)
    renamed = {hf_llama_name(k): v for k, v in state_dict.items()}
    with torch.device("meta"):  # shapes only: the names and shapes are checked before any work
        expected = transformers.LlamaForCausalLM(hf_config).state_dict()
    missing = sorted(set(expected) - set(renamed))
    extra = sorted(set(renamed) - set(expected))
    wrong = sorted(
        k
        for k in set(expected) & set(renamed)
        if tuple(expected[k].shape) != tuple(renamed[k].shape)
    )
    if missing or extra or wrong:
        raise ValueError(
            f"this Llama's weights do not map onto transformers' LlamaForCausalLM (missing "
            f"{missing[:5]}, unexpected {extra[:5]}, wrong shape {wrong[:5]}): a layer was "
            "replaced or added (biases, adapters); export only the plain lightning_sparse Llama"
        )
    # transformers decorates PreTrainedModel.to with functools.wraps(nn.Module.to), which typeshed
    # types as the unbound function (its first parameter `self`): a false positive.
    hf_model = transformers.LlamaForCausalLM(hf_config).to(dtype)  # type: ignore[arg-type]
    hf_model.load_state_dict(renamed, strict=True)
    return hf_model.eval()
