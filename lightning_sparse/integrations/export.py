"""`export`: a sparse causal LM as a Hugging Face ``save_pretrained`` directory.

Sources: a ``transformers`` causal LM (masks applied by an algorithm), `HFCausalLM` or this
package's `Llama` (mapped to ``LlamaForCausalLM``, see `llama_to_hf`), either inside a
`LitCausalLM`, or the path of a Lightning checkpoint written by ``lightning-sparse fit``.
Formats: ``hf`` (dense safetensors, pruned weights exactly zero, no mask entries) and
``compressed`` (compressed-tensors ``sparse-bitmask``, see `compressed`).

The live model is never modified (the weights come from `strip_masks`), and the directory
appears whole or not at all: it is written next to ``output`` and renamed into place.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_sparse.core.state_dict import model_masks, restore_masks, strip_masks
from lightning_sparse.models.hf import HFCausalLM
from lightning_sparse.models.lit_lm import LitCausalLM
from lightning_sparse.models.llama import Llama

__all__ = ["FORMATS", "export", "load_lit_checkpoint"]

FORMATS = ("hf", "compressed")
_MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
}


def export(
    source: nn.Module | str | Path,
    output: str | Path,
    format: str = "hf",  # noqa: A002  (the CLI's --format)
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``source`` to the directory ``output`` for ``AutoModelForCausalLM.from_pretrained``.

    Args:
        source: a model (see the module docstring) or a Lightning checkpoint path.
        output: the directory to create.
        format: ``"hf"`` (dense) or ``"compressed"`` (sparse-bitmask; load it with
            `lightning_sparse.integrations.compressed.load_compressed`).
        tokenizer: a tokenizer directory (``save_pretrained`` output) copied into ``output``.
        overwrite: replace an existing ``output``.

    Returns:
        ``output`` as a `Path`.

    Raises:
        ValueError: unknown format, ``output`` exists, a source that is not a causal LM.
        FileNotFoundError: the checkpoint or tokenizer directory does not exist.
        ModuleNotFoundError: ``transformers`` (or, for ``compressed``, ``compressed-tensors``)
            is missing.
    """
    # 1. Every check before anything is written.
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of {FORMATS}; use 'hf' or 'compressed'")
    _require("transformers", "pip install transformers")
    if format == "compressed":
        _require("compressed_tensors", "pip install compressed-tensors")
    output = Path(output)
    if output.exists() and not overwrite:
        raise ValueError(
            f"output={str(output)!r} already exists; choose a new directory or pass overwrite=True"
        )
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"tokenizer={str(tokenizer)!r} is not a directory")
        clashes = sorted(p.name for p in Path(tokenizer).iterdir() if p.name in _MODEL_FILES)
        if clashes:
            raise ValueError(
                f"tokenizer={str(tokenizer)!r} holds model files {clashes} that would replace "
                "the exported ones; pass a directory with only the tokenizer's files"
            )
    model = load_lit_checkpoint(source) if isinstance(source, (str, Path)) else source
    hf_model, state, sparse = _to_hf(model)

    # 2. Write into a sibling temporary directory, then swap it in.
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        hf_model.save_pretrained(tmp, state_dict=state)
        if format == "compressed":
            from lightning_sparse.integrations.compressed import compress_directory

            compress_directory(tmp, sparse)
        if tokenizer is not None:
            shutil.copytree(tokenizer, tmp, dirs_exist_ok=True)
        if output.exists():  # moved aside first, so output is never half old, half new
            old = tmp.with_name(tmp.name + ".old")
            output.rename(old)
            try:
                tmp.rename(output)
            except OSError:
                old.rename(output)
                raise
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def load_lit_checkpoint(path: str | Path) -> LitCausalLM:
    """The `LitCausalLM` of a ``lightning-sparse fit`` checkpoint, masks registered and loaded.

    The module is rebuilt from the checkpoint's hyper-parameters. `LitCausalLM` does not save its
    ``model`` argument there, so a model given in the recipe (``model.init_args.model``, e.g.
    `HFCausalLM`) is read from the run's ``config.yaml`` (``version_N/config.yaml`` next to
    ``version_N/checkpoints/``).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the checkpoint's module is not a `LitCausalLM`, or its weights do not fit
            the module its hyper-parameters describe.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} is not a file; pass a .ckpt file")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    class_path = hparams.get("_class_path", "lightning_sparse.models.LitCausalLM")
    module_name, _, class_name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, LitCausalLM)):
        raise ValueError(
            f"checkpoint {str(path)!r} holds a {class_path!r}, not a "
            "lightning_sparse.models.LitCausalLM; export the model object instead"
        )
    submodel = _recipe_model(path)
    if submodel is not None:
        hparams["model"] = submodel
    try:
        if isinstance(submodel, dict):
            from lightning.pytorch.cli import instantiate_module

            with warnings.catch_warnings():  # Lightning calls a jsonargparse method it deprecated
                warnings.simplefilter("ignore", DeprecationWarning)
                module = instantiate_module(LitCausalLM, hparams)  # builds the class_path entry
        else:
            module = cls(**{k: v for k, v in hparams.items() if k != "_class_path"})
        restore_masks(module, checkpoint)  # the callback state, or old state-dict entries
        module.load_state_dict(checkpoint["state_dict"], strict=True)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"cannot rebuild the module of checkpoint {str(path)!r} from its hyper-parameters "
            f"({type(err).__name__}: {' '.join(str(err).split())[:300]}...); build the "
            "LitCausalLM yourself, load the checkpoint (lightning_sparse.restore_masks, then "
            "load_state_dict) and export it"
        ) from err
    return module.eval()


def _recipe_model(ckpt: Path) -> Any:
    """``model.init_args.model`` of the run's ``config.yaml`` (``None`` if there is none)."""
    import yaml

    for config in (ckpt.parent / "config.yaml", ckpt.parent.parent / "config.yaml"):
        if config.is_file():
            recipe = yaml.safe_load(config.read_text()) or {}
            return ((recipe.get("model") or {}).get("init_args") or {}).get("model")
    return None


def _to_hf(model: nn.Module) -> tuple[nn.Module, dict[str, Any], list[str]]:
    """(a ``transformers`` model to save with, its mask-free state dict, the sparse weight keys)."""
    while isinstance(model, (LitCausalLM, HFCausalLM)):
        model = model.model
    sparse = list(model_masks(model))
    if isinstance(model, Llama):
        from lightning_sparse.integrations.llama_to_hf import hf_llama_name, to_hf_llama

        hf_model = to_hf_llama(model, strip_masks(model))
        return hf_model, strip_masks(hf_model), [hf_llama_name(n) for n in sparse]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = getattr(model, "config", None)
    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None), ())
    names = (names,) if isinstance(names, str) else names
    if type(model).__name__ not in names or not hasattr(model, "save_pretrained"):
        raise ValueError(
            f"cannot export a {type(model).__name__}: AutoModelForCausalLM would not load it "
            "back; pass a transformers causal LM (e.g. LlamaForCausalLM, not "
            "...ForSequenceClassification), lightning_sparse's Llama, HFCausalLM or a "
            "LitCausalLM holding one"
        )
    return model, strip_masks(model), sparse


def _require(package: str, install: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(
            f"export needs the optional package {package!r}, which is not installed; run "
            f"`{install}` (or `pip install lightning_sparse[hf]` for both)"
        )
