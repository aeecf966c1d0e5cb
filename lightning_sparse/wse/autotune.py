"""Path choice by measurement: "auto" times the candidate paths once per key and keeps the winner.

`resolve_path` is the entry point: a forced path (the ``path`` argument, else the
``LIGHTNING_SPARSE_WSE_PATH`` environment variable) is checked and returned; "auto" (default)
times every path that can run (`policy.unsupported_reason`) on synthetic data of the call's shape
and structure, interleaved, scoring each by its best round, once per `policy.autotune_key`, and
lets `policy.choose_path` decide. A few-token inference call (decode) is timed cycling through
copies of the layer that fill twice the last-level cache (`policy.decode_stream_copies`), so the
weights come from memory as in a model's decode, not from cache as when one layer is timed alone.
The rules (margins, how many copies, when a close call is measured longer) and their tuned
constants are `policy.py`'s; this module only measures and caches.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.wse import native, policy
from lightning_sparse.wse.caches import cache_sizes
from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.ops import inference_runner, run_compact_path, run_path
from lightning_sparse.wse.policy import PATHS, TUNED

__all__ = ["PATH_ENV", "autotune_choices", "clear_autotune_cache", "resolve_path"]

PATH_ENV = "LIGHTNING_SPARSE_WSE_PATH"
"""Environment variable forcing a path: "auto" (default), "compiled", "torch" or "dense"."""
_AUTOTUNE_CACHE: dict[tuple, str] = {}


def unsupported_reason(path: str, x: Tensor) -> str | None:
    """Why ``path`` cannot run on ``x`` on this machine (None when it can)."""
    native_reason = native.unavailable_reason() if path == "compiled" else None
    return policy.unsupported_reason(path, x.device.type, x.dtype, native_reason)


def requested_path(path: str | None) -> str:
    """``path``, else the environment's; "auto" or one of `PATHS` (else a ValueError)."""
    requested = path if path is not None else os.environ.get(PATH_ENV, "auto")
    if requested != "auto" and requested not in PATHS:
        source = "path argument" if path is not None else f"{PATH_ENV} environment variable"
        raise ValueError(f"{source} must be 'auto' or one of {PATHS}, got {requested!r}")
    return requested


def resolve_path(
    x: Tensor,
    weight: Tensor,
    csr: CSRWeight,
    path: str | None = None,
    requires_grad: bool = True,
    zeros_kept: bool = False,
    compact: bool = False,
) -> str:
    """The concrete path ("compiled", "torch" or "dense") a `sparse_linear` call would take.

    Args:
        x: input `[..., in]`.
        weight: dense weight `[out, in]` (its dtype and device; values are not read).
        csr: structure of the mask.
        path: forced path, or "auto"/None to follow `LIGHTNING_SPARSE_WSE_PATH` (default "auto").
        requires_grad: whether the call will be differentiated (auto-tuning times fwd+bwd then).
        zeros_kept: the caller runs "dense" as plain ``F.linear(x, weight, bias)``, because an
            algorithm already keeps the pruned weights and gradients at exactly 0 (the device's
            executor under a sparsity algorithm); "auto" then times that as dense's cost.
        compact: the caller holds the kept values, not a weight (`ops.run_compact_path`, the
            device's compact training); "auto" times the compact ops, dense as ``F.linear``
            on the weight built from the values per call.

    Returns:
        The path. "auto" measures the candidates on first use of a key and caches the winner.

    Raises:
        ValueError: if the path name is unknown or a forced path cannot run on these tensors.
    """
    requested = requested_path(path)
    if requested != "auto":
        reason = unsupported_reason(requested, x)
        if reason is not None:
            raise ValueError(f"path {requested!r} cannot run here: {reason}")
        return requested
    tokens = x.numel() // max(x.shape[-1], 1)
    mode = "compact" if compact else "kept" if zeros_kept else "masked"
    key = policy.autotune_key(
        x.device.type, x.dtype, csr.shape, csr.nnz, tokens, requires_grad, mode
    )
    if key not in _AUTOTUNE_CACHE:
        # "dense" has no unsupported reason: it is always a candidate, the fallback.
        candidates = [p for p in PATHS if unsupported_reason(p, x) is None]
        _AUTOTUNE_CACHE[key] = _autotune(
            candidates, x, csr, policy.token_bucket_of(key), requires_grad, mode
        )
    return _AUTOTUNE_CACHE[key]


def _autotune(
    candidates: list[str],
    x: Tensor,
    csr: CSRWeight,
    tokens: int,
    requires_grad: bool,
    mode: str = "masked",
) -> str:
    """Fastest candidate on synthetic data of the real shapes and structure (``mode``: what
    the caller runs in training, see `policy.autotune_key`).

    Candidates run interleaved; each is scored by its best repeat, the least disturbed by other
    processes, which estimates its intrinsic cost better than the median on a shared machine.
    """
    if len(candidates) == 1:
        return candidates[0]
    generator = torch.Generator(device=x.device).manual_seed(0)
    kwargs: dict[str, Any] = {"device": x.device, "dtype": x.dtype, "generator": generator}
    xs = torch.randn(tokens, csr.shape[1], **kwargs).requires_grad_(requires_grad)
    ws = torch.randn(csr.shape, **kwargs).requires_grad_(requires_grad)
    times: dict[str, list[float]] = {p: [] for p in candidates}
    if requires_grad:
        if mode == "compact":
            ws = csr.gather_values(ws.detach()).requires_grad_()
        runs = {p: functools.partial(_time_once, p, xs, ws, csr, True, mode) for p in candidates}
    else:  # what inference runs: runners on pre-gathered values (`inference_runner`)
        mask = csr.to_mask()
        ws = ws * mask  # masked, so the dense runner holds it (no copy of its own)
        layer_bytes = ws.numel() * ws.element_size()
        copies = policy.decode_stream_copies(layer_bytes, _cache_bytes(), tokens, requires_grad)
        if copies is None:  # too small to stream past the cache: the bytes rule, one copy
            if "dense" in candidates and policy.decode_forces_dense(
                csr.shape, csr.nnz, x.element_size(), tokens, requires_grad
            ):
                return "dense"
            copies = 1
        # Few-token calls cycle through copies larger than the cache: in a model's decode each
        # layer's weights come from memory, which timing one layer in cache misses.
        weights = [ws] + [ws.clone() for _ in range(copies - 1)]
        runners = {
            p: [inference_runner(p, csr.gather_values(w), csr, w, mask, None) for w in weights]
            for p in candidates
        }
        few = tokens <= TUNED["few_tokens"].value
        calls = max(int(TUNED["runner_calls"].value), copies) if few else 1
        runs = {p: functools.partial(_time_runner, runners[p], xs, calls) for p in candidates}
    for repeat in range(int(TUNED["repeats"].value) + 1):
        for p in candidates:
            elapsed = runs[p]()
            if repeat:  # the first round is warm-up (allocator, caches, thread pool)
                times[p].append(elapsed)
    if policy.close_call({p: min(ts) for p, ts in times.items()}):
        # A sparse path near dense's time: a noisy round could decide it, so measure longer.
        for _ in range(int(TUNED["close_repeats"].value)):
            for p in candidates:
                times[p].append(runs[p]())
    best = {p: min(ts) for p, ts in times.items()}
    return policy.choose_path(best, policy.margin(requires_grad))


def _time_runner(runners: list[Callable[[Tensor], Tensor]], x: Tensor, calls: int = 1) -> float:
    """Seconds of ``calls`` calls, cycling through ``runners`` (copies of one layer)."""
    _synchronize(x.device)
    start = time.perf_counter()
    with torch.no_grad():
        for call in range(calls):
            runners[call % len(runners)](x)
    _synchronize(x.device)
    return time.perf_counter() - start


def _time_once(
    path: str, x: Tensor, weight: Tensor, csr: CSRWeight, backward: bool, mode: str = "masked"
) -> float:
    """Seconds of one call (and its backward); ``weight`` is the kept values in "compact"
    mode."""
    x.grad = weight.grad = None
    _synchronize(x.device)
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if mode == "compact":
            y = run_compact_path(path, x, weight, csr, None)
        elif path == "dense" and mode == "kept":  # what the executor runs: no masking passes
            y = F.linear(x, weight)
        else:
            y = run_path(path, x, weight, csr, None)
        if backward:
            y.sum().backward()
    _synchronize(x.device)
    return time.perf_counter() - start


def _cache_bytes() -> int | None:
    """Bytes of this machine's last-level CPU cache (sysfs), None where unknown."""
    return cache_sizes().last_level


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clear_autotune_cache() -> None:
    """Forgets every "auto" choice, e.g. after changing `torch.set_num_threads`."""
    _AUTOTUNE_CACHE.clear()


def autotune_choices() -> dict[tuple, str]:
    """A copy of the "auto" choices made so far, keyed by (device, dtype, shape, density bucket,
    token bucket, grad, mode: "masked", "kept" or "compact" for training calls)."""
    return dict(_AUTOTUNE_CACHE)
