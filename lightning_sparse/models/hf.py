"""`HFCausalLM`: a local Hugging Face causal LM (e.g. a Llama directory) as a plain logits module.

Optional: needs ``transformers``, which this package does not depend on. Nothing is downloaded
(``local_files_only=True``). Use it as `LitCausalLM`'s ``model`` in a recipe::

    model:
      class_path: lightning_sparse.models.LitCausalLM
      init_args:
        model:
          class_path: lightning_sparse.models.hf.HFCausalLM
          init_args: {path: /models/my-llama}

Parameter names keep Hugging Face's (``model.layers.0.self_attn.q_proj.weight``), so the recipes'
``param_filter: ["*layers.*_proj.weight"]`` selects the same layers as in this package's `Llama`.
The batches must hold token ids of the model's tokenizer; ``ByteTextDataModule`` gives bytes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import Tensor, nn

__all__ = ["HFCausalLM"]


class HFCausalLM(nn.Module):
    """Loads ``AutoModelForCausalLM`` from a local directory; ``forward`` returns the logits.

    Args:
        path: Directory with ``config.json`` and the weights (``save_pretrained`` output).
        torch_dtype: Passed to ``from_pretrained`` (``"auto"``, ``"float32"``, ...).

    Raises:
        ModuleNotFoundError: ``transformers`` is not installed.
        FileNotFoundError: ``path`` is not a directory with a ``config.json``.
    """

    def __init__(self, path: str, torch_dtype: str = "float32") -> None:
        super().__init__()
        if importlib.util.find_spec("transformers") is None:
            raise ModuleNotFoundError(
                f"loading the Hugging Face model at {path!r} needs the optional package "
                "'transformers', which is not installed; run `pip install transformers`, or use "
                "this package's Llama (drop model.model from the recipe)"
            )
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"{path!r} is not a local Hugging Face model directory (no config.json); pass the "
                "directory that save_pretrained() wrote (nothing is downloaded)"
            )
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, torch_dtype=torch_dtype
        )
        self.config = self.model.config  # read by SparseRunSummary for the attention FLOPs

    def forward(self, idx: Tensor) -> Tensor:
        """idx: [B, T] -> logits [B, T, vocab_size]."""
        return self.model(input_ids=idx, use_cache=False).logits
