"""The tensors of a model file, read one at a time: what `serve.load_on_wse` loads from.

Two readers with one interface (`TensorFile`): ``shapes`` (every key's shape and dtype, from the
headers, nothing read), ``read(key)`` (one tensor) and ``release(tensor)`` (give back its pages
once used):

- `SafetensorsDir`: a ``save_pretrained`` directory (``model.safetensors`` or the shards of
  ``model.safetensors.index.json``). Each read opens its file alone, so the file's mapping goes
  with the tensor, where one ``safe_open`` held for the whole load would keep every page it
  touched resident; `release` drops a used tensor's (or block's) pages even sooner.
- `CheckpointFile`: a Lightning checkpoint, ``torch.load(mmap=True, weights_only=True)``, keys
  under a prefix (``model.``); ``*_mask`` entries are skipped (the weights are exactly zero at
  pruned positions in every format this package writes). The whole file stays mapped while the
  load runs, so `release` drops a used tensor's pages.

`release` is ``madvise(MADV_DONTNEED)`` on Linux, on pages inside this file's mappings only (a
private, never written mapping re-reads them from the file if touched again); elsewhere a no-op.

`compressed_groups` finds compressed-tensors ``sparse-bitmask`` weights among the keys.
Nothing here unpickles arbitrary objects: safetensors holds tensors only, checkpoints load with
``weights_only=True``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["BITMASK_PARTS", "CheckpointFile", "SafetensorsDir", "TensorFile", "compressed_groups"]

BITMASK_PARTS = ("shape", "compressed", "bitmask", "row_offsets")
"""The four tensors of a compressed weight ``<module>.weight``: ``<module>.<part>``."""
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_MADV_DONTNEED = 4


class TensorFile(Protocol):
    """One model file's tensors, readable one at a time."""

    name: str
    """The file or directory, for error messages."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """``{key: (shape, dtype)}`` of every tensor, read from the headers."""

    def read(self, key: str) -> Tensor: ...

    def release(self, tensor: Tensor) -> None: ...


class SafetensorsDir:
    """The safetensors files of a ``save_pretrained`` directory.

    Raises:
        ValueError: no ``model.safetensors`` and no index, or an index naming a missing file.
    """

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.name = str(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            files = sorted({str(f) for f in weight_map.values()})
        else:
            files = ["model.safetensors"] if (path / "model.safetensors").is_file() else []
        if not files:
            raise ValueError(
                f"{self.name!r} has no model.safetensors (nor model.safetensors.index.json): it "
                "is not a save_pretrained directory; pass an export directory or a .ckpt file"
            )
        self._file_of: dict[str, Path] = {}
        self._mapped: list[tuple[int, int]] = []
        self.shapes = {}
        for file in files:
            full = path / file
            if Path(file).name != file or not full.is_file():
                raise ValueError(f"{str(index)!r} names {file!r}, which is not a file in {path}")
            with safe_open(str(full), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    view = f.get_slice(key)
                    dtype = _ST_DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{full}: {key!r} has dtype {view.get_dtype()}")
                    self.shapes[key] = (tuple(view.get_shape()), dtype)
                    self._file_of[key] = full

    def read(self, key: str) -> Tensor:
        from safetensors import safe_open

        file = self._file_of[key]
        with safe_open(str(file), framework="pt") as f:
            tensor = f.get_tensor(key)  # its pages stay mapped from the file while it lives
        self._mapped = _mappings_of(file)
        return tensor

    def release(self, tensor: Tensor) -> None:
        """Drop the resident pages of a used tensor (or a block of one) mapped from the file
        (the mapping itself closes with the tensor)."""
        _drop_pages(tensor, self._mapped)


class CheckpointFile:
    """The tensors of a Lightning checkpoint's ``state_dict`` under ``prefix``.

    Args:
        path: the file (loaded with ``mmap=True``; `release` acts only on pages mapped from it).
        state_dict: the checkpoint's ``state_dict``.
        prefix: the model's prefix (``"model."``), stripped from the keys.

    Raises:
        ValueError: a value under ``prefix`` is not a tensor.
    """

    def __init__(self, path: Path, state_dict: Mapping[str, Any], prefix: str) -> None:
        self.name = str(path)
        self._mapped = _mappings_of(path)
        self._tensors: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            if not key.startswith(prefix) or key.endswith("_mask"):
                continue
            if not torch.is_tensor(value):
                raise ValueError(f"{path}: state_dict[{key!r}] is a {type(value).__name__}")
            self._tensors[key[len(prefix) :]] = value
        self.shapes = {k: (tuple(v.shape), v.dtype) for k, v in self._tensors.items()}

    def read(self, key: str) -> Tensor:
        """The tensor at ``key``, once; a sparse CSR weight (a model built sparse wrote it)
        dense, that one weight only."""
        tensor = self._tensors.pop(key)
        return tensor.to_dense() if tensor.layout == torch.sparse_csr else tensor

    def release(self, tensor: Tensor) -> None:
        """Drop the resident pages of a used tensor (or a block of one) mapped from the file."""
        _drop_pages(tensor, self._mapped)


def compressed_groups(shapes: Mapping[str, Any]) -> dict[str, str]:
    """``{"<module>.weight": "<module>"}`` for every module with all four `BITMASK_PARTS`."""
    prefixes = {k.rpartition(".")[0] for k in shapes if k.rpartition(".")[2] == "compressed"}
    whole = [p for p in sorted(prefixes) if all(f"{p}.{part}" in shapes for part in BITMASK_PARTS)]
    return {f"{p}.weight": p for p in whole}


def _drop_pages(tensor: Tensor, mapped: list[tuple[int, int]]) -> None:
    """``madvise(MADV_DONTNEED)`` on the whole pages of a contiguous tensor that lie in one of
    the ``mapped`` file ranges (private, never written: the kernel re-reads them from the file
    if they are touched again); anything else is left alone."""
    if tensor.numel() == 0 or not tensor.is_contiguous():
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # whole pages inside it
    if last > first and any(lo <= first and last <= hi for lo, hi in mapped):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _mappings_of(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from ``path`` (Linux ``/proc/self/maps``; none
    elsewhere, so nothing is released there)."""
    maps = Path("/proc/self/maps")
    if not sys.platform.startswith("linux") or not maps.is_file():
        return []
    target = str(path.resolve())
    ranges = []
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges
