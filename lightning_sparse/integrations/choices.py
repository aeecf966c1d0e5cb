"""The values the integrations' options accept, by name, importable without torch.

`lightning-sparse export` and `generate` list them in ``--help`` and check them while parsing,
before any integration module (torch, transformers) is loaded; `export.FORMATS` and
`serve.INFERENCE_DTYPES` are built from these names.
"""

from __future__ import annotations

__all__ = ["EXPORT_FORMATS", "INFERENCE_DTYPE_NAMES"]

EXPORT_FORMATS = ("hf", "compressed")  # dense safetensors; compressed-tensors sparse-bitmask
INFERENCE_DTYPE_NAMES = ("float32", "bfloat16")  # storage of a served model's kept values
