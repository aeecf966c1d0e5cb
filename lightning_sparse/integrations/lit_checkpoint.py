"""`load_lit_checkpoint`: the `LitCausalLM` of a ``lightning-sparse fit`` checkpoint, rebuilt
without running anything a file names.

A checkpoint names its module's class (``hyper_parameters["_class_path"]``), and the run's
``config.yaml`` names the model a recipe gives `LitCausalLM` (``model.init_args.model``, which
the module does not save in its hyper-parameters). Both are strings from files, so each class
path found in them is checked against an allow-list before any module is imported or any class
built: this package's `LitCausalLM`, `Llama` and `HFCausalLM`, plus the classes the caller passes
(``model_classes``). The file itself is read weights-only (`load_torch_file`).

The config is read only from the run directory ``lightning-sparse fit`` writes: ``config.yaml``
of ``version_N/`` for a checkpoint in ``version_N/checkpoints/`` (see `plan_run_dir` in
``app/cli.py``), or from the file the caller names (``run_config``); never from any other folder,
so a checkpoint copied into ``downloads/`` does not pick up a config lying around there.

Masks: checkpoints written before masks moved out of the model hold ``<param>_mask`` entries;
they are dropped (`strip_masks`, which also zeroes the pruned weights), so the rebuilt module is
dense with exact zeros either way, and `export` finds the sparse weights from their zeros.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_sparse.core.safe_load import load_torch_file
from lightning_sparse.core.state_dict import strip_masks
from lightning_sparse.models.hf import HFCausalLM
from lightning_sparse.models.lit_lm import LitCausalLM
from lightning_sparse.models.llama import Llama

__all__ = ["load_lit_checkpoint", "run_config_of"]

_OWN_CLASSES = (LitCausalLM, Llama, HFCausalLM)
_CHECKPOINT_DIR = "checkpoints"  # plan_run_dir: <run>/checkpoints/*.ckpt beside <run>/config.yaml


def load_lit_checkpoint(
    path: str | Path,
    *,
    model_classes: Iterable[type] = (),
    run_config: str | Path | None = None,
    trust_file: bool = False,
) -> LitCausalLM:
    """The `LitCausalLM` of a ``lightning-sparse fit`` checkpoint, in eval mode, mask-free.

    Args:
        path: the ``.ckpt`` file.
        model_classes: classes the checkpoint's ``_class_path`` (a `LitCausalLM` subclass) or
            the run config's ``model.init_args.model`` may name, besides this package's own.
        run_config: the run's ``config.yaml``, for a checkpoint moved out of its run directory.
        trust_file: unpickle objects other than tensors and plain values (runs code from a
            crafted file: only for a file from a source you trust).

    Raises:
        FileNotFoundError: no file at ``path`` or ``run_config``.
        ValueError: a class path outside the allow-list (nothing imported), a module that is
            not a `LitCausalLM`, weights that do not fit the module its hyper-parameters
            describe, an unreadable checkpoint or config (`UntrustedFileError` for a file
            holding arbitrary objects).
    """
    path = Path(path)
    checkpoint = load_torch_file(
        path, trust_file=trust_file, what="checkpoint", opt_in="trust_file=True (CLI: --trust-file)"
    )
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(
            f"checkpoint {str(path)!r} has no 'state_dict'; pass a Lightning checkpoint written "
            "by lightning-sparse fit (or build the model yourself and export the object)"
        )
    allowed = _allowed_names((*_OWN_CLASSES, *model_classes))
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    class_path = hparams.pop("_class_path", "lightning_sparse.models.LitCausalLM")
    _check_class_paths(hparams, allowed, f"checkpoint {str(path)!r}")
    cls = allowed.get(class_path) if isinstance(class_path, str) else None
    if cls is None:
        raise ValueError(
            f"checkpoint {str(path)!r} names the class {class_path!r}, which export does not "
            f"import from a file (allowed: {sorted(allowed)}); if you trust it, pass the class "
            "itself: export(..., model_classes=[TheClass])"
        )
    if not issubclass(cls, LitCausalLM):
        raise ValueError(
            f"checkpoint {str(path)!r} holds a {class_path!r}, not a "
            "lightning_sparse.models.LitCausalLM; export the model object instead"
        )
    if hparams.get("build_sparse"):  # the model is rebuilt to load dense weights into
        hparams["build_sparse"] = False
    config = Path(run_config) if run_config is not None else run_config_of(path)
    submodel = _recipe_model(config, allowed) if config is not None else None
    if submodel is not None:
        hparams["model"] = submodel
    try:
        if isinstance(submodel, dict):
            from lightning.pytorch.cli import instantiate_module

            with warnings.catch_warnings():  # Lightning calls a jsonargparse method it deprecated
                warnings.simplefilter("ignore", DeprecationWarning)
                module = instantiate_module(cls, hparams)  # builds the (checked) class_path entry
        else:
            module = cls(**hparams)
        module.load_state_dict(_dense(strip_masks(checkpoint["state_dict"])), strict=True)
    except (RuntimeError, TypeError, ValueError, KeyError) as err:
        config_hint = (
            f"the run config {str(config)!r}" if config is not None else "no run config.yaml"
        )
        raise ValueError(
            f"cannot rebuild the module of checkpoint {str(path)!r} from its hyper-parameters "
            f"and {config_hint} ({type(err).__name__}: {' '.join(str(err).split())[:300]}...); "
            "pass run_config= (CLI: --run_config) the run's config.yaml, or build the "
            "LitCausalLM yourself, load the checkpoint's state_dict and export it"
        ) from err
    return module.eval()


def run_config_of(ckpt: str | Path) -> Path | None:
    """``<run>/config.yaml`` for a checkpoint ``<run>/checkpoints/<name>.ckpt``; ``None`` for a
    checkpoint anywhere else or when that file does not exist."""
    ckpt = Path(ckpt)
    if ckpt.parent.name != _CHECKPOINT_DIR:
        return None
    config = ckpt.parent.parent / "config.yaml"
    return config if config.is_file() else None


def _recipe_model(config: Path, allowed: dict[str, type]) -> Any:
    """``model.init_args.model`` of ``config`` (``None`` if none), its class paths checked."""
    import yaml

    if not config.is_file():
        raise FileNotFoundError(f"run config {str(config)!r} is not a file; fix the path")
    try:
        recipe = yaml.safe_load(config.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"run config {str(config)!r} is not valid YAML ({err})") from err
    model = recipe.get("model") if isinstance(recipe, dict) else None
    init_args = model.get("init_args") if isinstance(model, dict) else None
    submodel = init_args.get("model") if isinstance(init_args, dict) else None
    if isinstance(submodel, str):  # jsonargparse reads a bare string as a class path
        submodel = {"class_path": submodel}
    _check_class_paths(submodel, allowed, f"run config {str(config)!r} (model.init_args.model)")
    return submodel


def _check_class_paths(value: Any, allowed: dict[str, type], source: str) -> None:
    for class_path in _class_paths(value):
        if class_path not in allowed:
            raise ValueError(
                f"{source} names the class {class_path!r}, which export does not import from a "
                f"file (allowed: {sorted(allowed)}); if you trust it, pass the class itself: "
                "export(..., model_classes=[TheClass]), or build the model yourself and export "
                "the object"
            )


def _class_paths(value: Any) -> Iterator[Any]:
    """Every ``class_path`` / ``_class_path`` value nested in dicts and lists."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("class_path", "_class_path"):
                yield item
            else:
                yield from _class_paths(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _class_paths(item)


def _allowed_names(classes: Iterable[type]) -> dict[str, type]:
    """``{class path: class}``: each class under its defining module and under every parent
    package that re-exports it (``lightning_sparse.models.LitCausalLM``). Nothing is imported."""
    names: dict[str, type] = {}
    for cls in classes:
        if not isinstance(cls, type):
            raise TypeError(f"model_classes holds {cls!r}, not a class; pass classes")
        names[f"{cls.__module__}.{cls.__qualname__}"] = cls
        parts = cls.__module__.split(".")
        for end in range(1, len(parts)):
            package = ".".join(parts[:end])
            if getattr(sys.modules.get(package), cls.__name__, None) is cls:
                names[f"{package}.{cls.__name__}"] = cls
    return names


def _dense(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each sparse CSR weight (a model built sparse wrote them) dense."""
    return {
        k: v.to_dense() if torch.is_tensor(v) and v.layout == torch.sparse_csr else v
        for k, v in state_dict.items()
    }
