"""What the statistics see of a layer's backward and of masked modules that run dense.

`BackwardCounter` is a tensor hook on a layer's output that records the backward matmuls when
autograd computes them; `DenseCounter` is the forward hook of a masked ``Conv2d`` the device runs
dense, recording its matmuls with executed = dense equivalent.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sparse.wse.stats import WSEStats

__all__ = ["BackwardCounter", "DenseCounter"]


class BackwardCounter:
    """Tensor hook on a layer's output: counts the backward matmuls when its gradient arrives."""

    def __init__(
        self,
        stats: WSEStats,
        tokens: int,
        nnz: int,
        numel: int,
        input_grad: bool,
        weight_grad: bool,
        dense_grad: bool,
    ) -> None:
        self.args = (stats, tokens, nnz, numel, input_grad, weight_grad, dense_grad)

    def __call__(self, grad: Tensor) -> None:
        stats, tokens, nnz, numel, input_grad, weight_grad, dense_grad = self.args
        if input_grad:
            stats.add_flops("input_grad", 2 * tokens * nnz, 2 * tokens * numel)
        if weight_grad:
            if dense_grad:
                stats.add_flops("dense_weight_grad", 2 * tokens * numel, 2 * tokens * numel)
            else:
                stats.add_flops("weight_grad", 2 * tokens * nnz, 2 * tokens * numel)


class DenseCounter:
    """Forward hook of a masked ``Conv2d`` running dense: records its matmuls in the statistics
    with executed = dense equivalent (``2 * positions * weight numel`` each; a position is one
    output pixel of one example)."""

    def __init__(self, executor: Any) -> None:
        self.executor = weakref.ref(executor)

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], y: Any) -> None:
        executor = self.executor()
        if executor is None or not torch.is_tensor(y):
            return
        weight = module.weight
        if not isinstance(weight, Tensor):  # a Linear's: always a Tensor
            return
        positions = y.numel() // y.shape[-3] if y.ndim >= 3 else 0
        numel = weight.numel()
        x = inputs[0] if inputs and torch.is_tensor(inputs[0]) else None
        stats = executor.stats
        stats.add_flops("forward", 2 * positions * numel, 2 * positions * numel)
        if y.requires_grad:
            input_grad = x is not None and x.requires_grad
            y.register_hook(
                BackwardCounter(
                    stats, positions, numel, numel, input_grad, weight.requires_grad, False
                )
            )
