"""`load_on_wse`: a sparse causal LM loaded straight onto the device in CSR, without ever building
its dense model, and `ServedModel.generate`.

Sources (`load_on_wse(path)`):

- a compressed export (``export(..., format="compressed")``, compressed-tensors
  ``sparse-bitmask``): each compressed weight of an `nn.Linear` or HF ``Conv1D`` becomes a
  `CompactLinear` built from its bitmask and kept values: no dense float copy of it exists at any
  time;
- an ``hf`` export (dense safetensors, pruned weights exactly zero) or a Lightning checkpoint of
  `LitCausalLM` (this package's `Llama`, or `HFCausalLM` as recorded in the run's
  ``config.yaml``): each weight is read alone (a transient dense tensor of one layer) and its
  nonzeros become a `CompactLinear`.

A weight runs in CSR where `compact.runs_in_csr` holds (sparse enough that its values and 16-bit
columns are at most half its dense bytes, the rule the executor applies to decode, about 67%
sparsity in fp32); denser weights, shared (tied) ones and those of other modules are loaded as
ordinary dense parameters.

The model is built on the ``meta`` device (no parameter allocated), then each tensor is read,
converted and installed in turn, so peak memory stays about one layer's transient above what the
served model holds. Non-persistent buffers (rotary tables) are computed: this package's `Llama`
by `rope_tables`, a ``transformers`` model by its own ``_init_weights``. Files are untrusted:
``config.json``'s architecture must be one of transformers' causal LMs (no remote code),
checkpoints load with ``weights_only=True`` and name no module this package imports.
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import json
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sparse.core.layouts import is_hf_conv1d
from lightning_sparse.integrations.serve_files import (
    CheckpointFile,
    SafetensorsDir,
    TensorFile,
    compressed_groups,
)
from lightning_sparse.models.lit_lm import LitCausalLM
from lightning_sparse.models.llama import Llama, LlamaConfig, generate, rope_tables
from lightning_sparse.wse.compact import CompactLinear, runs_in_csr, unpack_bitmask

__all__ = ["INFERENCE_DTYPES", "ServedModel", "load_on_wse"]

INFERENCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LIT_CLASSES = ("lightning_sparse.models.LitCausalLM", "lightning_sparse.models.lit_lm.LitCausalLM")
_HF_CLASSES = ("lightning_sparse.models.HFCausalLM", "lightning_sparse.models.hf.HFCausalLM")
_FIX = "pass a compressed or hf export directory, or a lightning-sparse fit checkpoint (.ckpt)"


@dataclass
class ServedModel:
    """A model loaded by `load_on_wse`.

    Attributes:
        model: the `Llama` or ``transformers`` causal LM, eval mode, no gradients, its sparse
            layers `CompactLinear`.
        source: the directory or checkpoint it came from.
        layers: ``{module name: CompactLinear}`` of the layers in CSR.
        dense_layers: names of the `nn.Linear`/``Conv1D`` weights left dense (too dense for CSR
            to pay, or shared).
    """

    model: nn.Module
    source: Path
    layers: dict[str, CompactLinear]
    dense_layers: list[str]

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes."""
        config = self.model.config
        if isinstance(self.model, Llama):
            return config.max_seq_len
        return int(getattr(config, "max_position_embeddings", None) or 2**31 - 1)

    def held_bytes(self) -> int:
        """Bytes of every parameter and buffer the model holds (CSR layers included)."""
        seen: set[int] = set()
        total = 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes
        return total

    def csr_dense_bytes(self) -> tuple[int, int]:
        """(bytes the CSR layers hold, bytes their weights would take dense in fp32/fp64)."""
        held = sum(layer.nbytes for layer in self.layers.values())
        dense = sum(
            layer.out_features * layer.in_features * layer.compute_dtype.itemsize
            for layer in self.layers.values()
        )
        return held, dense

    def logits(self, ids: Tensor) -> Tensor:
        """``ids [B, T]`` -> logits ``[B, T, vocab]`` (no cache)."""
        with torch.no_grad():
            if isinstance(self.model, Llama):
                return self.model(ids)
            return self.model(input_ids=ids, use_cache=False).logits

    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continues ``ids [B, T]`` by up to ``max_new_tokens`` tokens (greedy at temperature 0)
        with the model's KV cache: `Llama.generate`, or ``transformers``' ``generate`` (which
        stops early at the end-of-sequence token). Returns ``[B, T + n]``.

        Raises:
            ValueError: the result would exceed a ``transformers`` model's positions.
        """
        if isinstance(self.model, Llama):
            return generate(
                self.model, ids, max_new_tokens, self.max_positions, temperature, top_k, generator
            )
        if ids.shape[1] + max_new_tokens > self.max_positions:
            raise ValueError(
                f"{ids.shape[1]} prompt tokens + max_new_tokens={max_new_tokens} exceed the "
                f"model's {self.max_positions} positions; shorten the prompt or generate fewer"
            )
        config = self.model.generation_config
        options: dict[str, Any] = {"do_sample": temperature > 0, "max_new_tokens": max_new_tokens}
        if temperature > 0:
            options.update(temperature=temperature, top_k=top_k or 0, top_p=1.0)
        else:  # a sampling-only setting left in generation_config.json would warn
            options.update(temperature=None, top_k=None, top_p=None)
        if config.pad_token_id is None:
            eos = config.eos_token_id
            options["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) or 0
        with torch.no_grad():
            return self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **options
            )

    def describe(self) -> str:
        """One line: what runs in CSR and the memory it holds."""
        held, dense = self.csr_dense_bytes()
        ratio = f" ({held / dense:.2f}x their dense bytes)" if dense else ""
        return (
            f"{len(self.layers)} layers in CSR, {held:,} bytes{ratio}; "
            f"{len(self.dense_layers)} Linear layers dense; model holds {self.held_bytes():,} bytes"
        )


def load_on_wse(path: str | Path, *, inference_dtype: str | None = None) -> ServedModel:
    """Loads a sparse causal LM onto the device in CSR without materialising the dense model.

    Args:
        path: a compressed or ``hf`` export directory, or a ``lightning-sparse fit`` checkpoint.
        inference_dtype: storage of the kept values: None keeps the file's (float16 becomes
            float32), "float32", or "bfloat16" (half the value bytes; every product is summed
            in float32). Everything else runs in float32 (float64 for a float64 model).

    Returns:
        The `ServedModel`.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: not an export directory or checkpoint this package reads, a file that does
            not match its config (named key, both shapes), no weight sparse enough for CSR.
        ModuleNotFoundError: a directory or HF checkpoint without ``transformers`` installed.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist; {_FIX}")
    if inference_dtype is not None and inference_dtype not in INFERENCE_DTYPES:
        raise ValueError(
            f"inference_dtype={inference_dtype!r} must be None or one of {tuple(INFERENCE_DTYPES)}"
        )
    if path.is_dir():
        model, tensors = _from_directory(path)
    else:
        model, tensors = _from_checkpoint(path)
    wanted = None if inference_dtype is None else INFERENCE_DTYPES[inference_dtype]
    layers, dense = _install(model, tensors, wanted)
    if not layers:
        raise ValueError(
            f"{str(path)!r} has no weight sparse enough to run in CSR (a layer runs in CSR from "
            "about 67% zeros in fp32): serve a model trained with sparsity, or load this one "
            "with transformers' from_pretrained"
        )
    model.eval().requires_grad_(False)
    _trim_heap()
    return ServedModel(model, path, layers, dense)


def _trim_heap() -> None:
    """Give the heap pages the load's transients freed back to the system (glibc's
    ``malloc_trim``; elsewhere nothing): freed blocks between the layers' held arrays otherwise
    stay resident, about a third of the held bytes on one thread."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return


# ------------------------------------------------------------------------------------ sources
def _from_directory(path: Path) -> tuple[nn.Module, TensorFile]:
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json: it is not an export directory; {_FIX}")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(path / 'config.json')!r} is not a model config: {err}") from err
    sparsity = (getattr(config, "quantization_config", None) or {}).get("sparsity_config") or {}
    if sparsity and sparsity.get("format") != "sparse-bitmask":
        raise ValueError(
            f"{str(path)!r} is compressed as {sparsity.get('format')!r}; only 'sparse-bitmask' "
            "(lightning_sparse.export(..., format='compressed')) is read"
        )
    if hasattr(config, "quantization_config"):
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
            f"{first}; {_FIX}"
        ) from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{str(path)!r} has no 'state_dict': not a Lightning checkpoint; {_FIX}")
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    class_path = hparams.get("_class_path", _LIT_CLASSES[0])
    if class_path not in _LIT_CLASSES:
        raise ValueError(
            f"{str(path)!r} holds a {class_path!r}; generate serves checkpoints of "
            "lightning_sparse.models.LitCausalLM (export other models first)"
        )
    recipe_model = _recipe_model(path)
    if recipe_model is None:
        model = _llama_skeleton(hparams, str(path))
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
def _hf_skeleton(config: Any, where: str) -> nn.Module:
    """The ``transformers`` causal LM of ``config`` on the meta device, non-persistent buffers
    computed on the CPU."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    allowed = set()
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


# ------------------------------------------------------------------------------------ install
def _install(
    model: nn.Module, tensors: TensorFile, value_dtype: torch.dtype | None
) -> tuple[dict[str, CompactLinear], list[str]]:
    """Fills the meta ``model`` from ``tensors``, one tensor at a time, in ``state_dict`` order:
    CSR layers where they pay (`_compact`), dense parameters and buffers elsewhere.

    Returns:
        ({module name: CompactLinear}, keys of the Linear/Conv1D weights left dense).
    """
    shapes = tensors.shapes
    groups = compressed_groups(shapes)
    float64 = any(dtype == torch.float64 for _, dtype in shapes.values())
    dtype = torch.float64 if float64 else torch.float32
    if float64 and value_dtype is not None:
        raise ValueError(
            f"{tensors.name}: a float64 model keeps float64 values; no inference_dtype"
        )
    names: dict[int, list[str]] = {}  # a tied parameter has several names
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        names.setdefault(id(t), []).append(name)
    linear = dict(_linear_modules(model))
    used: set[str] = set()
    done: set[int] = set()
    missing: list[str] = []
    layers: dict[str, CompactLinear] = {}
    dense: list[str] = []
    for key, meta in model.state_dict(keep_vars=True).items():
        if id(meta) in done:
            continue
        done.add(id(meta))
        read = None
        owners = names[id(meta)]
        module_name = key.rpartition(".")[0]
        if key.endswith(".weight") and module_name in linear and len(owners) == 1:
            module = linear[module_name]
            layer, read = _compact(module, key, groups.get(key), tensors, value_dtype, used)
            if isinstance(layer, CompactLinear):
                parent, _, child = module_name.rpartition(".")
                setattr(model.get_submodule(parent), child, layer)
                layers[module_name] = layer
                if module.bias is not None:
                    done.add(id(module.bias))
                continue
            dense.append(key)
        source = next((n for n in owners if n in shapes or n in groups), None)
        if source is None:
            missing.append(key)
            continue
        stored = read if read is not None and source == key else None
        if stored is None:
            stored = _read_dense(source, groups, tensors, tuple(meta.shape), used)
        value = stored.to(dtype if stored.is_floating_point() else stored.dtype, copy=True)
        tensors.release(stored)
        if isinstance(meta, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        for owner in owners:  # a tied parameter: one object under every name
            module_name, _, attr = owner.rpartition(".")
            slots = model.get_submodule(module_name)._parameters
            if not isinstance(meta, nn.Parameter):
                slots = model.get_submodule(module_name)._buffers
            slots[attr] = value
    if missing:
        raise ValueError(
            f"{tensors.name} has no tensor for {missing[:5]} ({len(missing)} missing): the "
            f"weights do not match the {type(model).__name__} its config describes"
        )
    unused = sorted(k for k in shapes if k not in used)
    if unused:
        raise ValueError(
            f"{tensors.name} holds {unused[:5]} ({len(unused)} tensors) that "
            f"{type(model).__name__} has no place for: the weights do not match the config"
        )
    return layers, dense


def _linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if name and (type(module) is nn.Linear or is_hf_conv1d(module)):
            yield name, module


def _compact(
    module: nn.Module,
    key: str,
    group: str | None,
    tensors: TensorFile,
    value_dtype: torch.dtype | None,
    used: set[str],
) -> tuple[CompactLinear | None, Tensor | None]:
    """``module``'s `CompactLinear` read from the file, or (None, the weight if read) where the
    weight stays dense (too dense for CSR to pay; not in the file: the caller reports it)."""
    transposed = is_hf_conv1d(module)  # stored [in, out]
    expected = tuple(module.weight.shape)
    bias_key = key[: -len("weight")] + "bias"
    if group is not None:
        shape_key, values_key = f"{group}.shape", f"{group}.compressed"
        shape = tuple(int(n) for n in tensors.read(shape_key).tolist())
        _check_shape(tensors.name, shape_key, shape, expected)
        (nnz,), values_dtype = tensors.shapes[values_key]
        if not runs_in_csr(shape[::-1] if transposed else shape, nnz, values_dtype.itemsize):
            return None, None
        used.add(shape_key)
        bias = _read_bias(module, bias_key, tensors, used)
        parts = [tensors.read(f"{group}.{p}") for p in ("bitmask", "compressed", "row_offsets")]
        layer = CompactLinear.from_bitmask(
            shape, parts[0], parts[1], bias, transposed=transposed, value_dtype=value_dtype,
            row_offsets=parts[2],
        )  # fmt: skip
        used.update(f"{group}.{p}" for p in ("bitmask", "compressed", "row_offsets"))
    elif key in tensors.shapes:
        _check_shape(tensors.name, key, tensors.shapes[key][0], expected)
        weight = tensors.read(key)
        nnz = int(torch.count_nonzero(weight))
        used.add(key)
        if not runs_in_csr(expected[::-1] if transposed else expected, nnz, weight.element_size()):
            return None, weight
        bias = _read_bias(module, bias_key, tensors, used)
        layer = CompactLinear.from_dense(
            weight, bias, transposed=transposed, value_dtype=value_dtype, release=tensors.release
        )
        parts = [weight]
    else:
        return None, None
    for t in parts if bias is None else [*parts, bias]:
        tensors.release(t)
    return layer, None


def _read_bias(module: nn.Module, key: str, tensors: TensorFile, used: set[str]) -> Tensor | None:
    if module.bias is None:
        return None
    if key not in tensors.shapes:
        raise ValueError(f"{tensors.name} has no tensor for {key!r}")
    _check_shape(tensors.name, key, tensors.shapes[key][0], tuple(module.bias.shape))
    used.add(key)
    return tensors.read(key)


def _read_dense(
    key: str, groups: dict[str, str], tensors: TensorFile, expected: tuple[int, ...], used: set[str]
) -> Tensor:
    """The tensor ``key`` as stored, or decompressed from its bitmask group (a weight held dense:
    not in an `nn.Linear`/``Conv1D``, shared, or too dense for CSR)."""
    group = groups.get(key)
    if group is None:
        _check_shape(tensors.name, key, tensors.shapes[key][0], expected)
        used.add(key)
        return tensors.read(key)
    shape = tuple(int(n) for n in tensors.read(f"{group}.shape").tolist())
    _check_shape(tensors.name, f"{group}.shape", shape, expected)
    bitmask, values = tensors.read(f"{group}.bitmask"), tensors.read(f"{group}.compressed")
    kept = unpack_bitmask(bitmask, shape)
    if int(kept.sum()) != values.numel():
        raise ValueError(
            f"{tensors.name}: {group}.bitmask has {int(kept.sum())} set bits but "
            f"{group}.compressed holds {values.numel()} values"
        )
    weight = torch.zeros(shape, dtype=values.dtype)
    weight[kept] = values
    used.update(f"{group}.{p}" for p in ("shape", "compressed", "bitmask", "row_offsets"))
    return weight


def _check_shape(where: str, key: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(
            f"{where}: {key!r} has shape {list(got)} but the model its config describes needs "
            f"{list(expected)}; the weights and config.json / hyper_parameters disagree"
        )
