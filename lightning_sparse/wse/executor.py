"""The module that executes a sparse layer on the emulated wafer-scale device.

`install_executor(model)` turns every `nn.Linear` of ``model`` (exact type) into a `WSELinear` by
swapping its class in place (``module.__class__ = WSELinear``). `WSELinear` subclasses
`nn.Linear` and overrides only ``forward``, so parameters, buffers, ``state_dict`` keys, hooks,
the optimizer's references and the algorithms' `SparseParameter` references all stay the same
objects; `WSEExecutor.remove` swaps the class back. Nothing else is patched: no optimizer method,
no algorithm, no forward hook.

Hugging Face's GPT-2 ``Conv1D`` (weight ``[in, out]``, ``y = x @ W + b = F.linear(x, W.t(), b)``,
`core.layouts.is_hf_conv1d`) gets the same treatment: its class becomes a subclass also named
``Conv1D`` (same module name, so `is_hf_conv1d` and ``repr`` are unchanged; a copy or pickle of it
is a plain ``Conv1D``) whose ``forward`` runs the CSR kernels on the ``[out, in]`` views
``W.t()`` and ``mask.t()``. The caches stay keyed on the real parameter and mask buffer (a
``.t()`` view is a new object each call; it shares their ``_version``), the CSR of the transposed
mask is built once per mask change, and autograd hands the weight gradient back ``[in, out]``,
zero at pruned positions, as masked dense training does.

`WSELinear.forward` reads the mask where the algorithms keep it, the ``weight_mask`` buffer:

- no mask: ``F.linear(x, weight, bias)``, the very call `nn.Linear.forward` makes (bit-identical).
- a mask: `sparse_linear` on a cached `CSRWeight`. The cache is keyed on the mask tensor object
  and its ``_version`` counter, which every in-place write bumps (``copy_`` in a mask update,
  ``load_state_dict``), so the structure is rebuilt exactly when a mask may have changed. A bump
  whose content is unchanged (DDP's buffer broadcast, reloading the same masks) costs one
  comparison, not a rebuild. A mask that appears later (an algorithm applied after installation,
  `register_masks` for inference) is picked up by the next forward.
- a mask, and the dense path chosen for a layer whose live algorithm keeps pruned weights and
  gradients at exactly 0 (`_LayerState.zeros_kept`): plain ``F.linear(x, weight, bias)``, no
  masked copies ("auto" times that as its dense candidate); the algorithm's gradient hook zeroes
  the weight gradient at pruned positions before any optimizer sees it.
- a mask, and an algorithm owning this weight has ``dense_grad_needed`` set (the backward of a
  RigL/GraNet update step): forward and input gradient stay sparse, and the weight gradient is the
  full dense ``grad_Y^T X`` (the gradient `nn.Linear` gives), for the algorithm to score growth.

Masked modules the device cannot run in CSR (an `nn.Embedding`, a `Conv2d`, an `nn.Linear`
subclass with its own forward, inputs under autocast or in a dtype other than float32/float64)
run their usual dense forward on weights that are zero at pruned positions, which is exactly
masked dense training; each such module warns once. A masked ``Conv2d`` has its matmuls recorded
in the statistics as dense (executed = dense equivalent, by a forward hook the executor removes
with itself), so no FLOP saving is claimed for it.
"""

from __future__ import annotations

import copyreg
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sparse.core.algorithms import SparsityAlgorithm, algorithms_of
from lightning_sparse.core.layouts import is_hf_conv1d
from lightning_sparse.core.state_dict import restore_masks
from lightning_sparse.wse import compact as compact_state
from lightning_sparse.wse.autotune import resolve_path
from lightning_sparse.wse.compact import CompactLayers, CompactState
from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.kernels import sparse_linear
from lightning_sparse.wse.ops import inference_runner, run_compact_path
from lightning_sparse.wse.policy import PATHS
from lightning_sparse.wse.stats import LayerMemory, WSEStats

__all__ = ["WSEExecutor", "WSELinear", "install_executor", "on_wse", "register_masks"]

_MASK = "weight_mask"
INFERENCE_DTYPE_ENV = "LIGHTNING_SPARSE_WSE_INFERENCE_DTYPE"
"""Environment variable: the `WSEExecutor` ``inference_dtype`` default ("float32", "bfloat16")."""
_INFERENCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CSR_DTYPES = (torch.float32, torch.float64)
# Per-layer state lives beside the module, not in it, so deepcopy/pickle of a model never drags
# the executor along (a copy runs as a plain nn.Linear) and removal leaves no attribute behind.
_STATE: weakref.WeakKeyDictionary[nn.Module, _LayerState] = weakref.WeakKeyDictionary()
_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class WSELinear(nn.Linear):
    """`nn.Linear` whose masked weight runs in CSR. Made by `install_executor`, never directly.

    In compact training (`compact.py`) its ``weight`` holds no values between steps; its state
    dict still holds the dense weight, and loading one turns the layer dense first.
    """

    def forward(self, input: Tensor) -> Tensor:
        fast = self.__dict__.get(_FAST)  # the decode fast path, without a registry lookup
        if fast is not None and not torch.is_grad_enabled():
            y = fast(self, input)
            if y is not None:
                return y
        y = _execute(self, input)
        return F.linear(input, self.weight, self.bias) if y is None else y

    def __getstate__(self) -> dict[str, Any]:
        return _without_fast(self.__dict__)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        state = _STATE.get(self)
        if state is not None and state.compact is not None:
            destination[prefix + "weight"] = state.compact.dense_weight()

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        state = _STATE.get(self)
        if state is not None and state.compact is not None:
            state.decompact()
        super()._load_from_state_dict(state_dict, prefix, *args)


def _execute(module: nn.Module, x: Tensor) -> Tensor | None:
    """``module``'s output ``[..., out]`` on the device, or None where no executor runs it."""
    state = _STATE.get(module)
    if state is None:
        return None
    return state.run(module, x)


_FAST = "_wse_fast"
"""The instance attribute holding a layer's `_FastInference` while it is valid: read straight
from the instance dict by ``forward`` (a decode call of a small layer costs microseconds, so the
registry lookup matters), dropped from pickles and copies."""


def _without_fast(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != _FAST}


# Hugging Face Conv1D class -> its device subclass.
_WSE_CONV1D: dict[type, type] = {}


def _wse_conv1d_class(base: type) -> type:
    """The device subclass of an HF ``Conv1D`` class (made once): same name and module, its
    ``forward`` runs `_execute`; pickled and copied as ``base``, so copies carry no executor."""
    cls = _WSE_CONV1D.get(base)
    if cls is None:

        def forward(self: nn.Module, input: Tensor) -> Tensor:
            fast = self.__dict__.get(_FAST)
            if fast is not None and not torch.is_grad_enabled():
                y = fast(self, input)
                if y is not None:
                    return y
            y = _execute(self, input)
            return base.forward(self, input) if y is None else y

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            rv = super(cls, self).__reduce_ex__(protocol)  # (rebuild, (cls, ...), state, ...)
            state = _without_fast(rv[2]) if isinstance(rv[2], dict) else rv[2]
            return (copyreg._reconstructor, (base, object, None), state, *rv[3:])

        namespace = {"forward": forward, "__reduce_ex__": __reduce_ex__}
        namespace.update(__module__=base.__module__, __qualname__=base.__qualname__)
        cls = _WSE_CONV1D[base] = type(base.__name__, (base,), namespace)
    return cls


def _on_device(module: nn.Module) -> bool:
    """Whether ``module``'s class is one the executor runs (`WSELinear`, a device Conv1D)."""
    return type(module) is WSELinear or type(module) in _WSE_CONV1D.values()


class WSEExecutor:
    """The executor installed on one model: its layers, statistics and kernel path.

    Args:
        root: the model (its algorithms are found with `algorithms_of` on its modules).
        stats: where FLOPs, memory and rebuilds are recorded.
        path: `sparse_linear` path ("auto", "compiled", "torch", "dense"); None follows the
            ``LIGHTNING_SPARSE_WSE_PATH`` environment variable (default "auto").
        inference_dtype: storage of the kept values in inference (no autograd) of float32
            layers: "float32" (exact masked dense numbers) or "bfloat16" (opt-in: half the value
            bytes for memory-bound decode, values rounded to bf16, products summed in fp32;
            training never changes). None follows ``LIGHTNING_SPARSE_WSE_INFERENCE_DTYPE``
            (default "float32").
        optimizers: the optimizers training the model, read when a layer goes compact; None
            (default) trains every layer in dense form. With them, a masked `nn.Linear` whose
            live algorithm keeps its pruned entries at 0 and whose weight one elementwise
            optimizer steps trains its kept values only (`compact.py`).
    """

    def __init__(
        self,
        root: nn.Module,
        stats: WSEStats,
        path: str | None,
        inference_dtype: str | None = None,
        optimizers: Callable[[], Sequence[torch.optim.Optimizer]] | None = None,
    ) -> None:
        if path is not None and path != "auto" and path not in PATHS:
            raise ValueError(f"kernel path must be None, 'auto' or one of {PATHS}, got {path!r}")
        source = "inference_dtype"
        if inference_dtype is None:
            source = INFERENCE_DTYPE_ENV
            inference_dtype = os.environ.get(INFERENCE_DTYPE_ENV, "float32")
        if inference_dtype not in _INFERENCE_DTYPES:
            raise ValueError(
                f"{source} must be one of {tuple(_INFERENCE_DTYPES)}, got {inference_dtype!r}"
            )
        self.inference_dtype = _INFERENCE_DTYPES[inference_dtype]
        self._root = weakref.ref(root)
        self.stats = stats
        self.path = path
        self._layers: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # Masked Conv2d modules running dense: their stats hooks, by module.
        self._dense_hooks: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        self.compact = None if optimizers is None else CompactLayers(optimizers, self.settle)

    @property
    def layers(self) -> list[nn.Module]:
        """The `WSELinear` and Conv1D modules this executor runs."""
        return [m for m in self._layers if _owner(m) is self]

    def settle(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Layers that trained dense through a mask update go compact again (after an optimizer
        step: nothing of the weight's size is held between steps)."""
        if self.compact is None:
            return
        for module in self.layers:
            state = _STATE[module]
            mask = module._buffers.get(_MASK)
            if state.compact is None and mask is not None:
                state.try_compact(module, mask)

    def dense_grads(self) -> dict[str, Tensor]:
        """``{name: dense gradient}`` of every compact layer's weight that has a gradient, as
        the cpu path holds it (``[out, in]``, zeros at pruned positions; a new tensor); names
        as ``root.named_parameters()`` gives them. For inspecting a compact run."""
        root = self._root()
        out: dict[str, Tensor] = {}
        for name, module in [] if root is None else root.named_modules():
            state = _STATE.get(module)
            compact = None if state is None else state.compact
            if compact is not None and compact.values.grad is not None:
                key = f"{name}.weight" if name else "weight"
                out[key] = compact.csr.to_dense(compact.values.grad)
        return out

    def remove(self) -> None:
        """Give every layer back its `nn.Linear` / ``Conv1D`` class (compact layers' weights
        dense again, `compact.release`) and drop the cached CSR structures."""
        if self.compact is not None:
            self.compact.release()
        for module in list(self._layers):
            if _owner(module) is self:
                _STATE.pop(module).fast = None
                if _on_device(module):
                    module.__class__ = type(module).__base__
        self._layers = weakref.WeakSet()
        for handle in list(self._dense_hooks.values()):
            handle.remove()
        self._dense_hooks = weakref.WeakKeyDictionary()

    def owners_of(self, module: nn.Module) -> list[SparsityAlgorithm]:
        """Algorithms that sparsify ``module.weight`` (read at each structure rebuild)."""
        root = self._root()
        if root is None:
            return []
        found: list[SparsityAlgorithm] = []
        for sub in root.modules():
            for algorithm in algorithms_of(sub):
                if algorithm not in found and any(
                    sp.module is module and sp.param_name == "weight"
                    for sp in algorithm.sparse_params.values()
                ):
                    found.append(algorithm)
        return found

    def check_fallbacks(self) -> None:
        """Warn once per masked module that runs dense because it is not an `nn.Linear` or an
        HF ``Conv1D``."""
        root = self._root()
        if root is None:
            return
        for name, module in root.named_modules():
            if _on_device(module) and _owner(module) is self:
                masks = [k for k in module._buffers if k.endswith("_mask") and k != _MASK]
                masks = [k for k in masks if k[: -len("_mask")] != "bias"]
            else:
                params = set(module._parameters)
                masks = [k for k in module._buffers if k.endswith("_mask") and k[:-5] in params]
            if not masks:
                continue
            counted = isinstance(module, nn.Conv2d)
            if counted and module not in self._dense_hooks:
                self._dense_hooks[module] = module.register_forward_hook(_DenseCounter(self))
            _warn_once(
                module,
                f"lightning_sparse.wse: {name or type(module).__name__!r} "
                f"({type(module).__name__}) has masks {masks} but the WSE runs only "
                "nn.Linear and Conv1D weights in CSR; it runs dense on its pruned weights (same "
                "numbers as masked dense training, dense FLOPs"
                + (": its FLOP statistics count it as dense, no saving)." if counted else ")."),
            )

    def __repr__(self) -> str:
        return f"WSEExecutor(layers={len(self.layers)}, path={self.path!r})"


class _LayerState:
    """Cached CSR structure of one layer and the key it was built for.

    The caches are keyed on the module's own ``weight`` parameter and ``weight_mask`` buffer
    (objects and ``_version``); the kernels see `out_in` views, ``[out, in]``.
    """

    def __init__(
        self, executor: WSEExecutor, name: str, module: nn.Module, in_out: bool = False
    ) -> None:
        self.executor = executor
        self.name = name
        self._module = weakref.ref(module)
        self._fast: _FastInference | None = None
        self.in_out = in_out  # weight stored [in, out] (HF Conv1D)
        self.csr: CSRWeight | None = None
        self.mask: Tensor | None = None  # the tensor the cache was built from
        self.version = -1
        self.owners: list[weakref.ref[SparsityAlgorithm]] = []
        # (algorithm, sparse-parameter name) of each owner of this weight, and the training path
        # per token count where an owner keeps pruned entries at 0 (`zeros_kept`).
        self.owned_as: list[tuple[weakref.ref[SparsityAlgorithm], str]] = []
        self.train_paths: dict[int, str] = {}
        # Inference: the kept values, gathered once per weight version, and a runner per token
        # count (the path "auto" chose for it); both dropped when csr, weight or mask change.
        self.values: Tensor | None = None
        self.values_key: tuple[CSRWeight, int, Tensor | None] | None = None
        # (runner, executed FLOPs per token, plain F.linear) per token count.
        self.runners: dict[int, tuple[Callable[[Tensor], Tensor], int, bool]] = {}
        # Compact training (`compact.py`): the layer's compact form, and its path per tokens.
        self.compact: CompactState | None = None
        self.compact_paths: dict[int, str] = {}

    @property
    def fast(self) -> _FastInference | None:
        """The decode fast path while valid (mirrored into the module's instance dict)."""
        return self._fast

    @fast.setter
    def fast(self, value: _FastInference | None) -> None:
        self._fast = value
        module = self._module()
        if module is not None:
            if value is None:
                module.__dict__.pop(_FAST, None)
            else:
                module.__dict__[_FAST] = value

    def out_in(self, t: Tensor) -> Tensor:
        """``t`` (weight or mask) as ``[out, in]``: a transposed view for a Conv1D."""
        return t.t() if self.in_out else t

    def run(self, module: nn.Module, x: Tensor) -> Tensor:
        """The layer's output ``[..., out]`` for an input ``x [..., in]``."""
        mask = module._buffers.get(_MASK)  # the buffer itself, the cache key
        if self.compact is not None and not self._compact_current(module, mask):
            self.decompact()  # mask or weight changed under the compact form
        weight, bias = self.out_in(module.weight), module.bias  # weight [out, in]
        if mask is None:
            if self.csr is not None:  # densified: forget the structure
                self.csr, self.mask = None, None
                self.executor.stats.forget_layer(self.name)
            y = F.linear(x, weight, bias)
            self._record(x, y, weight, weight.numel(), dense_grad=False)
            return y
        if x.device != weight.device:
            raise ValueError(
                f"{self.name!r}: input on {x.device} but the layer's weight is on "
                f"{weight.device}; move the input (or the model) to one device"
            )
        if not _csr_supported(x, weight):
            _warn_once(
                module,
                f"lightning_sparse.wse: {self.name!r} gets a {x.dtype} input "
                f"(weight {weight.dtype}, autocast "
                f"{torch.is_autocast_enabled(x.device.type)}); the CSR kernels run float32/"
                "float64 without autocast, so this layer runs dense (same numbers as masked "
                "dense training).",
            )
            self.decompact()
            return F.linear(x, self.out_in(module.weight), bias)
        inference = not torch.is_grad_enabled() or not (
            weight.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)
        )
        if self.compact is not None and not inference and self._update_due():
            self.decompact()  # the mask update reads the dense weight: this step runs dense
        elif self.compact is None and not inference:
            self.try_compact(module, mask)
        if self.compact is not None:
            return self._run_compact(x, module, inference)
        csr = self.structure(module, mask, transpose=not inference)
        if inference:
            y, kept = self._infer(x, module, csr)
            self._record(x, y, weight, kept, dense_grad=False)
            return y
        if self.values is not None:  # training gathers per call; free the inference cache
            self.values, self.values_key, self.runners, self.fast = None, None, {}, None
        dense_grad = (
            torch.is_grad_enabled()
            and weight.requires_grad
            and any(getattr(ref(), "dense_grad_needed", False) for ref in self.owners)
        )
        path = self.executor.path
        if weight.requires_grad and self.zeros_kept(module, mask):
            # The algorithm keeps pruned weights and gradients at exactly 0, so "dense" is plain
            # F.linear: same values as the masked copy, no masking passes (its gradient hook
            # zeroes the weight gradient at pruned positions before any optimizer sees it).
            tokens = x.numel() // csr.shape[1] if csr.shape[1] else 0
            chosen = self.train_paths.get(tokens)
            if chosen is None:
                chosen = resolve_path(x, weight, csr, path, requires_grad=True, zeros_kept=True)
                self.train_paths[tokens] = chosen
            if chosen == "dense":
                y = F.linear(x, weight, bias)
                self._record(x, y, weight, weight.numel(), dense_grad)
                return y
            path = chosen
        if dense_grad:
            y = sparse_linear(x, weight.detach(), csr, bias, path=path)
            y = _DenseWeightGrad.apply(y, x, weight)
        else:
            y = sparse_linear(x, weight, csr, bias, path=path)
        self._record(x, y, weight, csr.nnz, dense_grad)
        return y

    # ------------------------------------------------------------------ compact training
    def try_compact(self, module: nn.Module, mask: Tensor) -> None:
        """Go compact if the layer qualifies: the executor has optimizers, the weight (an
        `nn.Linear`'s, float32/float64 on the CPU) is stepped by one elementwise optimizer, a
        live algorithm keeps its pruned entries at 0 (`zeros_kept`) and no mask update is due
        before the coming step."""
        registry = self.executor.compact
        weight = module._parameters.get("weight")
        if registry is None or self.in_out or weight is None or not weight.requires_grad:
            return
        if weight.dtype not in _CSR_DTYPES or weight.device.type != "cpu":
            return
        csr = self.structure(module, mask, transpose=True, permutation=True)  # finds owners
        if not self.zeros_kept(module, mask) or self._update_due():
            return
        slot = compact_state.find_slot(registry.optimizers(), weight)
        if slot is None or not compact_state.qualifies(slot[0]):
            return
        self.compact = compact_state.to_compact(weight, csr, slot)
        registry.add(self, slot[0])

    def decompact(self) -> None:
        """Back to the dense form (no-op when dense)."""
        compact = self.compact
        if compact is None:
            return
        compact_state.to_dense(compact)
        self.compact = None
        if self.executor.compact is not None:
            self.executor.compact.discard(compact)
        self.values, self.values_key, self.runners, self.fast = None, None, {}, None

    def _compact_current(self, module: nn.Module, mask: Tensor | None) -> bool:
        """Whether the compact form still matches the module's weight and mask."""
        compact = self.compact
        assert compact is not None
        if mask is None or module._parameters.get("weight") is not compact.weight:
            return False
        return self.structure(module, mask, transpose=True, permutation=True) is compact.csr

    def _update_due(self) -> bool:
        return any(compact_state.update_due(ref()) for ref in self.owners)

    def _run_compact(self, x: Tensor, module: nn.Module, inference: bool) -> Tensor:
        """The forward of a compact layer: from its values, in training or inference."""
        compact, bias = self.compact, module.bias
        assert compact is not None
        csr = compact.csr
        tokens = x.numel() // csr.shape[1] if csr.shape[1] else 0
        if inference:
            y, kept = self._infer_compact(x, compact, bias, tokens)
            self._record(x, y, compact.weight, kept, dense_grad=False)
            return y
        if self.values is not None:  # training: free the inference cache
            self.values, self.values_key, self.runners, self.fast = None, None, {}, None
        chosen = self.compact_paths.get(tokens)
        if chosen is None:
            path = self.executor.path
            chosen = resolve_path(x, compact.values, csr, path, requires_grad=True, compact=True)
            self.compact_paths[tokens] = chosen
        y = run_compact_path(chosen, x, compact.values, csr, bias)
        nnz = compact.weight.numel() if chosen == "dense" else csr.nnz
        self._record(x, y, compact.weight, nnz, dense_grad=False)
        return y

    def _infer_compact(
        self, x: Tensor, compact: CompactState, bias: Tensor | None, tokens: int
    ) -> tuple[Tensor, int]:
        """Inference from the compact values (validation during a fit), cached per values
        version as `_infer` caches per weight version; returns (output, weights executed)."""
        csr, values = compact.csr, compact.values
        if x.dim() == 0 or x.shape[-1] != csr.shape[1]:
            raise ValueError(f"x must be [..., {csr.shape[1]}], got shape {tuple(x.shape)}")
        key = self.values_key
        if (
            key is None
            or key[0] is not csr
            or key[1] != values._version
            or key[2] is not bias
            or self.fast is not None
        ):
            self.values = self._stored(values.detach())
            self.values_key = (csr, values._version, bias)
            self.runners, self.fast = {}, None
        entry = self.runners.get(tokens)
        if entry is None:
            path = resolve_path(x, values, csr, self.executor.path, requires_grad=False)
            assert self.values is not None
            runner = inference_runner(path, self.values, csr, None, None, bias)
            entry = self.runners[tokens] = _runner_entry(runner, path, csr)
        return entry[0](x), entry[1] // 2

    def zeros_kept(self, module: nn.Module, mask: Tensor) -> bool:
        """Whether a live algorithm keeps this weight's pruned entries and gradient at exactly 0:
        it owns the weight under this very mask and its per-step gradient hook is on this very
        parameter (`core.per_step.StepHooks`). Masks registered without an algorithm
        (`restore_masks`, a copied model) do not qualify: those layers keep masking."""
        weight = module.weight
        for ref, name in self.owned_as:
            algorithm = ref()
            if algorithm is None:
                continue
            sp = algorithm.sparse_params.get(name)
            hooks = getattr(algorithm, "hooks", None)
            guarded = hooks is not None and hooks.guards(name, weight)
            if sp is not None and sp.mask is mask and guarded:
                return True
        return False

    def _infer(self, x: Tensor, module: nn.Module, csr: CSRWeight) -> tuple[Tensor, int]:
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
        param, buffer, bias = module.weight, module._buffers[_MASK], module.bias
        weight, mask = self.out_in(param), self.out_in(buffer)  # [out, in] views
        if weight.is_inference():  # no version counter to key a cache on
            path = resolve_path(x, weight, csr, self.executor.path, requires_grad=False)
            values = self._stored(csr.gather_values(weight.detach()))
            kept = weight.numel() if path == "dense" else csr.nnz
            return inference_runner(path, values, csr, weight, mask, bias)(x), kept
        key = self.values_key
        if key is None or key[0] is not csr or key[1] != weight._version or key[2] is not bias:
            self.values = self._stored(csr.gather_values(weight.detach()))
            self.values_key = (csr, weight._version, bias)
            self.runners = {}
            self.fast = None
            if not mask.is_inference() and weight.is_cpu:
                self.fast = _FastInference(self, param, buffer, bias, x.dtype, csr)
        tokens = x.numel() // in_features if in_features else 0
        entry = self.runners.get(tokens)
        if entry is None:
            path = resolve_path(x, weight, csr, self.executor.path, requires_grad=False)
            assert self.values is not None
            runner = inference_runner(path, self.values, csr, weight, mask, bias)
            entry = self.runners[tokens] = _runner_entry(runner, path, csr)
        return entry[0](x), entry[1] // 2

    def _stored(self, values: Tensor) -> Tensor:
        """The kept values as inference holds them (`WSEExecutor` ``inference_dtype``)."""
        wanted = self.executor.inference_dtype
        if wanted == torch.bfloat16 and values.dtype == torch.float32:
            return values.to(torch.bfloat16)
        return values

    def structure(
        self, module: nn.Module, mask: Tensor, transpose: bool = True, permutation: bool = False
    ) -> CSRWeight:
        """The `CSRWeight` (``[out, in]``) of ``mask`` (the module's buffer), rebuilt only when
        the mask may have changed (or when training needs the transposed structure, or a compact
        layer the permutation, that the cached one lacks)."""
        csr = self.csr
        # A structure built under inference_mode holds inference tensors, which autograd may not
        # save for backward: rebuild it for training. Inference builds forward-only structures.
        usable = (
            csr is not None
            and (not csr.crow_indices.is_inference() or torch.is_inference_mode_enabled())
            and (csr.has_transpose or not transpose)
            and (csr.t_perm is not None or not permutation)
        )
        version = _version_of(mask)
        if usable and mask is self.mask and version == self.version and version >= 0:
            return csr
        start = time.perf_counter()
        weight = self.out_in(module.weight.detach())
        built = CSRWeight.from_dense(
            weight, self.out_in(mask), transpose=transpose or permutation, permutation=permutation
        )
        seconds = time.perf_counter() - start
        if usable and built.same_structure(csr):
            # Written, but unchanged (DDP's buffer broadcast, reloading the same masks): keep the
            # structure object, so the caches keyed on it stay valid.
            self.mask, self.version = mask, version
            self._find_owners(module)
            return csr
        csr = built
        self.csr, self.mask, self.version = csr, mask, version
        self._find_owners(module)
        self.train_paths, self.compact_paths = {}, {}
        out_features, in_features = csr.shape
        memory = LayerMemory.of(out_features, in_features, csr.nnz, module.weight.element_size())
        self.executor.stats.add_rebuild(self.name, seconds, memory)
        self.executor.check_fallbacks()
        return csr

    def _find_owners(self, module: nn.Module) -> None:
        """The algorithms owning this weight, read at each (re)build of the structure."""
        owners = self.executor.owners_of(module)
        self.owners = [weakref.ref(a) for a in owners]
        self.owned_as = [
            (weakref.ref(a), name)
            for a in owners
            for name, sp in a.sparse_params.items()
            if sp.module is module and sp.param_name == "weight"
        ]

    def _record(self, x: Tensor, y: Tensor, weight: Tensor, nnz: int, dense_grad: bool) -> None:
        out_features, in_features = weight.shape
        tokens = x.numel() // in_features if in_features else 0
        numel = out_features * in_features
        stats = self.executor.stats
        stats.add_flops("forward", 2 * tokens * nnz, 2 * tokens * numel)
        if y.requires_grad:
            y.register_hook(
                _BackwardCounter(
                    stats, tokens, nnz, numel, x.requires_grad, weight.requires_grad, dense_grad
                )
            )


def _runner_entry(
    runner: Callable[[Tensor], Tensor], path: str, csr: CSRWeight
) -> tuple[Callable[[Tensor], Tensor], int, bool]:
    """A runner, the forward FLOPs per token it executes (every weight where it runs dense) and
    whether it is plain ``F.linear`` (no dtype or autocast constraints)."""
    dense = path == "dense"
    return runner, 2 * (csr.shape[0] * csr.shape[1] if dense else csr.nnz), dense


class _FastInference:
    """A layer's forward without autograd when nothing changed since the last call: the same
    mask buffer (object and version), weight parameter (object and version; ``[out, in]`` or a
    Conv1D's ``[in, out]``), bias and input dtype, a CPU input,
    no CPU autocast, a token count already seen. Returns None otherwise, and `_LayerState.run`
    takes over (and rebuilds what changed). Records forward FLOPs like `_LayerState._record`.
    Made only for CPU weights; the checks read the module's dicts directly (cheaper than
    ``nn.Module.__getattr__``), since a one-token call of a small layer costs a few microseconds.
    """

    __slots__ = ("runners", "stats", "total", "weight", "weight_version", "mask", "mask_version",
                 "bias", "dtype", "in_features", "numel")  # fmt: skip

    def __init__(
        self, state: _LayerState, weight: Tensor, mask: Tensor, bias: Tensor | None,
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
            or module._buffers.get(_MASK) is not self.mask
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
        if entry is None or not entry[2] and (
            x.dtype is not self.dtype or not x.is_cpu or torch.is_autocast_enabled("cpu")
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


class _BackwardCounter:
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


class _DenseCounter:
    """Forward hook of a masked ``Conv2d`` running dense: records its matmuls in the statistics
    with executed = dense equivalent (``2 * positions * weight numel`` each; a position is one
    output pixel of one example)."""

    def __init__(self, executor: WSEExecutor) -> None:
        self.executor = weakref.ref(executor)

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], y: Any) -> None:
        executor = self.executor()
        if executor is None or not torch.is_tensor(y):
            return
        weight = module.weight
        positions = y.numel() // y.shape[-3] if y.ndim >= 3 else 0
        numel = weight.numel()
        x = inputs[0] if inputs and torch.is_tensor(inputs[0]) else None
        stats = executor.stats
        stats.add_flops("forward", 2 * positions * numel, 2 * positions * numel)
        if y.requires_grad:
            input_grad = x is not None and x.requires_grad
            y.register_hook(
                _BackwardCounter(
                    stats, positions, numel, numel, input_grad, weight.requires_grad, False
                )
            )


class _DenseWeightGrad(torch.autograd.Function):
    """Identity on a layer's output ``y`` whose backward also gives ``weight`` the dense gradient
    ``grad_Y^T X`` (what `nn.Linear` computes), while ``y`` itself came from the sparse kernels."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, x: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[2]:
            grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return grad_y, None, grad_w


def install_executor(
    model: nn.Module,
    *,
    stats: WSEStats | None = None,
    path: str | None = None,
    inference_dtype: str | None = None,
    optimizers: Callable[[], Sequence[torch.optim.Optimizer]] | None = None,
) -> WSEExecutor:
    """Run ``model``'s masked `nn.Linear` and HF ``Conv1D`` layers in CSR from now on (see the
    module docstring).

    Args:
        model: any module; every submodule of exact type `nn.Linear` (``model`` itself included)
            becomes a `WSELinear`, every HF ``Conv1D`` its device subclass. Layers another
            executor ran are taken over.
        stats: where to record FLOPs, memory and rebuilds (default: a new `WSEStats`).
        path: `sparse_linear` path, see `WSEExecutor`.
        inference_dtype: "float32" or "bfloat16" storage of kept values in inference, see
            `WSEExecutor`.
        optimizers: the training optimizers, for compact training (see `WSEExecutor`); None
            trains every layer in dense form.

    Returns:
        The executor; ``executor.remove()`` undoes the installation.

    Raises:
        ValueError: on an unknown ``path`` or ``inference_dtype``.
    """
    executor = WSEExecutor(
        model, stats if stats is not None else WSEStats(), path, inference_dtype, optimizers
    )
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = WSELinear
        elif is_hf_conv1d(module) and not _on_device(module):
            module.__class__ = _wse_conv1d_class(type(module))
        if _on_device(module):
            old = _STATE.get(module)
            if old is not None:  # taken over from another executor
                old.fast = None
            _STATE[module] = _LayerState(executor, name, module, in_out=is_hf_conv1d(module))
            executor._layers.add(module)
    executor.check_fallbacks()
    return executor


@contextmanager
def on_wse(
    model: nn.Module,
    *,
    stats: WSEStats | None = None,
    path: str | None = None,
    inference_dtype: str | None = None,
) -> Iterator[WSEExecutor]:
    """``with on_wse(model) as executor:`` runs ``model`` on the device inside the block.

    Example (inference from a sparse checkpoint without its algorithm)::

        register_masks(lit, checkpoint["state_dict"])
        lit.load_state_dict(checkpoint["state_dict"])
        with on_wse(lit):
            tokens = lit.model.generate(prompt, max_new_tokens=32, temperature=0)
    """
    executor = install_executor(model, stats=stats, path=path, inference_dtype=inference_dtype)
    try:
        yield executor
    finally:
        executor.remove()


register_masks = restore_masks
"""Alias of `lightning_sparse.core.state_dict.restore_masks` (its older name here)."""


def _owner(module: nn.Module) -> WSEExecutor | None:
    state = _STATE.get(module)
    return None if state is None else state.executor


def _version_of(mask: Tensor) -> int:
    # Inference tensors have no version counter: -1 makes every call compare the content.
    return -1 if mask.is_inference() else mask._version


def _csr_supported(x: Tensor, weight: Tensor) -> bool:
    return (
        x.dtype == weight.dtype
        and x.dtype in _CSR_DTYPES
        and not torch.is_autocast_enabled(x.device.type)
    )


def _warn_once(module: nn.Module, message: str) -> None:
    if module in _WARNED:
        return
    _WARNED.add(module)
    warnings.warn(message, UserWarning, stacklevel=3)
