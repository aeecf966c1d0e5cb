"""`HFCausalLM`: a Hugging Face causal LM (a local directory, or a config) as a plain logits module.

Optional: needs ``transformers``, which this package does not depend on. Nothing is downloaded
(``local_files_only=True``). Use it as `LitCausalLM`'s ``model`` in a recipe::

    model:
      class_path: lightning_sparse.models.LitCausalLM
      init_args:
        model:
          class_path: lightning_sparse.models.hf.HFCausalLM
          init_args: {path: /models/my-llama}      # or: {config: {model_type: llama, ...}}

``config=`` builds the architecture with random weights (no weights read), from a dict with a
``model_type`` key, a ``config.json`` file or a directory holding one; the weights come from
torch's global generator, which LightningCLI's ``seed_everything`` seeds before building.

The model is put in train mode: ``from_pretrained`` leaves it in eval mode, and Lightning does not
call ``.train()`` on submodules at fit start (it restores each submodule's own mode), so dropout
would silently stay off. Parameter names keep Hugging Face's (``model.layers.0.self_attn.q_proj
.weight``), so the recipes' ``param_filter: ["*layers.*_proj.weight"]`` selects the same layers
as in this package's `Llama`. The batches must hold token ids of the model's tokenizer
(``TokenizedTextDataModule``; ``ByteTextDataModule`` gives bytes).
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

from torch import Tensor, nn

__all__ = ["HFCausalLM"]


class HFCausalLM(nn.Module):
    """``AutoModelForCausalLM`` from a local directory or a config; ``forward`` returns logits.

    Args:
        path: Directory with ``config.json`` and the weights (``save_pretrained`` output).
        config: Instead of ``path``: a dict with ``model_type`` (``{"model_type": "llama",
            "hidden_size": 64, ...}``), a ``config.json`` file or a directory with one; the
            weights are randomly initialized.
        dtype: Parameter dtype (``"float32"``, ``"bfloat16"``, ``"auto"`` with ``path``).
        torch_dtype: Deprecated alias of ``dtype`` (Hugging Face renamed it); warns.

    Raises:
        ModuleNotFoundError: ``transformers`` is not installed.
        ValueError: Neither or both of ``path`` and ``config``; a config dict without
            ``model_type``; ``dtype`` and ``torch_dtype`` disagree.
        FileNotFoundError: ``path`` or ``config`` names no local ``config.json``.
    """

    def __init__(
        self,
        path: str | None = None,
        config: str | dict[str, Any] | None = None,
        dtype: str = "float32",
        torch_dtype: str | None = None,
    ) -> None:
        super().__init__()
        dtype = _resolve_dtype(dtype, torch_dtype)
        if (path is None) == (config is None):
            raise ValueError(
                f"HFCausalLM needs exactly one of path= (pretrained weights) and config= (random "
                f"init), got path={path!r} and config={config!r}"
            )
        if importlib.util.find_spec("transformers") is None:
            raise ModuleNotFoundError(
                f"building the Hugging Face model {path or config!r} needs the optional package "
                "'transformers', which is not installed; run `pip install transformers`, or use "
                "this package's Llama (drop model.model from the recipe)"
            )
        from transformers import AutoModelForCausalLM

        if path is not None:
            if not (Path(path) / "config.json").is_file():
                raise FileNotFoundError(
                    f"{path!r} is not a local Hugging Face model directory (no config.json); pass "
                    "the directory that save_pretrained() wrote (nothing is downloaded)"
                )
            self.model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=dtype
            )
        elif config is not None:  # always, given the exactly-one check above
            self.model = AutoModelForCausalLM.from_config(load_config(config), dtype=dtype)
        self.model.train()  # from_pretrained returns eval mode; Lightning will not undo it
        self.config = self.model.config  # read by SparseRunSummary for the attention FLOPs

    def forward(self, idx: Tensor) -> Tensor:
        """idx: [B, T] -> logits [B, T, vocab_size]."""
        return self.model(input_ids=idx, use_cache=False).logits


def load_config(config: str | dict[str, Any]) -> Any:
    """A ``PretrainedConfig`` from a dict with ``model_type``, a ``config.json`` or its directory.

    Raises:
        ValueError: A dict without ``model_type``.
        FileNotFoundError: The path is neither a file nor a directory with ``config.json``.
    """
    from transformers import AutoConfig

    if isinstance(config, dict):
        if "model_type" not in config:
            raise ValueError(
                f"config={config!r} has no 'model_type'; add one (e.g. model_type: llama, gpt2) "
                "so Hugging Face knows which architecture to build"
            )
        fields = dict(config)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    file = Path(config)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"config={config!r} is neither a config.json file nor a directory holding one; pass "
            "one, or a dict with model_type (nothing is downloaded)"
        )
    return AutoConfig.from_pretrained(str(file), local_files_only=True)


def _resolve_dtype(dtype: str, torch_dtype: str | None) -> str:
    """``dtype``, or the deprecated ``torch_dtype`` (with a warning) when only it was given."""
    if torch_dtype is None:
        return dtype
    if dtype not in ("float32", torch_dtype):
        raise ValueError(
            f"dtype={dtype!r} and its deprecated alias torch_dtype={torch_dtype!r} disagree; "
            "pass dtype only"
        )
    warnings.warn(
        f"HFCausalLM(torch_dtype={torch_dtype!r}) is deprecated (Hugging Face renamed it); "
        f"use dtype={torch_dtype!r}",
        FutureWarning,
        stacklevel=3,
    )
    return torch_dtype
