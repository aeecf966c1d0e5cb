"""A small Llama-style decoder in one file (nanoGPT-like), with Hugging Face parameter names.

Parameter names follow `transformers.LlamaForCausalLM` minus its `model.` prefix
(`embed_tokens.weight`, `layers.0.self_attn.q_proj.weight`, `layers.0.mlp.down_proj.weight`,
`norm.weight`, `lm_head.weight`), so parameter filters written for Hugging Face models (for example
``"*proj.weight"``) select the same layers here.

References: "LLaMA: Open and Efficient Foundation Language Models" (arXiv:2302.13971);
"RoFormer: Enhanced Transformer with Rotary Position Embedding" (arXiv:2104.09864);
"GLU Variants Improve Transformer" (arXiv:2002.05202).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class LlamaConfig:
    """Hyper-parameters of `Llama`.

    Args:
        vocab_size: Number of token ids; 256 for byte-level text.
        dim: Width of the residual stream.
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads; must divide `dim`.
        n_kv_heads: Number of key/value heads (grouped-query attention); `None` means `n_heads`.
        ffn_hidden: Hidden width of the SwiGLU feed-forward; `None` means 8/3 * dim rounded up
            to a multiple of `multiple_of` (keeps the parameter count of a 4 * dim GELU MLP).
        multiple_of: Rounding for the default `ffn_hidden`.
        max_seq_len: Longest sequence the rotary tables cover.
        rope_theta: Base of the rotary frequencies.
        norm_eps: Epsilon of RMSNorm.
        tie_embeddings: Share one tensor between `embed_tokens` and `lm_head`.
    """

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    multiple_of: int = 32
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for rotary")
        if self.ffn_hidden is None:
            self.ffn_hidden = self.ffn_width

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """`n_kv_heads` resolved: `n_heads` where it is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_width(self) -> int:
        """`ffn_hidden` resolved: 8/3 * dim rounded up to `multiple_of` where it is None."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return self.multiple_of * math.ceil(int(8 * self.dim / 3) / self.multiple_of)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """Builds a named preset (see `PRESETS`), with keyword overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # For unit tests: GQA on, a few thousand parameters per layer.
    "tiny": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
    # Default: about 3.2M parameters; trains on a laptop CPU in minutes.
    "small": dict(dim=256, n_layers=4, n_heads=4, max_seq_len=256),
}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., dim] -> [..., dim]. Normalises in float32 for stability under autocast."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotary cos/sin tables in the Hugging Face "rotate half" layout.

    Returns:
        cos, sin: each [max_seq_len, head_dim] (the head_dim/2 frequencies repeated twice).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates x: [B, H, T, head_dim] by position; cos, sin: [T, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions and optional grouped KV heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor] | None = None,
        start: int = 0,
    ) -> Tensor:  # fmt: skip
        """x: [B, T, dim], cos/sin: [T, head_dim] -> [B, T, dim].

        With ``kv`` (this layer's cache buffers, each ``[B, n_kv_heads, max_len, head_dim]``)
        the new keys and values are written at positions ``start .. start + T - 1`` and the
        queries attend to every cached position up to their own.
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask, causal = None, True
        if kv is not None:
            kv[0][:, :, start : start + T] = k
            kv[1][:, :, start : start + T] = v
            k, v = kv[0][:, :, : start + T], kv[1][:, :, : start + T]
            if start > 0:  # query i (position start + i) sees keys 0 .. start + i
                causal = False
                if T > 1:
                    keys = torch.arange(start + T, device=x.device)
                    mask = keys <= torch.arange(start, start + T, device=x.device).unsqueeze(1)
        if self.n_kv_heads != self.n_heads:
            # Each KV head serves n_heads / n_kv_heads consecutive query heads.
            repeats = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # y: [B, H, T, head_dim]


class FeedForward(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_width, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_width, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_width, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, dim] -> [B, T, dim]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor] | None = None,
        start: int = 0,
    ) -> Tensor:  # fmt: skip
        """x: [B, T, dim] -> [B, T, dim]; ``kv``/``start`` as in `Attention.forward`."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Keys and values of the positions a decoder has seen, for incremental decoding.

    Attributes:
        keys, values: ``[n_layers, B, n_kv_heads, max_len, head_dim]`` buffers.
        length: positions filled so far (the next token's position).
    """

    def __init__(
        self, cfg: LlamaConfig, batch: int, dtype: torch.dtype, device: torch.device | str,
    ) -> None:  # fmt: skip
        shape = (cfg.n_layers, batch, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions the cache holds (the model's ``max_seq_len``)."""
        return self.keys.shape[3]

    def reset(self) -> None:
        """Forget every position (the buffers are reused)."""
        self.length = 0


class Llama(nn.Module):
    """Decoder-only language model: token ids [B, T] -> next-token logits [B, T, vocab_size]."""

    rope_cos: Tensor  # [max_seq_len, head_dim] buffers, registered in __init__
    rope_sin: Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Rotary tables are derived data: not saved in checkpoints, moved with the module.
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, residual outputs scaled by 1/sqrt(2 * n_layers)
        (`init_tensor` per parameter, in ``named_parameters`` order)."""
        for name, p in self.named_parameters():
            self.init_tensor(name, p)

    @torch.no_grad()
    def init_tensor(self, name: str, t: Tensor) -> None:
        """Initialise the parameter or buffer ``name`` of this model (``t``, in place), as a
        dense build does: the rule of `reset_parameters` for a parameter, the rotary tables
        for ``rope_cos`` / ``rope_sin``. What `lightning_sparse.wse.on_wse`'s ``init`` calls
        for a model built on the meta device, one tensor at a time."""
        if name in ("rope_cos", "rope_sin"):
            cfg = self.config
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            t.copy_(cos if name == "rope_cos" else sin)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            nn.init.normal_(t, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layers))
        elif t.ndim >= 2:
            nn.init.normal_(t, mean=0.0, std=0.02)
        else:  # RMSNorm gains
            nn.init.ones_(t)

    def forward(self, idx: Tensor, cache: KVCache | None = None) -> Tensor:
        """idx: LongTensor [B, T] with T <= max_seq_len -> logits [B, T, vocab_size].

        With a ``cache`` (from `new_cache`), ``idx`` continues the ``cache.length`` positions
        already seen (their keys and values are reused, the new ones appended); the logits are
        those of the whole sequence at the new positions.
        """
        T = idx.shape[1]
        start = 0 if cache is None else cache.length
        if start + T > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {start + T} exceeds max_seq_len={self.config.max_seq_len}; "
                "crop the input (or reset the cache) or build the model with a larger max_seq_len"
            )
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            x = layer(x, cos, sin, kv, start)
        if cache is not None:
            cache.length = start + T
        return self.lm_head(self.norm(x))

    def new_cache(self, batch: int) -> KVCache:
        """An empty `KVCache` for ``batch`` sequences, in this model's dtype and device."""
        weight = self.embed_tokens.weight
        return KVCache(self.config, batch, weight.dtype, weight.device)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Samples continuations; see `generate`. idx: [B, T] -> [B, T + max_new_tokens]."""
        return generate(
            self, idx, max_new_tokens, self.config.max_seq_len, temperature, top_k, generator
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Autoregressive sampling for any model mapping ids to logits.

    A model with ``new_cache(batch)`` (`Llama`) decodes incrementally: the prompt runs once,
    then each step runs only the new token against a `KVCache`. Once the sequence fills
    ``max_seq_len``, every step re-encodes the last ``max_seq_len`` tokens from position 0, as
    the uncached path does, so both give the same tokens. Other models run the whole (cropped)
    context every step.

    Args:
        model: Maps LongTensor [B, T] to logits [B, T, V].
        idx: Prompt token ids [B, T].
        max_new_tokens: Number of tokens to append.
        max_seq_len: The context is cropped to the last `max_seq_len` tokens.
        temperature: Softmax temperature; 0 means greedy (argmax).
        top_k: Sample only among the `top_k` most likely tokens.
        generator: Random generator for reproducible sampling.

    Returns:
        LongTensor [B, T + max_new_tokens].
    """
    new_cache = getattr(model, "new_cache", None)
    cache = new_cache(idx.shape[0]) if callable(new_cache) and max_new_tokens > 0 else None
    if cache is not None and cache.capacity < max_seq_len:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds the model's cache of {cache.capacity} positions"
        )
    for i in range(max_new_tokens):
        if cache is None:
            logits = model(idx[:, -max_seq_len:])
        elif i > 0 and cache.length < max_seq_len:
            logits = model(idx[:, -1:], cache=cache)  # only the newest token
        else:  # the prompt, or a full window re-encoded from position 0
            cache.reset()
            logits = model(idx[:, -max_seq_len:], cache=cache)
        next_id = _sample(logits[:, -1, :].float(), temperature, top_k, generator)  # [B, 1]
        idx = torch.cat([idx, next_id], dim=1)
    return idx


def _sample(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """Next token ids [B, 1] from logits [B, V]: argmax at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
