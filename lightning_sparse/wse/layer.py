"""One layer on the device: its cached CSR structure, owners, compact form, and its forward.

`LayerState.run` is the forward of a `WSELinear` (or device ``Conv1D``) that the executor runs;
its cases are the executor module's docstring. The structure is cached per mask (object and
version); the algorithms owning the weight are read at each rebuild; a layer trains in compact
form (`compact.py`) when it qualifies (`try_compact`), through mask updates too: it is the
weight's holder (`core.held`), so the algorithm reads one dense weight at a time from it and the
layer rebuilds its compact form under each new mask (`mask_changed`).
Inference is `inference.py`'s.
"""

from __future__ import annotations

import functools
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sparse.core import held
from lightning_sparse.core.algorithms import DropAndGrow, SparsityAlgorithm
from lightning_sparse.wse import compact as compact_state
from lightning_sparse.wse.autotune import resolve_path
from lightning_sparse.wse.compact import CompactLayers, CompactState
from lightning_sparse.wse.counters import BackwardCounter
from lightning_sparse.wse.csr import CSRWeight
from lightning_sparse.wse.inference import FAST, MASK, FastInference, infer, infer_compact
from lightning_sparse.wse.kernels import sparse_linear
from lightning_sparse.wse.layer_tensors import bias_of, weight_of
from lightning_sparse.wse.ops import CompactDenseWeightGrad, DenseWeightGrad, run_compact_path
from lightning_sparse.wse.stats import LayerMemory, WSEStats


class Executor(Protocol):
    """What a layer reads from the `WSEExecutor` that runs it (a protocol, so this module does
    not import the executor, which imports it)."""

    path: str | None
    stats: WSEStats
    compact: CompactLayers | None
    accumulate_grad_batches: int

    @property
    def inference_dtype(self) -> torch.dtype | None: ...  # read-only: the executor's is set

    def owners_of(self, module: nn.Module) -> list[SparsityAlgorithm]: ...

    def check_fallbacks(self) -> None: ...


__all__ = ["CSR_DTYPES", "STATE", "LayerState", "csr_supported", "version_of", "warn_once"]

CSR_DTYPES = (torch.float32, torch.float64)
# Per-layer state lives beside the module, not in it, so deepcopy/pickle of a model never drags
# the executor along (a copy runs as a plain nn.Linear) and removal leaves no attribute behind.
STATE: weakref.WeakKeyDictionary[nn.Module, LayerState] = weakref.WeakKeyDictionary()
WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class LayerState:
    """Cached CSR structure of one layer and the key it was built for.

    The caches are keyed on the module's own ``weight`` parameter and ``weight_mask`` buffer
    (objects and ``_version``); the kernels see `out_in` views, ``[out, in]``.
    """

    def __init__(
        self, executor: Executor, name: str, module: nn.Module, in_out: bool = False
    ) -> None:
        self.executor = executor
        self.name = name
        self._module = weakref.ref(module)
        self._fast: FastInference | None = None
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
        # Made from the meta device compact (`materialize`): the model never held its dense
        # weight, so the layer stays compact when the executor is removed (`built_sparse`).
        self.built_sparse = False
        self.compact_paths: dict[int, str] = {}
        # A RigL/GraNet update step's backward: the gradient outside the mask that the update
        # can read (`compact.grow_candidates`), kept in place of the dense gradient.
        self.candidates: tuple[Tensor, Tensor] | None = None

    @property
    def fast(self) -> FastInference | None:
        """The decode fast path while valid (mirrored into the module's instance dict)."""
        return self._fast

    @fast.setter
    def fast(self, value: FastInference | None) -> None:
        self._fast = value
        module = self._module()
        if module is not None:
            if value is None:
                module.__dict__.pop(FAST, None)
            else:
                module.__dict__[FAST] = value

    def out_in(self, t: Tensor) -> Tensor:
        """``t`` (weight or mask) as ``[out, in]``: a transposed view for a Conv1D."""
        return t.t() if self.in_out else t

    def run(self, module: nn.Module, x: Tensor) -> Tensor:
        """The layer's output ``[..., out]`` for an input ``x [..., in]``."""
        mask = module._buffers.get(MASK)  # the buffer itself, the cache key
        if self.compact is not None and not self._compact_current(module, mask):
            self.decompact()  # mask or weight changed under the compact form
        weight, bias = self.out_in(weight_of(module)), bias_of(module)  # weight [out, in]
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
        if not csr_supported(x, weight):
            warn_once(
                module,
                f"lightning_sparse.wse: {self.name!r} gets a {x.dtype} input "
                f"(weight {weight.dtype}, autocast "
                f"{torch.is_autocast_enabled(x.device.type)}); the CSR kernels run float32/"
                "float64 without autocast, so this layer runs dense (same numbers as masked "
                "dense training).",
            )
            self.decompact()
            return F.linear(x, self.out_in(weight_of(module)), bias)
        inference = not torch.is_grad_enabled() or not (
            weight.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)
        )
        if self.compact is None and not inference:
            self.try_compact(module, mask)
        elif self.compact is not None and not inference and self.compact.optimizer() is None:
            self.adopt()
        if self.compact is not None:
            return self._run_compact(x, module, inference)
        csr = self.structure(module, mask)
        if inference:
            y, kept = infer(self, x, module, csr)
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
            y = DenseWeightGrad.apply(y, x, weight)
        else:
            y = sparse_linear(x, weight, csr, bias, path=path)
        self._record(x, y, weight, csr.nnz, dense_grad)
        return y

    # ------------------------------------------------------------------ compact training
    def try_compact(self, module: nn.Module, mask: Tensor) -> None:
        """Go compact if the layer qualifies: the executor has optimizers, the weight (an
        `nn.Linear`'s, float32/float64 on the CPU) is stepped by one elementwise optimizer, a
        live algorithm keeps its pruned entries at 0 (`zeros_kept`)."""
        registry = self.executor.compact
        weight = module._parameters.get("weight")
        if registry is None or self.in_out or weight is None or not weight.requires_grad:
            return
        if weight.dtype not in CSR_DTYPES or weight.device.type != "cpu":
            return
        csr = self.structure(module, mask)  # finds owners
        if not self.zeros_kept(module, mask):
            return
        slot = compact_state.find_slot(registry.optimizers(), weight)
        if slot is None or not compact_state.qualifies(slot[0]):
            return
        self.compact = compact_state.to_compact(weight, csr, slot)
        held.hold(weight, self)
        registry.add(self, slot[0])

    def park(self, module: nn.Module, mask: Tensor) -> None:
        """Go compact before any optimizer holds the weight (a model built sparse under
        Lightning, `materialize`): the kept values wait for `adopt`. Only where `try_compact`
        could apply: an `nn.Linear`'s float32/float64 CPU weight a live algorithm keeps at 0."""
        weight = module._parameters.get("weight")
        if self.executor.compact is None or self.in_out or weight is None:
            return
        if not weight.requires_grad or weight.dtype not in CSR_DTYPES:
            return
        if weight.device.type != "cpu":
            return
        csr = self.structure(module, mask)  # finds owners
        if not self.zeros_kept(module, mask):
            return
        self.compact = compact_state.park(weight, csr)
        held.hold(weight, self)

    def load_csr(self, module: nn.Module, incoming: Tensor) -> None:
        """Load a sparse CSR ``weight`` (`WSELinear`'s state dict of a layer built sparse) in
        place: the mask becomes its kept positions, the compact values its values; the
        optimizer state follows the mask (`mask_changed`) and loads after. Nothing of the
        weight's size but the mask is made.

        Raises:
            ValueError: ``incoming`` has another shape or dtype, or its entries are not
                in row order with ascending columns (as this package writes them); nothing is
                changed then.
        """
        compact, mask = self.compact, module._buffers.get(MASK)
        assert compact is not None and mask is not None
        shape = tuple(compact.weight.shape)
        if tuple(incoming.shape) != shape or incoming.dtype != compact.values.dtype:
            raise ValueError(
                f"a sparse CSR weight of shape {tuple(incoming.shape)} and {incoming.dtype} does "
                f"not fit the layer's {shape} {compact.values.dtype} weight"
            )
        crow = incoming.crow_indices().to(torch.int64)
        cols = incoming.col_indices().to(torch.int64)
        rows = torch.repeat_interleave(torch.arange(shape[0]), crow.diff())
        flat = rows.mul_(shape[1]).add_(cols)
        if flat.numel() > 1 and not bool((flat.diff() > 0).all()):
            raise ValueError(
                "its entries are not in row order with ascending, distinct columns; write it "
                "with this package (or sort it: torch.sparse_csr_tensor of sorted indices)"
            )
        new_mask = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        new_mask[flat.to(mask.device)] = True
        with torch.no_grad():
            mask.copy_(new_mask.view(mask.shape))
        self.mask_changed()  # the structure and the optimizer state follow the new mask
        compact = self.compact
        assert compact is not None
        with torch.no_grad():
            compact.values.copy_(incoming.values().to(compact.values.device))

    def adopt(self) -> None:
        """The first training forward of a parked layer (`park`), or of one whose optimizer is
        gone: the optimizer that now holds the weight steps the values (`compact.adopt`); with
        none that qualifies, the layer goes dense."""
        compact, registry = self.compact, self.executor.compact
        assert compact is not None
        slot = None
        if registry is not None:
            slot = compact_state.find_slot(registry.optimizers(), compact.weight)
        if slot is None or not compact_state.qualifies(slot[0]):
            self.decompact()
            return
        assert registry is not None
        compact_state.adopt(compact, slot)
        registry.add(self, slot[0])

    def decompact(self) -> None:
        """Back to the dense form (no-op when dense)."""
        compact = self.compact
        if compact is None:
            return
        grad = self.dense_grad()  # an update step's dense gradient, if it is held
        compact_state.to_dense(compact)
        if grad is not None:
            compact.weight.grad = grad
        self.compact, self.candidates = None, None
        held.release(compact.weight)
        if self.executor.compact is not None:
            self.executor.compact.discard(compact)
        self.values, self.values_key, self.runners, self.fast = None, None, {}, None

    # The holder of a compact weight (`core.held.Holder`).
    def dense_weight(self) -> Tensor:
        """The compact weight as a new dense ``[out, in]`` tensor (zeros where pruned)."""
        assert self.compact is not None
        return self.compact.dense_weight()

    def dense_grad(self) -> Tensor | None:
        """The gradient an update step reads, dense ``[out, in]``: the weight parameter's (the
        whole dense gradient), or the kept positions' and the grow candidates' (zero elsewhere:
        `compact.grow_candidates`); None on other steps."""
        compact = self.compact
        assert compact is not None
        if self.candidates is None:
            return compact.weight.grad
        grad = compact.values.grad
        dense = (
            compact.csr.to_dense(grad)
            if grad is not None
            else compact.values.new_zeros(compact.weight.shape)
        )
        return compact_state.with_candidates(dense, self.candidates)

    def keep_candidates(self, count: int, grad: Tensor) -> None:
        """Backward of a RigL/GraNet update step: of the layer's dense gradient ``grad``, keep
        what the update reads outside the mask (the top ``count`` by ``|grad|``).

        Raises:
            RuntimeError: a second backward reached the layer before the optimizer step
                (gradient accumulation not declared: the candidates of a sum of gradients are
                not those of its parts).
        """
        compact = self.compact
        assert compact is not None
        if self.candidates is not None and compact.values.grad is not None:
            raise RuntimeError(
                f"{self.name!r}: a second backward before the optimizer step of a RigL/GraNet "
                "update step; the device keeps the grow candidates of one backward, not the "
                "accumulated dense gradient. Declare gradient accumulation: "
                "on_wse(model, optimizer=..., accumulate_grad_batches=N)"
            )
        self.candidates = compact_state.grow_candidates(grad, compact.csr, count)

    def grow_count(self) -> int | None:
        """The most positions outside the mask this step's update can grow (the owners'
        `DropAndGrow.grow_candidates`), or None when the whole dense gradient must be kept (an
        owner reads more of it, or gradients are accumulated)."""
        if self.executor.accumulate_grad_batches != 1:
            return None
        counts = []
        for ref, name in self.owned_as:
            algorithm = ref()
            if algorithm is None or not algorithm.dense_grad_needed:
                continue
            # Only a drop-and-grow rule says what it reads of the gradient (its grow count).
            count = algorithm.grow_candidates(name) if isinstance(algorithm, DropAndGrow) else None
            if count is None:
                return None
            counts.append(count)
        return max(counts) if counts else None

    def mask_changed(self) -> None:
        """The owner wrote a new mask (a mask update, a loaded sparsity state): the values,
        gradient and optimizer state follow it (`compact.rebuild`); the dense gradient (or grow
        candidates) this step's update read is dropped. Unchanged structure: nothing moves."""
        compact, module = self.compact, self._module()
        assert compact is not None and module is not None
        mask = module._buffers.get(MASK)
        if mask is None:  # removed (densify): the next forward goes dense
            compact.weight.grad, self.candidates = None, None
            return
        csr = self.structure(module, mask)
        if csr is compact.csr:
            compact.weight.grad, self.candidates = None, None
            return
        grad, candidates = compact.weight.grad, self.candidates
        compact.weight.grad, self.candidates = None, None
        registry = self.executor.compact
        assert registry is not None
        registry.discard(compact)
        self.compact = None
        rebuilt = compact_state.rebuild(compact, csr, grad, candidates)
        self.values, self.values_key, self.runners, self.fast = None, None, {}, None
        if rebuilt is None:
            held.release(compact.weight)
            return
        self.compact = rebuilt
        optimizer = rebuilt.optimizer()
        if optimizer is not None:  # None: parked, no optimizer yet (`park`)
            registry.add(self, optimizer)

    def _compact_current(self, module: nn.Module, mask: Tensor | None) -> bool:
        """Whether the compact form still matches the module's weight and mask."""
        compact = self.compact
        assert compact is not None
        if mask is None or module._parameters.get("weight") is not compact.weight:
            return False
        return self.structure(module, mask) is compact.csr

    def _run_compact(self, x: Tensor, module: nn.Module, inference: bool) -> Tensor:
        """The forward of a compact layer: from its values, in training or inference."""
        compact, bias = self.compact, bias_of(module)
        assert compact is not None
        csr = compact.csr
        tokens = x.numel() // csr.shape[1] if csr.shape[1] else 0
        if inference:
            y, kept = infer_compact(self, x, compact, bias, tokens)
            self._record(x, y, compact.weight, kept, dense_grad=False)
            return y
        if self.values is not None:  # training: free the inference cache
            self.values, self.values_key, self.runners, self.fast = None, None, {}, None
        chosen = self.compact_paths.get(tokens)
        if chosen is None:
            path = self.executor.path
            chosen = resolve_path(x, compact.values, csr, path, requires_grad=True, compact=True)
            self.compact_paths[tokens] = chosen
        nnz = compact.weight.numel() if chosen == "dense" else csr.nnz
        # RigL/GraNet update step: the backward makes the layer's dense gradient and the values
        # their gradient from it. Without gradient accumulation the layer keeps only what the
        # update reads of it outside the mask (its grow candidates), so one layer's dense
        # gradient exists at a time; with it, the weight parameter holds the dense gradient
        # (accumulated over micro-batches). The update reads it, `mask_changed` drops it.
        dense_grad = any(getattr(ref(), "dense_grad_needed", False) for ref in self.owners)
        if dense_grad:
            count = self.grow_count()
            keep = None if count is None else functools.partial(self.keep_candidates, count)
            y = run_compact_path(chosen, x, compact.values.detach(), csr, bias)
            y = CompactDenseWeightGrad.apply(y, x, compact.weight, compact.values, csr, keep)
        else:
            y = run_compact_path(chosen, x, compact.values, csr, bias)
        self._record(x, y, compact.weight, nnz, dense_grad)
        return y

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

    def structure(self, module: nn.Module, mask: Tensor) -> CSRWeight:
        """The `CSRWeight` (``[out, in]``) of ``mask`` (the module's buffer), rebuilt only when
        the mask may have changed (one structure serves inference and training)."""
        csr = self.csr
        # A structure built under inference_mode holds inference tensors, which autograd may not
        # save for backward: rebuild it for training.
        usable = csr is not None and (
            not csr.crow_indices.is_inference() or torch.is_inference_mode_enabled()
        )
        version = version_of(mask)
        if (
            csr is not None
            and usable
            and mask is self.mask
            and version == self.version
            and version >= 0
        ):
            return csr
        start = time.perf_counter()
        weight = self.out_in(weight_of(module).detach())
        built = CSRWeight.from_dense(weight, self.out_in(mask))
        seconds = time.perf_counter() - start
        if csr is not None and usable and built.same_structure(csr):
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
        memory = LayerMemory.of(out_features, in_features, csr.nnz, weight.element_size())
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
                BackwardCounter(
                    stats, tokens, nnz, numel, x.requires_grad, weight.requires_grad, dense_grad
                )
            )


def version_of(mask: Tensor) -> int:
    # Inference tensors have no version counter: -1 makes every call compare the content.
    return -1 if mask.is_inference() else mask._version


def csr_supported(x: Tensor, weight: Tensor) -> bool:
    return (
        x.dtype == weight.dtype
        and x.dtype in CSR_DTYPES
        and not torch.is_autocast_enabled(x.device.type)
    )


def warn_once(module: nn.Module, message: str) -> None:
    if module in WARNED:
        return
    WARNED.add(module)
    warnings.warn(message, UserWarning, stacklevel=3)
