"""Models trained with lightning_sparse: a small Llama decoder and its LightningModule."""

from lightning_sparse.models.lit_lm import LitCausalLM
from lightning_sparse.models.llama import PRESETS, Llama, LlamaConfig, generate

__all__ = ["PRESETS", "LitCausalLM", "Llama", "LlamaConfig", "generate"]
