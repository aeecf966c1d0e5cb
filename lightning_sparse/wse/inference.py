"""Inference on the device: a layer's forward without autograd, and the decode fast path.

`infer` runs a masked layer's forward under ``torch.no_grad`` / ``inference_mode`` (or with
nothing requiring a gradient): the kept values are gathered once and reused until the weight is
written (its version counter moves) or the structure or bias changes, and per token count the
path "auto" picks is resolved once into a runner (`ops.inference_runner`). `infer_compact` does
the same from a compact layer's values (validation during a fit). `FastInference` is the call
when nothing changed since the last one, read from the layer's instance dict by its ``forward``
(a one-token call of a small layer costs microseconds): identity and version checks, the runner,
the FLOP counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from lightning_sparse.core.sparse_parameter import mask_buffer_name
from lightning_sparse.wse.autotune import resolve_path
from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.layer_tensors import bias_of, weight_of
from lightning_sparse.wse.ops import inference_runner
from lightning_sparse.wse.stats import WSEStats

if TYPE_CHECKING:
    from lightning_sparse.wse.compact import CompactState

__all__ = [
    "FAST",
    "FastInference",
    "InferenceLayer",
    "infer",
    "infer_compact",
    "runner_entry",
    "without_fast",
]

Runner = Callable[[Tensor], Tensor]
RunnerEntry = tuple[Runner, int, bool]  # runner, forward FLOPs per token, plain F.linear


class InferenceExecutor(Protocol):
    """What inference reads from the `WSEExecutor` (a protocol: `wse/layer.py` imports this
    module, so this one names the executor's and the layer's attributes instead of importing
    them)."""

    path: str | None
    stats: WSEStats

    @property
    def inference_dtype(self) -> torch.dtype | None: ...  # read-only: the executor's is set


class InferenceLayer(Protocol):
    """The inference cache of one layer (`wse.layer.LayerState` is the one implementation):
    the kept values as inference holds them, the key they were gathered under (structure,
    weight or values version, bias), the runner per token count and the fast path."""

    @property
    def executor(self) -> InferenceExecutor: ...  # read-only: a LayerState's is a wider type

    values: Tensor | None
    values_key: tuple[CSRWeight, int, Tensor | None] | None
    runners: dict[int, RunnerEntry]
    fast: FastInference | None

    def out_in(self, tensor: Tensor) -> Tensor: ...


MASK = mask_buffer_name("weight")
FAST = "_wse_fast"
"""The instance attribute holding a layer's `FastInference` while it is valid: read straight
from the instance dict by ``forward`` (a decode call of a small layer costs microseconds, so a
registry lookup matters), dropped from pickles and copies (`without_fast`)."""


def without_fast(state: dict[str, Any]) -> dict[str, Any]:
    """A module's ``__dict__`` without its fast path (for pickles and copies)."""
    return {k: v for k, v in state.items() if k != FAST}


def infer(
    state: InferenceLayer, x: Tensor, module: nn.Module, csr: CSRWeight
) -> tuple[Tensor, int]:
    """Forward without autograd (``torch.no_grad``, ``inference_mode``, frozen weights):
    ``x [..., in] -> [..., out]``, and the weights the chosen path executed (the kept count,
    or every weight where it runs dense).

    The kept values are gathered once and reused until the weight is written (its version
    counter moves: an optimizer step between validation runs, ``load_state_dict``) or the
    structure or bias changes; per token count, the path "auto" picks is resolved once.
    """
    in_features = csr.shape[1]
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., {in_features}], got shape {tuple(x.shape)}")
    param, buffer, bias = weight_of(module), module._buffers[MASK], bias_of(module)
    if buffer is None:  # the layer runs in CSR only while it has a mask
        raise RuntimeError(f"infer: {type(module).__name__} has no {MASK} buffer")
    weight, mask = state.out_in(param), state.out_in(buffer)  # [out, in] views
    if weight.is_inference():  # no version counter to key a cache on
        path = resolve_path(x, weight, csr, state.executor.path, requires_grad=False)
        values = stored(state, csr.gather_values(weight.detach()))
        kept = weight.numel() if path == "dense" else csr.nnz
        return inference_runner(path, values, csr, weight, mask, bias)(x), kept
    key = state.values_key
    if key is None or key[0] is not csr or key[1] != weight._version or key[2] is not bias:
        state.values = stored(state, csr.gather_values(weight.detach()))
        state.values_key = (csr, weight._version, bias)
        state.runners = {}
        state.fast = None
        if not mask.is_inference() and weight.is_cpu:
            state.fast = FastInference(state, param, buffer, bias, x.dtype, csr)
    tokens = x.numel() // in_features if in_features else 0
    return _run_cached(state, x, tokens, csr, weight, weight, mask, bias)


def infer_compact(
    state: InferenceLayer, x: Tensor, compact: CompactState, bias: Tensor | None, tokens: int
) -> tuple[Tensor, int]:
    """Inference from the compact values (validation during a fit), cached per values
    version as `infer` caches per weight version; returns (output, weights executed)."""
    csr, values = compact.csr, compact.values
    if x.dim() == 0 or x.shape[-1] != csr.shape[1]:
        raise ValueError(f"x must be [..., {csr.shape[1]}], got shape {tuple(x.shape)}")
    key = state.values_key
    if (
        key is None
        or key[0] is not csr
        or key[1] != values._version
        or key[2] is not bias
        or state.fast is not None
    ):
        state.values = stored(state, values.detach())
        state.values_key = (csr, values._version, bias)
        state.runners, state.fast = {}, None
    return _run_cached(state, x, tokens, csr, values, None, None, bias)


def _run_cached(
    state: InferenceLayer, x: Tensor, tokens: int, csr: CSRWeight, like: Tensor,
    weight: Tensor | None, mask: Tensor | None, bias: Tensor | None,
) -> tuple[Tensor, int]:  # fmt: skip
    """Run ``x`` through the runner cached for ``tokens`` (resolved once per token count from
    the cached values; ``like``: the tensor whose device and dtype the path choice reads);
    returns (output, weights executed)."""
    entry = state.runners.get(tokens)
    if entry is None:
        path = resolve_path(x, like, csr, state.executor.path, requires_grad=False)
        assert state.values is not None
        runner = inference_runner(path, state.values, csr, weight, mask, bias)
        entry = state.runners[tokens] = runner_entry(runner, path, csr)
    return entry[0](x), entry[1] // 2


def stored(state: InferenceLayer, values: Tensor) -> Tensor:
    """The kept values as inference holds them (`WSEExecutor` ``inference_dtype``)."""
    wanted = state.executor.inference_dtype
    if wanted == torch.bfloat16 and values.dtype == torch.float32:
        return values.to(torch.bfloat16)
    return values


def runner_entry(
    runner: Callable[[Tensor], Tensor], path: str, csr: CSRWeight
) -> tuple[Callable[[Tensor], Tensor], int, bool]:
    """A runner, the forward FLOPs per token it executes (every weight where it runs dense) and
    whether it is plain ``F.linear`` (no dtype or autocast constraints)."""
    dense = path == "dense"
    return runner, 2 * (csr.shape[0] * csr.shape[1] if dense else csr.nnz), dense


class FastInference:
    """A layer's forward without autograd when nothing changed since the last call: the same
    mask buffer (object and version), weight parameter (object and version; ``[out, in]`` or a
    Conv1D's ``[in, out]``) and bias, a token count already seen, and for a sparse runner the
    same input dtype, a CPU input and no CPU autocast. Returns None otherwise, and
    `LayerState.run` takes over (and rebuilds what changed). Records forward FLOPs like
    `LayerState._record`. Made only for CPU weights; the checks read the module's dicts
    directly (cheaper than ``nn.Module.__getattr__``): a one-token call of a small layer costs a
    few microseconds.
    """

    __slots__ = ("runners", "stats", "total", "weight", "weight_version", "mask", "mask_version",
                 "bias", "dtype", "in_features", "numel")  # fmt: skip

    def __init__(
        self, state: InferenceLayer, weight: Tensor, mask: Tensor, bias: Tensor | None,
        dtype: torch.dtype, csr: CSRWeight,
    ) -> None:  # fmt: skip
        self.runners = state.runners  # token count -> (runner, executed FLOPs per token)
        self.stats = state.executor.stats
        self.total = self.stats.total_flops["forward"]  # never replaced (the window is)
        self.weight, self.mask, self.bias, self.dtype = weight, mask, bias, dtype
        self.weight_version, self.mask_version = weight._version, mask._version
        self.in_features = csr.shape[1]
        self.numel = weight.numel()

    def __call__(self, module: nn.Module, x: Tensor) -> Tensor | None:
        params = module._parameters
        weight = params["weight"]
        if (
            weight is not self.weight
            or weight._version != self.weight_version
            or module._buffers.get(MASK) is not self.mask
            or self.mask._version != self.mask_version
            or params.get("bias") is not self.bias
        ):
            return None
        shape = x.shape
        if not shape or shape[-1] != self.in_features:
            return None
        tokens = x.numel() // self.in_features
        entry = self.runners.get(tokens)
        # A dense runner is F.linear on the (masked) weight: what nn.Linear runs, for any dtype,
        # device or autocast state. The CSR kernels need their own dtype, a CPU input, no autocast.
        if (
            entry is None
            or not entry[2]
            and (x.dtype is not self.dtype or not x.is_cpu or torch.is_autocast_enabled("cpu"))
        ):
            return None
        y = entry[0](x)
        # The statistics' forward counts, without a method call (a decode call is microseconds).
        stats = self.stats
        window = (stats.eval_flops if stats.evaluating else stats.step_flops)["forward"]
        executed, dense = entry[1] * tokens, 2 * tokens * self.numel
        window[0] += executed
        window[1] += dense
        total = self.total
        total[0] += executed
        total[1] += dense
        return y
