"""`load_on_wse`: a sparse causal LM loaded straight onto the device in CSR, without ever building
its dense model, and `ServedModel.generate`.

Sources (`load_on_wse(path)`):

- a compressed export (``export(..., format="compressed")``, compressed-tensors
  ``sparse-bitmask``): each compressed weight of an `nn.Linear` or HF ``Conv1D`` becomes a
  `CSRLinear` built from its bitmask and kept values: no dense float copy of it exists at any
  time;
- an ``hf`` export (dense safetensors, pruned weights exactly zero) or a Lightning checkpoint of
  `LitCausalLM` (this package's `Llama`, or `HFCausalLM` as recorded in the run's
  ``config.yaml``): each weight is read alone (a transient dense tensor of one layer) and its
  nonzeros become a `CSRLinear`.

A weight runs in CSR where `compact.runs_in_csr` holds (sparse enough that its values and 16-bit
columns are at most half its dense bytes, the rule the executor applies to decode, about 67%
sparsity in fp32); denser weights, shared (tied) ones and those of other modules are loaded as
ordinary dense parameters.

The model is built on the ``meta`` device (`serve_model.describe`: no parameter allocated;
files are untrusted, see there), then each tensor is read (`serve_files`), converted and installed
in turn (`_install`), so peak memory stays about one layer's transient above what the served
model holds.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sparse.core.layouts import is_hf_conv1d
from lightning_sparse.integrations.choices import INFERENCE_DTYPE_NAMES
from lightning_sparse.integrations.serve_files import TensorFile, compressed_groups
from lightning_sparse.integrations.serve_model import FIX, describe
from lightning_sparse.models.llama import Llama, generate
from lightning_sparse.wse.csr_linear import CSRLinear, runs_in_csr, unpack_bitmask

__all__ = ["INFERENCE_DTYPES", "ServedModel", "load_on_wse"]

INFERENCE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in INFERENCE_DTYPE_NAMES
}


@dataclass
class ServedModel:
    """A model loaded by `load_on_wse`.

    Attributes:
        model: the `Llama` or ``transformers`` causal LM, eval mode, no gradients, its sparse
            layers `CSRLinear`.
        source: the directory or checkpoint it came from.
        layers: ``{module name: CSRLinear}`` of the layers in CSR.
        dense_layers: names of the `nn.Linear`/``Conv1D`` weights left dense (too dense for CSR
            to pay, or shared).
    """

    model: nn.Module
    source: Path
    layers: dict[str, CSRLinear]
    dense_layers: list[str]

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes."""
        if isinstance(self.model, Llama):
            return self.model.config.max_seq_len
        config = getattr(self.model, "config", None)
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

        Args:
            ids, max_new_tokens, temperature, top_k: as in `Llama.generate`.
            generator: the sampling generator of a `Llama`; ``transformers`` samples from the
                global generator (``torch.manual_seed``).

        Raises:
            ValueError: the result would exceed a ``transformers`` model's positions.
        """
        if isinstance(self.model, Llama):
            return generate(
                self.model, ids, max_new_tokens, self.max_positions, temperature, top_k, generator
            )
        from transformers import GenerationMixin

        model = self.model
        if not isinstance(model, GenerationMixin):
            raise TypeError(
                f"ServedModel.model is a {type(model).__name__}, neither this package's Llama nor "
                "a transformers causal LM (GenerationMixin); load it with load_on_wse"
            )
        if ids.shape[1] + max_new_tokens > self.max_positions:
            raise ValueError(
                f"{ids.shape[1]} prompt tokens + max_new_tokens={max_new_tokens} exceed the "
                f"model's {self.max_positions} positions; shorten the prompt or generate fewer"
            )
        config = model.generation_config
        options: dict[str, Any] = {"do_sample": temperature > 0, "max_new_tokens": max_new_tokens}
        if temperature > 0:
            options.update(temperature=temperature, top_k=top_k or 0, top_p=1.0)
        else:  # a sampling-only setting left in generation_config.json would warn
            options.update(temperature=None, top_k=None, top_p=None)
        if config.pad_token_id is None:
            eos = config.eos_token_id
            options["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) or 0
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)

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
        raise FileNotFoundError(f"{str(path)!r} does not exist; {FIX}")
    if inference_dtype is not None and inference_dtype not in INFERENCE_DTYPES:
        raise ValueError(
            f"inference_dtype={inference_dtype!r} must be None or one of {tuple(INFERENCE_DTYPES)}"
        )
    model, tensors = describe(path)
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


# ------------------------------------------------------------------------------------ install
def _install(
    model: nn.Module, tensors: TensorFile, value_dtype: torch.dtype | None
) -> tuple[dict[str, CSRLinear], list[str]]:
    """Fills the meta ``model`` from ``tensors``, one tensor at a time, in ``state_dict`` order:
    CSR layers where they pay (`_compact`), dense parameters and buffers elsewhere.

    Returns:
        ({module name: CSRLinear}, keys of the Linear/Conv1D weights left dense).
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
    layers: dict[str, CSRLinear] = {}
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
            if isinstance(layer, CSRLinear):
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
        # A tied parameter saved under each of its names (a Lightning checkpoint): one read.
        used.update(n for n in owners if n in shapes)
        if isinstance(meta, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        for owner in owners:  # a tied parameter: one object under every name
            module_name, _, attr = owner.rpartition(".")
            if isinstance(value, nn.Parameter):
                model.get_submodule(module_name)._parameters[attr] = value
            else:
                model.get_submodule(module_name)._buffers[attr] = value
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
) -> tuple[CSRLinear | None, Tensor | None]:
    """``module``'s `CSRLinear` read from the file, or (None, the weight if read) where the
    weight stays dense (too dense for CSR to pay; not in the file: the caller reports it)."""
    transposed = is_hf_conv1d(module)  # stored [in, out]
    weight = module.weight
    if not isinstance(weight, Tensor) or weight.ndim != 2:
        raise TypeError(f"{key!r}: {type(module).__name__}.weight is not a matrix")
    expected: tuple[int, int] = (weight.shape[0], weight.shape[1])
    bias_key = key[: -len("weight")] + "bias"
    if group is not None:
        shape_key, values_key = f"{group}.shape", f"{group}.compressed"
        shape = _matrix_shape(tensors, shape_key)
        _check_shape(tensors.name, shape_key, shape, expected)
        (nnz,), values_dtype = tensors.shapes[values_key]
        if not runs_in_csr(shape[::-1] if transposed else shape, nnz, values_dtype.itemsize):
            return None, None
        used.add(shape_key)
        bias = _read_bias(module, bias_key, tensors, used)
        parts = [tensors.read(f"{group}.{p}") for p in ("bitmask", "compressed", "row_offsets")]
        layer = CSRLinear.from_bitmask(
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
        layer = CSRLinear.from_dense(
            weight, bias, transposed=transposed, value_dtype=value_dtype, release=tensors.release
        )
        parts = [weight]
    else:
        return None, None
    for t in parts if bias is None else [*parts, bias]:
        tensors.release(t)
    return layer, None


def _read_bias(module: nn.Module, key: str, tensors: TensorFile, used: set[str]) -> Tensor | None:
    bias = module.bias
    if not isinstance(bias, Tensor):  # None: the layer has no bias
        return None
    if key not in tensors.shapes:
        raise ValueError(f"{tensors.name} has no tensor for {key!r}")
    _check_shape(tensors.name, key, tensors.shapes[key][0], tuple(bias.shape))
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
    shape = _matrix_shape(tensors, f"{group}.shape")
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


def _matrix_shape(tensors: TensorFile, key: str) -> tuple[int, int]:
    """The ``[rows, cols]`` a compressed group's ``.shape`` tensor records (only matrices are
    compressed)."""
    shape = [int(n) for n in tensors.read(key).flatten().tolist()]
    if len(shape) != 2:
        raise ValueError(
            f"{tensors.name}: {key!r} is {shape}, not the [rows, cols] of a compressed matrix; "
            "the file is damaged: export the model again"
        )
    return shape[0], shape[1]


def _check_shape(where: str, key: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(
            f"{where}: {key!r} has shape {list(got)} but the model its config describes needs "
            f"{list(expected)}; the weights and config.json / hyper_parameters disagree"
        )
