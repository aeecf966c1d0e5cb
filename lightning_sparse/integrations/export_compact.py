"""The compressed export of a checkpoint written by a model built sparse, without the model.

A `LitCausalLM(build_sparse=True)` run's checkpoint holds each masked weight as a PyTorch
sparse CSR tensor (`lightning_sparse.wse.executor.WSELinear`): the model it describes may not
fit in memory dense (`recipes/rigl_llama_3b_wse.yaml`: 3.2B parameters, 12.9 GB dense). Its
compressed-tensors export (sparse-bitmask) is written straight from the checkpoint: the
transformers config from the module's hyper-parameters, then each weight renamed as
`llama_to_hf` names it and each masked one compressed on its own (`compress_state_dict` of that
one weight, dense for that moment only), so at most one layer is ever dense. The files are the
ones `export(..., format="compressed")` writes for the same weights through the dense model
(`tests/integrations/test_export_compact.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_sparse.core.state_dict import strip_masks
from lightning_sparse.integrations.compressed import compress_state_dict, record_sparsity
from lightning_sparse.integrations.llama_to_hf import hf_llama_config, hf_llama_name
from lightning_sparse.models.lit_lm import llama_config
from lightning_sparse.models.llama import LlamaConfig

__all__ = ["compact_llama", "write_compressed"]

_CLASS = "lightning_sparse.models.LitCausalLM"


def compact_llama(checkpoint: dict[str, Any]) -> tuple[LlamaConfig, dict[str, Any]] | None:
    """``(config, weights)`` of a checkpoint of this package's `LitCausalLM` built sparse (its
    `Llama`'s config from the hyper-parameters, its mask-free state dict without the
    ``model.`` prefix); None for any other checkpoint (it is exported through its model)."""
    hparams = checkpoint.get("hyper_parameters") or {}
    state = checkpoint.get("state_dict") or {}
    if not hparams.get("build_sparse") or hparams.get("_class_path", _CLASS) != _CLASS:
        return None
    if not any(torch.is_tensor(v) and v.layout == torch.sparse_csr for v in state.values()):
        return None
    cfg = llama_config(hparams)
    weights = {k.removeprefix("model."): v for k, v in strip_masks(state).items()}
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)  # transformers ties it to the embedding
    return cfg, weights


def write_compressed(path: Path, cfg: LlamaConfig, weights: dict[str, Any]) -> None:
    """Write ``config.json`` and ``model.safetensors`` (sparse-bitmask) into ``path``, one
    masked weight dense at a time."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    dtype = next(v.dtype for v in weights.values() if torch.is_tensor(v))
    config = hf_llama_config(cfg, dtype)
    config.save_pretrained(path)
    GenerationConfig.from_model_config(config).save_pretrained(path)
    tensors: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    zeros = total = 0
    for name, value in weights.items():
        key = hf_llama_name(name)
        if value.layout != torch.sparse_csr:
            tensors[key] = value.contiguous()
            continue
        dense = value.to_dense()
        total += dense.numel()
        zeros += dense.numel() - int(torch.count_nonzero(dense))
        tensors.update(compress_state_dict({key: dense}, [key]))
        targets.append(key.removesuffix(".weight"))
        del dense
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    record_sparsity(path, targets, zeros, total)
