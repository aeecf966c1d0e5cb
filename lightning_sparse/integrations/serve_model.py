"""The model a file describes, built on the ``meta`` device, and the reader of its tensors:
what `serve.load_on_wse` fills.

`describe(path) -> (model, TensorFile)`:

- a directory (an export): ``config.json`` read by ``transformers.AutoConfig``; its
  architecture must be one of transformers' causal LMs (the class is taken from
  ``transformers`` itself, never imported by a name from the file; no remote code); a
  ``quantization_config`` other than compressed-tensors ``sparse-bitmask`` is refused;
- a Lightning checkpoint: ``torch.load(mmap=True, weights_only=True)``; its
  ``hyper_parameters._class_path``, if any, must name `LitCausalLM`; the model is this
  package's `Llama` from the hyper-parameters, or the `HFCausalLM` recorded in the run's
  ``config.yaml`` (``model.init_args.model``; no other class).

The model is built under ``torch.device("meta")``: no parameter is allocated. Its non-persistent
buffers are computed on the CPU: `Llama`'s rotary tables by `rope_tables`, a ``transformers``
model's by its own ``_init_weights`` (filled with NaN first, so a buffer it does not compute is
refused rather than left as garbage).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_sparse.integrations.serve_files import CheckpointFile, SafetensorsDir, TensorFile
from lightning_sparse.models.lit_lm import LitCausalLM
from lightning_sparse.models.llama import Llama, LlamaConfig, rope_tables

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["FIX", "describe"]

FIX = "pass a compressed or hf export directory, or a lightning-sparse fit checkpoint (.ckpt)"
"""The end of every message about a path that is not a model this package serves."""
_LIT_CLASSES = ("lightning_sparse.models.LitCausalLM", "lightning_sparse.models.lit_lm.LitCausalLM")
_HF_CLASSES = ("lightning_sparse.models.HFCausalLM", "lightning_sparse.models.hf.HFCausalLM")


def describe(path: Path) -> tuple[nn.Module, TensorFile]:
    """(the model ``path`` describes on the meta device, the reader of its tensors).

    Raises:
        ValueError: ``path`` is not an export directory or a checkpoint of a model served here.
        ModuleNotFoundError: a ``transformers`` model without ``transformers`` installed.
    """
    return _from_directory(path) if path.is_dir() else _from_checkpoint(path)


def _from_directory(path: Path) -> tuple[nn.Module, TensorFile]:
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json: it is not an export directory; {FIX}")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(path / 'config.json')!r} is not a model config: {err}") from err
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        quantization = quantization if isinstance(quantization, dict) else {}
        sparsity = quantization.get("sparsity_config") or {}
        if (
            quantization.get("quant_method") != "compressed-tensors"
            or quantization.get("config_groups")
            or sparsity.get("format", "sparse-bitmask") != "sparse-bitmask"
        ):
            method, layout = quantization.get("quant_method"), sparsity.get("format")
            raise ValueError(
                f"{str(path)!r} is quantized or compressed in a way not read here (quant_method "
                f"{method!r}, sparsity format {layout!r}); only unquantized compressed-tensors "
                "'sparse-bitmask' "
                "(lightning_sparse.export(..., format='compressed')) is read"
            )
        del config.quantization_config
    model = _hf_skeleton(config, str(path / "config.json"))
    if (path / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model, SafetensorsDir(path)


def _from_checkpoint(path: Path) -> tuple[nn.Module, TensorFile]:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, ValueError, OSError) as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{str(path)!r} is not a checkpoint torch.load reads safely (weights_only=True): "
            f"{first}; {FIX}"
        ) from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{str(path)!r} has no 'state_dict': not a Lightning checkpoint; {FIX}")
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    class_path = hparams.get("_class_path", _LIT_CLASSES[0])
    if class_path not in _LIT_CLASSES:
        raise ValueError(
            f"{str(path)!r} holds a {class_path!r}; generate serves checkpoints of "
            "lightning_sparse.models.LitCausalLM (export other models first)"
        )
    recipe_model = _recipe_model(path)
    if recipe_model is None:
        model: nn.Module = _llama_skeleton(hparams, str(path))
        return model, CheckpointFile(path, checkpoint["state_dict"], "model.")
    if not isinstance(recipe_model, dict) or recipe_model.get("class_path") not in _HF_CLASSES:
        raise ValueError(
            f"the run config next to {str(path)!r} gives model.init_args.model = "
            f"{recipe_model!r}; generate serves this package's Llama or HFCausalLM only"
        )
    from lightning_sparse.models.hf import load_config

    args = recipe_model.get("init_args") or {}
    config = load_config(args["config"] if args.get("config") is not None else args["path"])
    model = _hf_skeleton(config, str(path))
    return model, CheckpointFile(path, checkpoint["state_dict"], "model.model.")


def _recipe_model(ckpt: Path) -> Any:
    """``model.init_args.model`` of the run's ``config.yaml`` next to the checkpoint, or None."""
    import yaml

    for config in (ckpt.parent / "config.yaml", ckpt.parent.parent / "config.yaml"):
        if config.is_file():
            recipe = yaml.safe_load(config.read_text()) or {}
            model = recipe.get("model") if isinstance(recipe, dict) else None
            return ((model or {}).get("init_args") or {}).get("model")
    return None


# ----------------------------------------------------------------------------------- skeletons
def _hf_skeleton(config: Any, where: str) -> PreTrainedModel:
    """The ``transformers`` causal LM of ``config`` on the meta device, non-persistent buffers
    computed on the CPU."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    allowed: set[str] = set()
    for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        allowed.update((names,) if isinstance(names, str) else names)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture is None:
        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        architecture = architecture if isinstance(architecture, str) else None
    if architecture not in allowed or not hasattr(transformers, architecture):
        raise ValueError(
            f"{where}: architecture {architecture!r} is not one of transformers' causal LMs; "
            "generate serves AutoModelForCausalLM architectures only"
        )
    with torch.device("meta"):
        model = getattr(transformers, architecture)._from_config(config)
    for name, module in model.named_modules():
        buffers = [
            b for b in module._non_persistent_buffers_set if module._buffers.get(b) is not None
        ]
        if not buffers:
            continue
        if any(p is not None for p in module._parameters.values()) or any(
            not (module._buffers[b].is_floating_point()) for b in buffers
        ):
            raise ValueError(f"{where}: cannot compute the buffers {buffers} of {name!r}")
        for b in buffers:  # NaN until computed: left NaN means the model cannot make it
            module._buffers[b] = torch.full(module._buffers[b].shape, float("nan"))
        model._init_weights(module)
        if any(module._buffers[b].isnan().any() for b in buffers):
            raise ValueError(f"{where}: {architecture} does not compute {name!r}'s {buffers}")
    return model


def _llama_skeleton(hparams: dict[str, Any], where: str) -> Llama:
    """This package's `Llama` from a `LitCausalLM`'s hyper-parameters, on the meta device."""
    defaults = inspect.signature(LitCausalLM.__init__).parameters
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    values = {
        name: hparams.get(name, defaults[name].default) for name in fields if name in defaults
    }
    try:
        config = LlamaConfig(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: hyper_parameters do not describe a Llama: {err}") from err
    with torch.device("meta"):
        model = Llama(config)
    cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
    model.register_buffer("rope_cos", cos, persistent=False)
    model.register_buffer("rope_sin", sin, persistent=False)
    return model
