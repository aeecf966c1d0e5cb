"""The compressed-tensors ``sparse-bitmask`` format: a sparse weight as its kept values + bitmask.

A weight ``<module>.weight`` of shape ``[rows, cols]`` is stored as four tensors (the layout of
compressed-tensors' ``BitmaskCompressor``, the names without ``.weight``):

- ``<module>.shape``: int64 ``[2]``, the dense shape;
- ``<module>.compressed``: ``[nnz]``, the nonzero values in row-major order, the weight's dtype;
- ``<module>.bitmask``: uint8 ``[rows, ceil(cols / 8)]``, one bit per weight (little bit order);
- ``<module>.row_offsets``: int64 ``[rows]``, where each row starts in ``compressed``.

Which weights: every 2-D ``*.weight`` whose bitmask layout is smaller than its dense one (a
weight with at least ~1 / (8 x bytes per value) exact zeros), found from the weights themselves:
pruned weights are exactly zero, so the bitmask of the nonzeros is the mask (a kept weight that
happens to be exactly 0 is stored as pruned, which gives the same tensor). Masks are not needed,
so checkpoints with and without ``*_mask`` entries give the same files.

``config.json`` gets ``quantization_config = {"quant_method": "compressed-tensors",
"sparsity_config": {"format": "sparse-bitmask", "targets": [...], ...}}``, the keys
compressed-tensors' own ``ModelCompressor`` writes for a sparse-only model (a top-level
``"format"`` would make compressed-tensors <= 0.14 parse a quantization config and fail). At 80%
sparsity in fp32 a weight takes 0.2 * 4 + 1 / 8 = 0.925 bytes per entry instead of 4 (0.23x).

Readers: compressed-tensors 0.14.0.1 with transformers 4.55-4.57 decompresses it in
``AutoModelForCausalLM.from_pretrained`` (checked by ``.ci/reader_check``). compressed-tensors
>= 0.15 dropped its sparse compressors and transformers 5 no longer loads the directory (the
four tensors are reported unexpected, the weight missing), so `load_compressed` decompresses the
files and hands the dense state dict to ``from_pretrained``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "compress_directory",
    "compress_state_dict",
    "record_sparsity",
    "decompress_state_dict",
    "load_compressed",
    "worth_compressing",
]

FORMAT = "sparse-bitmask"
_PARTS = ("shape", "compressed", "bitmask", "row_offsets")
_INSTALL = "pip install compressed-tensors (or: pip install lightning_sparse[hf])"


def _helpers() -> Any:
    try:
        from compressed_tensors.utils import helpers
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "the compressed format needs the optional package 'compressed-tensors'; run "
            f"`{_INSTALL}`, or export with format='hf' (dense safetensors)"
        ) from err
    return helpers


def worth_compressing(key: str, value: torch.Tensor) -> bool:
    """Whether ``value`` (``key`` ending in ``.weight``, 2-D, floating) takes fewer bytes as
    bitmask tensors than dense: ``nnz * e + rows * (ceil(cols / 8) + 8) + 16 < rows * cols * e``
    for ``e`` bytes per value (the kept values, the bits, the row offsets and the shape)."""
    if not key.endswith(".weight") or value.ndim != 2 or not value.is_floating_point():
        return False
    rows, cols = value.shape
    size = value.element_size()
    packed = int(torch.count_nonzero(value)) * size + rows * (math.ceil(cols / 8) + 8) + 16
    return packed < rows * cols * size


def compress_state_dict(
    state_dict: Mapping[str, torch.Tensor], names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """``state_dict`` with each chosen 2-D weight replaced by its four bitmask tensors.

    Args:
        state_dict: ``{name: tensor}``; not modified.
        names: the keys to compress (2-D, ending in ``.weight``); ``None``: every weight the
            layout stores in fewer bytes (`worth_compressing`). Others are kept as they are.

    Returns:
        A new dict; compressed keys are replaced in place (the source order is kept).
    """
    pack = _helpers().pack_bitmasks
    chosen = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        wanted = worth_compressing(key, value) if chosen is None else key in chosen
        if not wanted or value.ndim != 2 or not key.endswith(".weight"):
            out[key] = value
            continue
        value = value.detach().cpu()
        kept = value != 0  # [rows, cols]
        counts = kept.sum(dim=1)
        prefix = key[: -len(".weight")]
        out[f"{prefix}.shape"] = torch.tensor(value.shape, dtype=torch.int64)
        out[f"{prefix}.compressed"] = value[kept].contiguous()
        out[f"{prefix}.bitmask"] = pack(kept)
        out[f"{prefix}.row_offsets"] = torch.cumsum(counts, 0) - counts
    return out


def decompress_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dense state dict: every ``<module>.{shape,compressed,bitmask}`` group becomes
    ``<module>.weight`` (zeros where the bitmask is 0); other entries are kept."""
    unpack = _helpers().unpack_bitmasks
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        prefix, _, part = key.rpartition(".")
        if part not in _PARTS or not all(f"{prefix}.{p}" in state_dict for p in _PARTS):
            out[key] = value
        elif part == "compressed":
            shape = [int(n) for n in state_dict[f"{prefix}.shape"]]
            kept = unpack(state_dict[f"{prefix}.bitmask"], shape)
            dense = torch.zeros(shape, dtype=value.dtype)
            dense[kept] = value
            out[f"{prefix}.weight"] = dense
    return out


def compress_directory(path: Path, names: Iterable[str] | None = None) -> None:
    """Rewrite a ``save_pretrained`` directory's safetensors in the sparse-bitmask format and
    record it in ``config.json`` (``names``: the weight keys to compress; ``None``: those
    `worth_compressing`)."""
    _helpers()
    from safetensors.torch import load_file, save_file

    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    total = zeros = 0
    targets: list[str] = []
    weight_map: dict[str, str] = {}
    for file in files:
        tensors = load_file(path / file)
        chosen = [
            key
            for key, value in tensors.items()
            if (worth_compressing(key, value) if names is None else key in names)
            and value.ndim == 2
            and key.endswith(".weight")
        ]
        for key in chosen:
            total += tensors[key].numel()
            zeros += int((tensors[key] == 0).sum())
        targets += [key[: -len(".weight")] for key in chosen]
        compressed = compress_state_dict(tensors, chosen)
        save_file(compressed, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(compressed, file))
    if index:
        index["weight_map"] = weight_map
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    record_sparsity(path, targets, zeros, total)


def record_sparsity(path: Path, targets: list[str], zeros: int, total: int) -> None:
    """Record the sparse-bitmask format in ``path``'s ``config.json``: the compressed modules
    ``targets`` and the share of zeros (``zeros`` of ``total`` weights) among them."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {  # no quantization: the values keep the weights' dtype
        "quant_method": "compressed-tensors",
        "sparsity_config": {
            "format": FORMAT,
            "global_sparsity": zeros / total if total else 0.0,
            "sparsity_structure": "unstructured",
            "targets": sorted(targets),
            "ignore": [],
        },
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_compressed(path: str | Path, **kwargs: Any) -> Any:
    """Load a directory written by ``export(..., format="compressed")`` as a dense model.

    The safetensors files are decompressed in memory and passed, with the config minus its
    ``quantization_config``, to the architecture's ``from_pretrained``; ``kwargs`` go there too
    (``output_loading_info=True``, ``dtype`` ...). The generation config is read if present.
    """
    _helpers()
    import transformers
    from safetensors.torch import load_file

    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "quantization_config", None) is None:
        raise ValueError(
            f"{str(path)!r} has no quantization_config in config.json: it is not a compressed "
            "export; load it with AutoModelForCausalLM.from_pretrained"
        )
    del config.quantization_config
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    cls = getattr(transformers, config.architectures[0])
    loaded = cls.from_pretrained(
        None, config=config, state_dict=decompress_state_dict(state), **kwargs
    )
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    if (path / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return loaded
