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
  gradients at exactly 0 (`LayerState.zeros_kept`): plain ``F.linear(x, weight, bias)``, no
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
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_sparse.core import applied
from lightning_sparse.core.algorithms import SparsityAlgorithm
from lightning_sparse.core.layouts import is_hf_conv1d
from lightning_sparse.core.state_dict import restore_masks
from lightning_sparse.wse.compact import ELEMENTWISE, CompactLayers
from lightning_sparse.wse.counters import DenseCounter
from lightning_sparse.wse.inference import FAST, MASK, without_fast
from lightning_sparse.wse.layer import STATE, LayerState, warn_once
from lightning_sparse.wse.materialize import Init, materialize
from lightning_sparse.wse.policy import PATHS
from lightning_sparse.wse.stats import WSEStats

__all__ = [
    "WSEExecutor",
    "WSELinear",
    "check_compact_training",
    "install_executor",
    "on_wse",
    "register_masks",
]

INFERENCE_DTYPE_ENV = "LIGHTNING_SPARSE_WSE_INFERENCE_DTYPE"
"""Environment variable: the `WSEExecutor` ``inference_dtype`` default ("float32", "bfloat16")."""
_INFERENCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class WSELinear(nn.Linear):
    """`nn.Linear` whose masked weight runs in CSR. Made by `install_executor`, never directly.

    In compact training (`compact.py`) its ``weight`` holds no values between steps; its state
    dict still holds the dense weight, and loading one turns the layer dense first. A layer
    built sparse (`materialize`), whose dense weight the model may not hold, writes its weight
    as a PyTorch sparse CSR tensor (int32 indices, its kept values) and loads one in place,
    compact (`LayerState.load_csr`); a dense weight loads into it as into any compact layer.
    """

    loads_sparse_csr = True  # a sparse CSR weight in a state dict loads here (`load_csr`)

    def forward(self, input: Tensor) -> Tensor:
        fast = self.__dict__.get(FAST)  # the decode fast path, without a registry lookup
        if fast is not None and not torch.is_grad_enabled():
            y = fast(self, input)
            if y is not None:
                return y
        y = _execute(self, input)
        return F.linear(input, self.weight, self.bias) if y is None else y

    def __getstate__(self) -> dict[str, Any]:
        return without_fast(self.__dict__)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        state = STATE.get(self)
        if state is not None and state.compact is not None:
            compact = state.compact
            destination[prefix + "weight"] = (
                compact.csr.as_torch_csr(compact.values.detach())
                if state.built_sparse
                else compact.dense_weight()
            )

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        state = STATE.get(self)
        incoming = state_dict.get(prefix + "weight")
        if torch.is_tensor(incoming) and incoming.layout == torch.sparse_csr:
            if state is None or not state.built_sparse or state.compact is None:
                state_dict = {**state_dict, prefix + "weight": incoming.to_dense()}
            else:
                try:
                    state.load_csr(self, incoming)
                except ValueError as err:
                    error_msgs.append(f"While loading {prefix}weight: {err}")
                    return
                rest = {k: v for k, v in state_dict.items() if k != prefix + "weight"}
                super()._load_from_state_dict(
                    rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                    error_msgs,
                )  # fmt: skip
                missing_keys[:] = [k for k in missing_keys if k != prefix + "weight"]
                return
        if state is not None and state.compact is not None:
            state.decompact()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def _execute(module: nn.Module, x: Tensor) -> Tensor | None:
    """``module``'s output ``[..., out]`` on the device, or None where no executor runs it."""
    state = STATE.get(module)
    if state is None:
        return None
    return state.run(module, x)


# Hugging Face Conv1D class -> its device subclass.
_WSE_CONV1D: dict[type[nn.Module], type[nn.Module]] = {}


def _wse_conv1d_class(base: type[nn.Module]) -> type[nn.Module]:
    """The device subclass of an HF ``Conv1D`` class (made once): same name and module, its
    ``forward`` runs `_execute`; pickled and copied as ``base``, so copies carry no executor."""
    cls = _WSE_CONV1D.get(base)
    if cls is None:

        def forward(self: nn.Module, input: Tensor) -> Tensor:
            fast = self.__dict__.get(FAST)
            if fast is not None and not torch.is_grad_enabled():
                y = fast(self, input)
                if y is not None:
                    return y
            y = _execute(self, input)
            return base.forward(self, input) if y is None else y

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            # (rebuild, (cls, ...), state, ...)
            rv = super(_WSE_CONV1D[base], self).__reduce_ex__(protocol)
            state = without_fast(rv[2]) if isinstance(rv[2], dict) else rv[2]
            # copyreg._reconstructor (object.__reduce_ex__ returns it) is private: not in typeshed.
            rebuild = copyreg._reconstructor  # type: ignore[attr-defined]
            return (rebuild, (base, object, None), state, *rv[3:])

        namespace: dict[str, Any] = {"forward": forward, "__reduce_ex__": __reduce_ex__}
        namespace.update(__module__=base.__module__, __qualname__=base.__qualname__)
        cls = _WSE_CONV1D[base] = type(base.__name__, (base,), namespace)
    return cls


def _on_device(module: nn.Module) -> bool:
    """Whether ``module``'s class is one the executor runs (`WSELinear`, a device Conv1D)."""
    return type(module) is WSELinear or type(module) in _WSE_CONV1D.values()


class WSEExecutor:
    """The executor installed on one model: its layers, statistics and kernel path.

    Args:
        root: the model (a layer's algorithms are those that own its weight, `applied.owners`).
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
        accumulate_grad_batches: backwards per optimizer step. With 1 (default), a compact
            layer keeps of a RigL/GraNet update step's dense gradient only what the update reads
            (`compact.grow_candidates`), and a second backward before the step is an error;
            above 1 it keeps the whole dense gradient, accumulated.
    """

    def __init__(
        self,
        root: nn.Module,
        stats: WSEStats,
        path: str | None,
        inference_dtype: str | None = None,
        optimizers: Callable[[], Sequence[torch.optim.Optimizer]] | None = None,
        accumulate_grad_batches: int = 1,
    ) -> None:
        if accumulate_grad_batches < 1:
            raise ValueError(
                f"accumulate_grad_batches must be an int >= 1, got {accumulate_grad_batches!r}"
            )
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
        self.accumulate_grad_batches = accumulate_grad_batches

    @property
    def layers(self) -> list[nn.Module]:
        """The `WSELinear` and Conv1D modules this executor runs."""
        return [m for m in self._layers if _owner(m) is self]

    def settle(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """After an optimizer step nothing of a weight's size is held: a dense gradient no mask
        update read (an update the step skipped) is dropped, and layers that could not train
        compact before (a mask registered since) go compact."""
        if self.compact is None:
            return
        for module in self.layers:
            state = STATE[module]
            mask = module._buffers.get(MASK)
            if state.compact is not None:
                state.compact.weight.grad, state.candidates = None, None
            elif mask is not None:
                state.try_compact(module, mask)

    def dense_grads(self) -> dict[str, Tensor]:
        """``{name: dense gradient}`` of every compact layer's weight that has a gradient, as
        the cpu path holds it (``[out, in]``, zeros at pruned positions, or the whole dense
        gradient before a RigL/GraNet update reads it; a new tensor); names
        as ``root.named_parameters()`` gives them. For inspecting a compact run."""
        root = self._root()
        out: dict[str, Tensor] = {}
        for name, module in [] if root is None else root.named_modules():
            state = STATE.get(module)
            if state is None or state.compact is None:
                continue
            compact = state.compact
            key = f"{name}.weight" if name else "weight"
            grad = state.dense_grad()  # a RigL/GraNet update step's (see `LayerState.dense_grad`)
            if grad is not None:
                out[key] = grad.clone() if state.candidates is None else grad
            elif compact.values.grad is not None:
                out[key] = compact.csr.to_dense(compact.values.grad)
        return out

    def remove(self) -> None:
        """Give every layer back its `nn.Linear` / ``Conv1D`` class (compact layers' weights
        dense again, `compact.release`: the optimizers keep the kept values and their state
        until their next ``step()`` or ``load_state_dict``, when the weights take their place
        back with dense state, so no dense optimizer state is allocated when training ends) and
        drop the cached CSR structures. A layer built sparse (`materialize`) stays on the
        device, compact: its dense weight was never in memory and may not fit; the next
        executor installed on the model takes it over."""
        if self.compact is not None:
            self.compact.release()
        for module in list(self._layers):
            if _owner(module) is self:
                if _stays(module):
                    continue
                STATE.pop(module).fast = None
                base = type(module).__base__  # nn.Linear, or the HF Conv1D class
                if _on_device(module) and base is not None and issubclass(base, nn.Module):
                    module.__class__ = base
        self._layers = weakref.WeakSet()
        for handle in list(self._dense_hooks.values()):
            handle.remove()
        self._dense_hooks = weakref.WeakKeyDictionary()

    def owners_of(self, module: nn.Module) -> list[SparsityAlgorithm]:
        """Algorithms that sparsify ``module.weight`` (read at each structure rebuild), whether
        applied to this executor's model or to a model that contains it."""
        return applied.owners(module, "weight")

    def check_fallbacks(self) -> None:
        """Warn once per masked module that runs dense because it is not an `nn.Linear` or an
        HF ``Conv1D``."""
        root = self._root()
        if root is None:
            return
        for name, module in root.named_modules():
            if _on_device(module) and _owner(module) is self:
                masks = [k for k in module._buffers if k.endswith("_mask") and k != MASK]
                masks = [k for k in masks if k[: -len("_mask")] != "bias"]
            else:
                params = set(module._parameters)
                masks = [k for k in module._buffers if k.endswith("_mask") and k[:-5] in params]
            if not masks:
                continue
            counted = isinstance(module, nn.Conv2d)
            if counted and module not in self._dense_hooks:
                self._dense_hooks[module] = module.register_forward_hook(DenseCounter(self))
            warn_once(
                module,
                f"lightning_sparse.wse: {name or type(module).__name__!r} "
                f"({type(module).__name__}) has masks {masks} but the WSE runs only "
                "nn.Linear and Conv1D weights in CSR; it runs dense on its pruned weights (same "
                "numbers as masked dense training, dense FLOPs"
                + (": its FLOP statistics count it as dense, no saving)." if counted else ")."),
            )

    def __repr__(self) -> str:
        return f"WSEExecutor(layers={len(self.layers)}, path={self.path!r})"


def install_executor(
    model: nn.Module,
    *,
    stats: WSEStats | None = None,
    path: str | None = None,
    inference_dtype: str | None = None,
    optimizers: Callable[[], Sequence[torch.optim.Optimizer]] | None = None,
    accumulate_grad_batches: int = 1,
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
        accumulate_grad_batches: backwards per optimizer step (see `WSEExecutor`).

    Returns:
        The executor; ``executor.remove()`` undoes the installation.

    Raises:
        ValueError: on an unknown ``path`` or ``inference_dtype``.
        RuntimeError: a layer of ``model`` trains compact under another executor.
    """
    compact = [
        n
        for n, m in model.named_modules()
        if getattr(STATE.get(m), "compact", None) and not _stays(m)
    ]
    if compact:
        raise RuntimeError(
            f"{compact[0] or '<model>'!r} trains compact under another executor (its weight holds "
            "no values); remove that executor (leave its on_wse block) before installing another"
        )
    executor = WSEExecutor(
        model, stats if stats is not None else WSEStats(), path, inference_dtype, optimizers,
        accumulate_grad_batches,
    )  # fmt: skip
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = WSELinear
        elif is_hf_conv1d(module) and not _on_device(module):
            module.__class__ = _wse_conv1d_class(type(module))
        if _on_device(module):
            old = STATE.get(module)
            if old is not None:  # taken over from another executor
                old.fast = None
            if old is not None and _stays(module):
                _take_over(executor, old)
            else:
                STATE[module] = LayerState(executor, name, module, in_out=is_hf_conv1d(module))
            executor._layers.add(module)
    executor.check_fallbacks()
    return executor


def _stays(module: nn.Module) -> bool:
    """Whether ``module`` is a compact layer built sparse (it stays on the device)."""
    state = STATE.get(module)
    return state is not None and state.built_sparse and state.compact is not None


def _take_over(executor: WSEExecutor, state: LayerState) -> None:
    """A layer built sparse, left compact by an executor removed before, runs under
    ``executor``: its optimizer, if still alive, is hooked by ``executor``'s compact layers."""
    state.executor = executor
    compact = state.compact
    optimizer = None if compact is None else compact.optimizer()
    if executor.compact is not None and optimizer is not None:
        executor.compact.add(state, optimizer)


@contextmanager
def on_wse(
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    accumulate_grad_batches: int = 1,
    stats: WSEStats | None = None,
    path: str | None = None,
    inference_dtype: str | None = None,
    init: Init | None = None,
) -> Iterator[WSEExecutor]:
    """``with on_wse(model) as executor:`` runs ``model`` on the device inside the block.

    With ``optimizer``, the block trains compact, as ``Trainer(accelerator="wse")`` does (the
    same `install_executor` and `compact.py`, without Lightning): every masked `nn.Linear` whose
    live algorithm keeps its pruned entries at 0 trains its kept values only. At its first
    training forward its weight, gradient and optimizer state move to ``[nnz]`` tensors and the
    values take the weight's place in ``optimizer``; mask updates (the algorithm's step hooks)
    rebuild them. Leaving the block gives the model its dense weights; ``optimizer`` keeps the
    kept values and their state (no dense state is allocated) until its next ``step()`` or
    ``load_state_dict``, which give it the weights and dense state back (zeros at pruned
    positions), so training may go on without the device; its ``state_dict()`` has the cpu
    format throughout.
    ``accumulate_grad_batches``: backwards per optimizer step (see `WSEExecutor`; a RigL/GraNet
    update step with more backwards than declared is an error, not a wrong mask). ``stats``,
    ``path``, ``inference_dtype``: as `install_executor`.
    ``init``: for a model built on the meta device (``with torch.device("meta")``) and applied
    to there: ``init(name, tensor)`` fills one parameter or buffer (``Llama.init_tensor``). The
    model is made on the CPU one module at a time, each masked layer compact as soon as it is
    made, so no dense weight of the whole model ever exists (`materialize`); it equals a dense
    build with the same ``init`` (``named_parameters`` order), pruned and made compact. Such a
    model stays compact when the block is left (its dense weights may not fit): its state dict
    holds sparse CSR weights, and the next `on_wse` takes its layers over.

    Example (plain PyTorch, compact training)::

        sparsity = RigL(0.9, update={"freq": 100})
        model.apply(sparsity)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sparsity.apply(optimizer)
        with on_wse(model, optimizer=optimizer):
            for x, y in data:
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

    Example (inference from a sparse checkpoint without its algorithm)::

        register_masks(lit, checkpoint)  # the masks of the sparsity callback's state
        lit.load_state_dict(checkpoint["state_dict"])
        with on_wse(lit):
            tokens = lit.model.generate(prompt, max_new_tokens=32, temperature=0)

    Raises:
        TypeError: ``optimizer`` is not an optimizer, or is not elementwise
            (`compact.ELEMENTWISE`: stepping kept values must equal stepping the masked weight).
        ValueError: a masked weight of ``model`` is not stepped by exactly one of the optimizers
            (or none of their parameters is ``model``'s).
        RuntimeError: ``model`` already runs on the device (a second `on_wse` or
            `install_executor` on it).
        All before anything is modified.
    """
    optimizers = None
    if optimizer is not None:
        optimizers = (
            [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        )
        check_compact_training(model, optimizers)
    executor = install_executor(
        model,
        stats=stats,
        path=path,
        inference_dtype=inference_dtype,
        optimizers=None if optimizers is None else (lambda: optimizers),
        accumulate_grad_batches=accumulate_grad_batches,
    )
    try:
        if init is not None:
            materialize(model, init, optimizers or [])
        yield executor
    finally:
        executor.remove()


def check_compact_training(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise unless ``optimizers`` can train ``model``'s masked layers compact (`on_wse`).

    Raises:
        TypeError: an entry is not an elementwise optimizer (`compact.ELEMENTWISE`).
        ValueError: no optimizer, none of their parameters is ``model``'s, or a masked trainable
            `nn.Linear` weight is stepped by none (or more than one place) of them.
        RuntimeError: ``model`` already runs on the device.
    """
    if not optimizers:
        raise ValueError("on_wse(optimizer=...) needs at least one optimizer; got an empty list")
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"on_wse(optimizer=...) takes torch.optim optimizers, got {type(opt).__name__}"
            )
        if type(opt) not in ELEMENTWISE:
            names = ", ".join(t.__name__ for t in ELEMENTWISE)
            raise TypeError(
                f"on_wse(optimizer=...) trains kept values only, which equals masked dense "
                f"training only for optimizers whose update is elementwise per parameter "
                f"({names}); got {type(opt).__name__}. Use one of those, or on_wse(model) "
                "without optimizer= to train the dense weights on the device"
            )
    on_device = [
        name for name, m in model.named_modules() if _owner(m) is not None and not _stays(m)
    ]
    if on_device:
        raise RuntimeError(
            f"the model already runs on the device (layer {on_device[0] or '<model>'!r}): "
            "on_wse / install_executor was called on it twice; leave the first on_wse block "
            "(or call its executor's remove()) first"
        )
    mine = {id(p) for p in model.parameters()}
    stepped = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    if not any(id(p) in mine for p in stepped):
        raise ValueError(
            "none of the optimizer's parameters belongs to the model passed to on_wse; pass the "
            "optimizer built from model.parameters()"
        )
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        # Only nn.Linear layers train compact (an HF Conv1D keeps the dense state).
        if type(module) is not nn.Linear or MASK not in module._buffers or weight is None:
            continue
        count = sum(p is weight for p in stepped)
        if weight.requires_grad and count != 1:
            raise ValueError(
                f"{name + '.weight' if name else 'weight'!r} is masked and trainable but the "
                f"optimizer steps it {count} times; compact training replaces it by its kept "
                "values in the one param group that holds it: put it in exactly one"
            )


register_masks = restore_masks
"""Alias of `lightning_sparse.core.state_dict.restore_masks` (its older name here; `core.legacy`:
removed in 0.3.0)."""


def _owner(module: nn.Module) -> WSEExecutor | None:
    executor = None if (state := STATE.get(module)) is None else state.executor
    return executor if isinstance(executor, WSEExecutor) else None
