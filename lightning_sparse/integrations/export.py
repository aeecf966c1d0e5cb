"""`export`: a sparse causal LM as a Hugging Face ``save_pretrained`` directory.

Sources: a ``transformers`` causal LM (masks applied by an algorithm), `HFCausalLM` or this
package's `Llama` (mapped to ``LlamaForCausalLM``, see `llama_to_hf`), either inside a
`LitCausalLM`, or the path of a Lightning checkpoint written by ``lightning-sparse fit`` (rebuilt
by `load_lit_checkpoint`: read weights-only, class names checked before anything is imported).
Formats: ``hf`` (dense safetensors, pruned weights exactly zero, no mask entries) and
``compressed`` (compressed-tensors ``sparse-bitmask``, see `compressed`). The compressed export
of a checkpoint of a model built sparse is written from the checkpoint, one layer dense at a
time, without the model (`export_compact`).

The live model is never modified (the weights come from `strip_masks`). The directory appears
whole or not at all, and ``overwrite`` replaces only an export this package wrote (see
`export_dir`: the marker file, the staging directory, the crash-safe swap).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_sparse.core.file_modes import give_default_mode
from lightning_sparse.core.safe_load import load_torch_file
from lightning_sparse.core.state_dict import strip_masks
from lightning_sparse.integrations import export_dir
from lightning_sparse.integrations.choices import EXPORT_FORMATS
from lightning_sparse.integrations.export_compact import compact_llama, write_compressed
from lightning_sparse.integrations.lit_checkpoint import load_lit_checkpoint
from lightning_sparse.models.hf import HFCausalLM
from lightning_sparse.models.lit_lm import LitCausalLM
from lightning_sparse.models.llama import Llama

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["FORMATS", "export", "load_lit_checkpoint"]

FORMATS = EXPORT_FORMATS
_MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    export_dir.MARKER,
}


def export(
    source: nn.Module | str | Path,
    output: str | Path,
    format: str = "hf",  # noqa: A002  (the CLI's --format)
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
    *,
    model_classes: Iterable[type] = (),
    run_config: str | Path | None = None,
    trust_file: bool = False,
) -> Path:
    """Write ``source`` to the directory ``output`` for ``AutoModelForCausalLM.from_pretrained``.

    Args:
        source: a model (see the module docstring) or a Lightning checkpoint path.
        output: the directory to create.
        format: ``"hf"`` (dense) or ``"compressed"`` (sparse-bitmask; load it with
            `lightning_sparse.integrations.compressed.load_compressed`).
        tokenizer: a tokenizer directory (``save_pretrained`` output) copied into ``output``.
        overwrite: replace ``output`` if it is an empty directory or an export this package
            wrote that holds nothing else (its ``lightning_sparse_export.json`` lists the
            files); any other existing ``output`` is refused and left untouched.
        model_classes: (checkpoint source) classes the checkpoint or its run config may name
            besides this package's `LitCausalLM`, `Llama` and `HFCausalLM`.
        run_config: (checkpoint source) the run's ``config.yaml``; by default the one of the
            run directory the checkpoint is in (``version_N/`` for ``version_N/checkpoints/``).
        trust_file: (checkpoint source) unpickle arbitrary objects: runs code from a crafted
            file, so only for a checkpoint from a source you trust.

    Returns:
        ``output`` as a `Path`.

    Raises:
        ValueError: unknown format; ``output`` exists (without ``overwrite``, or not a
            replaceable export); a source that is not a causal LM; a checkpoint that is refused
            (see `load_lit_checkpoint`).
        FileNotFoundError: the checkpoint or tokenizer directory does not exist.
        ModuleNotFoundError: ``transformers`` (or, for ``compressed``, ``compressed-tensors``)
            is missing.
        OSError: writing failed (no space, no permission); ``output`` is as it was.
    """
    # 1. Every check before anything is written (a killed export's leftovers are put right).
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of {FORMATS}; use 'hf' or 'compressed'")
    _require("transformers", "pip install transformers")
    if format == "compressed":
        _require("compressed_tensors", "pip install compressed-tensors")
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"tokenizer={str(tokenizer)!r} is not a directory")
        clashes = sorted(p.name for p in Path(tokenizer).iterdir() if p.name in _MODEL_FILES)
        if clashes:
            raise ValueError(
                f"tokenizer={str(tokenizer)!r} holds model files {clashes} that would replace "
                "the exported ones; pass a directory with only the tokenizer's files"
            )
    output = Path(output)
    _guard(lambda: export_dir.recover(output), output)  # finish a killed export's cleanup
    if output.exists() or output.is_symlink():
        if not overwrite:
            raise ValueError(
                f"output={str(output)!r} already exists; choose a new directory or pass "
                "overwrite=True (which replaces only an export written by lightning_sparse)"
            )
        export_dir.check_replaceable(output)
    compact = None
    if isinstance(source, (str, Path)) and format == "compressed":
        # A checkpoint of a model built sparse: written from the checkpoint, never dense.
        compact = compact_llama(_checkpoint(source, trust_file))
    if compact is not None:
        cfg, weights = compact

        def save(path: Path) -> None:
            write_compressed(path, cfg, weights)

    else:
        if isinstance(source, (str, Path)):
            model: nn.Module = load_lit_checkpoint(
                source, model_classes=model_classes, run_config=run_config, trust_file=trust_file
            )
        else:
            model = source
        hf_model, state = _to_hf(model)

        def save(path: Path) -> None:
            hf_model.save_pretrained(path, state_dict=state)
            if format == "compressed":
                from lightning_sparse.integrations.compressed import compress_directory

                compress_directory(path)

    # 2. Write into a hidden staging directory beside output, then swap it in.
    def write() -> Path:
        output.parent.mkdir(parents=True, exist_ok=True)
        return export_dir.staging_dir(output)

    staging = _guard(write, output)
    try:
        _guard(lambda: _write(staging, save, format, tokenizer), output)
        _guard(lambda: export_dir.publish(staging, output), output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def _checkpoint(path: str | Path, trust_file: bool) -> dict[str, Any]:
    """The checkpoint at ``path`` (weights only unless ``trust_file``), or an empty dict for
    something `load_lit_checkpoint` then reports."""
    loaded = load_torch_file(
        path, trust_file=trust_file, what="checkpoint", opt_in="trust_file=True (CLI: --trust-file)"
    )
    return loaded if isinstance(loaded, dict) else {}


def _write(path: Path, save: Callable[[Path], None], fmt: str, tokenizer: Any) -> None:
    save(path)  # config.json and the weights (compressed for fmt "compressed")
    _add_transformers4_fields(path / "config.json")
    if tokenizer is not None:
        shutil.copytree(tokenizer, path, dirs_exist_ok=True)
    for file in path.rglob("*"):  # safetensors writes through mkstemp: 0o600, not the umask's
        give_default_mode(file)
    export_dir.write_marker(path, fmt)  # last: a directory without it is not an export


def _guard(step: Any, output: Path) -> Any:
    """Run ``step()``; an OS or safetensors error becomes an `OSError` naming ``output``, the
    file and the fix (the original is its ``__cause__``)."""
    from safetensors import SafetensorError

    try:
        return step()
    except (OSError, SafetensorError) as err:
        code = getattr(err, "errno", None)
        text = " ".join(str(err).split())
        if code == errno.ENOSPC or "No space left" in text or "StorageFull" in text:
            fix = "free space on that disk, or choose an output on another disk"
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS) or "ermission denied" in text:
            fix = "choose an output in a directory you can write to"
        else:
            fix = "check the path and the disk, then run the export again"
        filename = getattr(err, "filename", None)
        where = f" ({filename})" if filename else ""
        raise OSError(
            f"export to {str(output)!r} failed{where}: {text[:300]}; {fix}. Anything already at "
            "that path was left as it was"
        ) from err


def _add_transformers4_fields(config_path: Path) -> None:
    """Also write the config fields transformers 4.x reads where transformers 5 renamed them:
    ``rope_theta`` (5 writes RoPE's base only inside ``rope_parameters``; 4.x would silently use
    10000) and ``torch_dtype`` (5 writes ``dtype``; 4.x's ``torch_dtype="auto"`` reads this one).
    transformers 5 reads both without a warning."""
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters")
    extra = {}
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        extra["rope_theta"] = rope["rope_theta"]
    if "dtype" in config and "torch_dtype" not in config:
        extra["torch_dtype"] = config["dtype"]
    if extra:
        config_path.write_text(json.dumps({**config, **extra}, indent=2, sort_keys=True) + "\n")


def _to_hf(model: nn.Module) -> tuple[PreTrainedModel, dict[str, Any]]:
    """(a ``transformers`` model to save with, its mask-free state dict)."""
    while isinstance(model, (LitCausalLM, HFCausalLM)):
        model = model.model
    if isinstance(model, Llama):
        from lightning_sparse.integrations.llama_to_hf import to_hf_llama

        hf_model = to_hf_llama(model, strip_masks(model))
        return hf_model, strip_masks(hf_model)
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = getattr(model, "config", None)
    found = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(getattr(config, "model_type", "")), ())
    names = (found,) if isinstance(found, str) else tuple(found)
    if type(model).__name__ not in names or not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"cannot export a {type(model).__name__}: AutoModelForCausalLM would not load it "
            "back; pass a transformers causal LM (e.g. LlamaForCausalLM, not "
            "...ForSequenceClassification), lightning_sparse's Llama, HFCausalLM or a "
            "LitCausalLM holding one"
        )
    return model, strip_masks(model)


def _require(package: str, install: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(
            f"export needs the optional package {package!r}, which is not installed; run "
            f"`{install}` (or `pip install lightning_sparse[hf]` for both)"
        )
