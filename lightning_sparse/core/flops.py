"""FLOP and parameter counts of a decoder-only transformer, dense versus sparse.

FLOPs follow appendix F of "Training Compute-Optimal Large Language Models" (Hoffmann et al.,
2022, arXiv:2203.15556, "Chinchilla"), per layer and per sequence of ``seq`` tokens, with ``d`` the
model width and ``key_size * heads = d``:

=======================  ==============================================================
embeddings               ``2 * seq * vocab * d`` (a lookup costed as a one-hot matmul)
attention QKV            ``2 * 3 * seq * d * d``
attention logits         ``2 * seq * seq * d``
attention softmax        ``3 * heads * seq * seq``
softmax @ values         ``2 * seq * seq * d``
attention output         ``2 * seq * d * d``
feed-forward             ``2 * seq * 2 * d * ffw`` (SwiGLU: ``2 * seq * 3 * d * ffw``)
final logits             ``2 * seq * d * vocab``
=======================  ==============================================================

The backward pass costs twice the forward, so training costs ``3 x`` forward. Every token attends
to all ``seq`` positions (no causal halving), as in the paper.

Sparsity: a weight matrix with ``kept`` of its ``numel`` weights costs ``2 * kept`` FLOPs per token
instead of ``2 * numel`` (unstructured sparsity on hardware that skips zeros, such as the Cerebras
CS-2). Attention logits, softmax and values have no weights and embedding lookups skip nothing, so
those terms stay dense. ``kept = int((1 - sparsity) * numel)``, the count a mask keeps.

Two entry points share one report: :func:`transformer_flops` (arithmetic from a config) and
:func:`model_flops` (walks an ``nn.Module``, also one on the ``meta`` device). The report, the
formulas (``2 * tokens * kept`` per matmul, training ``3 x`` forward) and the run's account are
`flop_account`'s, the one place every FLOP figure of the package comes from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from . import validate
from .flop_account import FlopReport, check_count, report_from_matrices
from .layouts import is_hf_conv1d
from .report import host_counts
from .sparse_parameter import mask_buffer_name

__all__ = [
    "ConvPositionRecorder",
    "FlopReport",
    "MATRIX_KINDS",
    "batch_shape",
    "conv_output_positions",
    "model_flops",
    "transformer_flops",
]

MATRIX_KINDS = ("qkv", "attn_out", "ffn", "embedding", "head")
"""Keys of a per-kind ``sparsity`` mapping in :func:`transformer_flops`."""

_BLOCK_KINDS = ("qkv", "attn_out", "ffn")


def transformer_flops(
    n_layers: int,
    d_model: int,
    n_heads: int,
    seq_len: int,
    vocab_size: int,
    ffn_hidden: int | None = None,
    ffn_kind: str = "gelu",
    sparsity: float | Mapping[str, float] = 0.0,
    include_embeddings: bool = True,
    include_logits: bool = True,
    *,
    tie_embeddings: bool = False,
    n_positions: int = 0,
) -> FlopReport:
    """Cost a decoder-only transformer from its configuration (Chinchilla appendix F).

    Weights counted: per layer the Q, K, V and output projections (``d x d`` each) and the
    feed-forward matrices (two ``d x ffw``, three for SwiGLU); the token embedding and the output
    head (``vocab x d``); a learned position table (``n_positions x d``). Norm gains and biases
    (``O(n_layers * d)``) are left out.

    Args:
        n_layers: transformer blocks.
        d_model: model width ``d`` (``= key_size * n_heads``).
        n_heads: attention heads.
        seq_len: tokens per sequence.
        vocab_size: vocabulary size.
        ffn_hidden: feed-forward width ``ffw``; default ``4 * d_model``.
        ffn_kind: ``"gelu"`` (two matrices) or ``"swiglu"`` (three).
        sparsity: a float for the block matrices (``qkv``, ``attn_out``, ``ffn``) with embeddings
            and head dense, or a mapping from kinds in :data:`MATRIX_KINDS` to sparsity (missing
            kinds are dense). Embedding sparsity changes parameters, never FLOPs.
        include_embeddings: count embedding FLOPs (``2 * vocab * d`` per token, and
            ``2 * n_positions * d`` for a position table).
        include_logits: count the final-logits FLOPs.
        tie_embeddings: the head is the embedding matrix (GPT-2/3): no own parameters, and its
            sparsity is ``sparsity["embedding"]``.
        n_positions: rows of a learned position table (GPT-2/3: the context length); 0 for RoPE.

    Returns:
        The :class:`FlopReport`.

    Raises:
        TypeError: a size that is not an int, a sparsity that is not a number.
        ValueError: a size below 1, ``d_model`` not divisible by ``n_heads``, an unknown
            ``ffn_kind`` or sparsity key, a sparsity outside ``[0, 1)``.
    """
    n_layers, d_model = check_count("n_layers", n_layers), check_count("d_model", d_model)
    n_heads, seq_len = check_count("n_heads", n_heads), check_count("seq_len", seq_len)
    vocab_size = check_count("vocab_size", vocab_size)
    n_positions = check_count("n_positions", n_positions, minimum=0)
    if d_model % n_heads:
        raise ValueError(
            f"d_model={d_model} is not divisible by n_heads={n_heads}; the head size "
            "d_model / n_heads must be whole: change one of them."
        )
    ffw = 4 * d_model if ffn_hidden is None else check_count("ffn_hidden", ffn_hidden)
    if ffn_kind not in ("gelu", "swiglu"):
        raise ValueError(
            f"ffn_kind={ffn_kind!r} is unknown; pass 'gelu' (two feed-forward "
            "matrices) or 'swiglu' (three)."
        )
    s = _kind_sparsity(sparsity, tie_embeddings)

    d, vocab = d_model, vocab_size
    n_ffn = 3 if ffn_kind == "swiglu" else 2
    layer = [("qkv", d * d)] * 3 + [("attn_out", d * d)] + [("ffn", d * ffw)] * n_ffn
    blocks = [(numel, _kept(numel, s[kind])) for kind, numel in layer] * n_layers
    head_kept = _kept(vocab * d, s["embedding" if tie_embeddings else "head"])
    matrices = (blocks + [(vocab * d, head_kept)]) if include_logits else blocks

    # Weight-free terms: attention logits, softmax and values per layer; embedding lookups.
    other = n_layers * (2 * seq_len * d + 3 * n_heads * seq_len + 2 * seq_len * d)
    if include_embeddings:
        other += 2 * (vocab + n_positions) * d

    params = sum(numel for numel, _ in blocks) + (vocab + n_positions) * d
    nonzero = sum(kept for _, kept in blocks) + _kept(vocab * d, s["embedding"]) + n_positions * d
    if not tie_embeddings:
        params += vocab * d
        nonzero += head_kept
    return report_from_matrices(seq_len, matrices, other, params, nonzero)


def model_flops(
    model: nn.Module,
    seq_len: int,
    *,
    n_layers: int | None = None,
    d_model: int | None = None,
    n_heads: int | None = None,
    sparsity: Mapping[str, float] | None = None,
    head: str = "lm_head",
    include_embeddings: bool = True,
    include_logits: bool = True,
    conv_positions: Mapping[str, int] | None = None,
) -> FlopReport:
    """Cost any module tree: its linear, convolution and embedding layers, plus attention.

    Rules (Chinchilla appendix F conventions):

    - each ``nn.Linear`` and Hugging Face ``Conv1D`` (GPT-2; a linear layer with its weight
      stored ``[in, out]``) costs ``2 * kept`` FLOPs per token for its weight (biases ignored);
      ``kept`` is ``sparsity[name]`` if given, else the count of True in the ``<param>_mask``
      buffer on the owning module, else ``numel`` (dense). A tied head finds the mask through the
      shared parameter. Each module counts once, however often the forward calls it.
    - each ``nn.Conv2d`` costs ``2 * kept * H_out * W_out`` per "token" (one input example:
      use ``seq_len=1`` for images): every kept weight is one multiply-add at every output
      position (the usual convention, e.g. Evci et al. 2020, arXiv:1911.11134, appendix H).
      ``H_out * W_out`` is ``conv_positions[module name]``; without an entry it is 1, i.e. the
      FLOPs are per output position (the dense/sparse ratio is then exact only when all convs
      have the same output size; :func:`conv_output_positions` measures them).
    - each ``nn.Embedding`` costs ``2 * num_embeddings * embedding_dim`` per token (dense).
    - attention logits, softmax and values come from ``n_layers``, ``d_model`` and ``n_heads``
      (all three or none): ``n_layers * (4 * seq * d + 3 * heads * seq)`` per token.
    - other modules (norms, activations) cost nothing; all parameters count toward ``params``.

    Nothing is allocated or computed on the weights, so a model built under
    ``torch.device("meta")`` works; its masks cannot be counted, so pass ``sparsity``.

    Args:
        model: the model.
        seq_len: tokens per sequence.
        n_layers: transformer blocks, for the attention terms.
        d_model: attention width ``key_size * n_heads``.
        n_heads: attention heads.
        sparsity: ``{parameter name: sparsity}`` (names as in ``model.named_parameters()``),
            overriding masks.
        head: module name of the output head, dropped from FLOPs when ``include_logits=False``.
        include_embeddings: count embedding FLOPs.
        include_logits: count the head's FLOPs.
        conv_positions: ``{Conv2d module name: H_out * W_out}``.

    Returns:
        The :class:`FlopReport`.

    Raises:
        ValueError: bad sizes, unknown parameter names or sparsity outside ``[0, 1)`` in
            ``sparsity``, a mask on the meta device without a ``sparsity`` entry, a missing head,
            a ``conv_positions`` name that is not an ``nn.Conv2d``.
    """
    check_count("seq_len", seq_len)
    kept = _kept_by_param(model, sparsity or {})

    matrices: list[tuple[int, int]] = []
    other = 0
    modules = dict(model.named_modules())
    if not include_logits and head not in modules:
        raise ValueError(
            f"include_logits=False but the model has no module named {head!r}; pass "
            "head=<name of the output nn.Linear>."
        )
    positions = dict(conv_positions or {})
    for name, value in positions.items():
        if not isinstance(modules.get(name), nn.Conv2d):
            raise ValueError(
                f"conv_positions names {name!r}, which is not an nn.Conv2d of the model; use "
                "Conv2d module names from model.named_modules() (conv_output_positions does)."
            )
        check_count(f"conv_positions[{name!r}]", value)
    for name, module in modules.items():
        linear = isinstance(module, nn.Linear) or is_hf_conv1d(module)
        if linear and (include_logits or name != head):
            w = module.weight
            matrices.append((w.numel(), kept.get(id(w), w.numel())))
        elif isinstance(module, nn.Conv2d):
            w, hw = module.weight, positions.get(name, 1)
            matrices.append((w.numel() * hw, kept.get(id(w), w.numel()) * hw))
        elif isinstance(module, nn.Embedding) and include_embeddings:
            other += 2 * module.num_embeddings * module.embedding_dim

    attention = {"n_layers": n_layers, "d_model": d_model, "n_heads": n_heads}
    if any(v is not None for v in attention.values()):
        for key, given in attention.items():
            if given is None:
                raise ValueError(
                    f"{key} is missing; attention terms need n_layers, d_model and "
                    "n_heads together: pass all three, or none to leave them out."
                )
            check_count(key, given)
        if n_layers is not None and d_model is not None and n_heads is not None:  # all: above
            other += n_layers * (4 * seq_len * d_model + 3 * n_heads * seq_len)

    params = list(model.parameters())
    nonzero = sum(kept.get(id(p), p.numel()) for p in params)
    return report_from_matrices(seq_len, matrices, other, sum(p.numel() for p in params), nonzero)


class ConvPositionRecorder:
    """Records ``{Conv2d name: H_out * W_out}`` from the forwards ``model`` runs (forward hooks,
    first call per module), for :func:`model_flops`'s ``conv_positions``; ``remove()`` ends it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.positions: dict[str, int] = {}
        self._handles = [
            module.register_forward_hook(self._recorder(name))
            for name, module in model.named_modules()
            if isinstance(module, nn.Conv2d)
        ]
        self.convs = len(self._handles)

    @property
    def complete(self) -> bool:
        """Whether every Conv2d has run (its output size is known)."""
        return len(self.positions) >= self.convs

    def _recorder(self, name: str) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def record(_module: nn.Module, _inputs: object, out: torch.Tensor) -> None:
            if torch.is_tensor(out) and out.ndim >= 3:
                self.positions.setdefault(name, out.shape[-2] * out.shape[-1])

        return record

    def remove(self) -> None:
        """Remove the hooks (the positions recorded so far stay)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def batch_shape(batch: object) -> tuple[int, int] | None:
    """``(sequences, tokens per sequence)`` of a training batch, as the FLOP counts read it.

    - integer ``[B, T + 1]`` token windows (inputs plus the shifted target) -> ``(B, T)``;
    - floating ``[B, ...]`` examples (images ``[B, C, H, W]``, feature vectors) -> ``(B, 1)``:
      one "token" per example, so Conv2d layers cost ``2 * kept * H_out * W_out`` each;
    - a tuple or list (``(inputs, labels)``) is read through its first element;
    - ``None`` for anything else.
    """
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    if not torch.is_tensor(first) or first.ndim < 2:
        return None
    if first.is_floating_point():
        return first.shape[0], 1
    if first.ndim == 2 and first.shape[1] >= 2:
        return first.shape[0], first.shape[1] - 1
    return None


def conv_output_positions(model: nn.Module, *inputs: object) -> dict[str, int]:
    """``{Conv2d name: H_out * W_out}`` measured by one no-grad forward of ``model(*inputs)``.

    Pass one example (batch size 1 is enough); the result is :func:`model_flops`'s
    ``conv_positions``.
    """
    recorder = ConvPositionRecorder(model)
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        recorder.remove()
    return recorder.positions


def _kept_by_param(model: nn.Module, sparsity: Mapping[str, float]) -> dict[int, int]:
    """Kept weights of each parameter with a ``sparsity`` entry or a mask, keyed by ``id(param)``.

    Keyed by identity so a tied head finds the mask registered beside the embedding weight.
    """
    named = dict(model.named_parameters(remove_duplicate=False))
    kept: dict[int, int] = {}
    masked: dict[int, torch.Tensor] = {}  # counted together: one host transfer
    for name, value in sparsity.items():
        if name not in named:
            raise ValueError(
                f"sparsity names {name!r}, which is not a parameter of the model; use "
                "names from model.named_parameters(), e.g. 'layers.0.fc1.weight'."
            )
        kept[id(named[name])] = _kept(named[name].numel(), _check_sparsity(name, value))
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            mask = getattr(module, mask_buffer_name(param_name), None)
            if not isinstance(mask, torch.Tensor) or id(param) in kept or id(param) in masked:
                continue
            if mask.is_meta:
                name = f"{module_name}.{param_name}".lstrip(".")
                raise ValueError(
                    f"the mask of {name!r} is on the meta device, so its nonzeros "
                    f"cannot be counted; pass sparsity={{{name!r}: <sparsity>}}."
                )
            masked[id(param)] = mask
    kept.update(zip(masked, host_counts(list(masked.values())), strict=True))
    return kept


def _kind_sparsity(sparsity: float | Mapping[str, float], tied: bool) -> dict[str, float]:
    """Per-kind sparsity from a float (block matrices only) or a validated mapping."""
    if not isinstance(sparsity, Mapping):
        sparsity = dict.fromkeys(_BLOCK_KINDS, sparsity)
    unknown = set(sparsity) - set(MATRIX_KINDS)
    if unknown:
        raise ValueError(
            f"unknown sparsity keys {sorted(unknown)}; the keys are matrix kinds "
            f"{list(MATRIX_KINDS)}: rename them."
        )
    if tied and "head" in sparsity:
        raise ValueError(
            "tie_embeddings=True makes the head the embedding matrix, so it has no "
            "own sparsity; set sparsity['embedding'] instead of sparsity['head']."
        )
    return {kind: _check_sparsity(kind, sparsity.get(kind, 0.0)) for kind in MATRIX_KINDS}


def _kept(numel: int, sparsity: float) -> int:
    """Weights a mask of ``sparsity`` keeps (design.md: ``int((1 - s) * n)``)."""
    return int((1.0 - sparsity) * numel)


def _check_sparsity(name: str, value: float) -> float:
    return validate.sparsity(value, where=name)
