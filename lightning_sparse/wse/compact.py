"""Compact training state: a masked layer's kept values are the parameter its optimizer steps.

On the device a masked `nn.Linear` owned by a live sparsity algorithm trains in one of two forms:

- **compact** (every step, mask updates included): the kept values ``[nnz]`` (CSR order of
  the mask) are an `nn.Parameter` that takes the weight's place in its optimizer's param group;
  the value gradient and the optimizer state (Adam's moments, SGD's momentum, ...) are ``[nnz]``
  too. The layer's ``weight`` parameter stays registered (same object, so the algorithm's
  references, hooks and the state-dict keys stay) but holds no values: a one-element NaN storage
  expanded to ``[out, in]``, so a stray read shows NaN and a stray write is an error. Nothing of
  the weight's size is held between steps. The layer is the weight's holder (`core.held`): a
  mask update reads a dense copy of one weight at a time from it, and pruning after the update
  makes it `rebuild` its values, gradient and moments under the new mask, as the cpu path's
  pruning leaves them (kept weights keep their moments, grown ones start at zero with zero
  moments). On a step whose update reads the dense gradient (RigL, GraNet) the backward also
  gives the weight parameter the dense ``[out, in]`` gradient, produced per layer; the update
  reads it and the step drops it.
- **dense** (whenever compact training does not apply: another optimizer, a dtype or device the
  kernels do not run, no live algorithm): exactly the masked dense state of
  ``accelerator="cpu"``.

`to_compact` gathers weight, gradient and every weight-shaped optimizer state tensor at the kept
positions and swaps the parameter in the optimizer; `to_dense` scatters them back. Both are all
or nothing: every new tensor is built before anything is swapped. Pruned positions hold exact
zeros in the dense form (the per-step path keeps them so), so a round trip loses nothing.

Checkpoints keep the cpu format: `WSELinear`'s state dict holds the dense weight, the
optimizer's state dict (`CompactLayers`) the dense moments; loading either turns the layers
dense first (the loaded tensors then land in the ordinary places). A layer built sparse
(`wse.materialize`), whose dense form the model may not hold, is the exception: its weight is
written as a sparse CSR tensor, its moments stay ``[nnz]``, both load compact, and it stays
compact when the device is removed.

Only optimizers whose update is elementwise per parameter qualify (`ELEMENTWISE`): for them
stepping the kept values equals stepping the masked dense weight. Others (Adafactor's factored
moments, LBFGS, Muon) keep the layer dense.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_sparse.core import held
from lightning_sparse.core.mask_ops import topk_mask
from lightning_sparse.wse.csr import CSRWeight

__all__ = [
    "ELEMENTWISE",
    "adopt",
    "CompactLayers",
    "CompactState",
    "find_slot",
    "grow_candidates",
    "park",
    "qualifies",
    "rebuild",
    "release",
    "to_compact",
    "to_dense",
    "with_candidates",
]

ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD", "Adam", "AdamW", "NAdam", "RAdam", "Adagrad", "Adadelta", "ASGD", "RMSprop",
        "Adamax", "Rprop",
    )
    if hasattr(torch.optim, name)
)  # fmt: skip
"""Optimizer types (exact) whose step is elementwise per parameter tensor."""


def qualifies(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can step a layer's kept values in place of its weight."""
    return type(optimizer) in ELEMENTWISE


class CompactState:
    """One layer in compact form.

    Attributes:
        weight: the layer's weight parameter (the dense handle; holds no values meanwhile).
        values: the kept values ``[nnz]``, the parameter the optimizer steps.
        csr: the structure the values follow.
        optimizer: the optimizer holding ``values`` (weakly); returns None while the layer is
            parked (`park`: built sparse before its optimizer existed).
    """

    __slots__ = ("csr", "optimizer", "values", "weight")

    def __init__(
        self,
        weight: nn.Parameter,
        values: nn.Parameter,
        csr: CSRWeight,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.weight, self.values, self.csr = weight, values, csr
        self.optimizer: Callable[[], torch.optim.Optimizer | None] = (
            _no_optimizer if optimizer is None else weakref.ref(optimizer)
        )

    @property
    def parked(self) -> bool:
        """Whether no optimizer has held the values yet (`park`)."""
        return self.optimizer is _no_optimizer

    def dense_weight(self) -> Tensor:
        """The dense ``[out, in]`` weight (a new tensor; zeros at pruned positions)."""
        return self.csr.to_dense(self.values.detach())

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``values``, ``grad``, ``state`` (optimizer) and ``indices``."""
        optimizer = self.optimizer()
        state = optimizer.state.get(self.values, {}) if optimizer is not None else {}
        grad = self.values.grad
        return {
            "values": self.values.nbytes,
            "grad": 0 if grad is None else grad.nbytes,
            "state": sum(v.nbytes for v in state.values() if torch.is_tensor(v)),
            "indices": self.csr.nbytes,
        }


def find_slot(
    optimizers: Iterable[torch.optim.Optimizer], param: Tensor
) -> tuple[torch.optim.Optimizer, dict[str, Any], int] | None:
    """(optimizer, param group, index in its ``params``) of ``param``: the only place it is
    stepped, or None if no optimizer (or more than one place) holds it."""
    found = [
        (optimizer, group, i)
        for optimizer in optimizers
        for group in optimizer.param_groups
        for i, p in enumerate(group["params"])
        if p is param
    ]
    return found[0] if len(found) == 1 else None


def _placeholder(weight: Tensor) -> Tensor:
    """One NaN element expanded to ``weight``'s shape: no storage of the weight's size."""
    return torch.full((), float("nan"), dtype=weight.dtype, device=weight.device).expand(
        weight.shape
    )


def is_placeholder(weight: Tensor) -> bool:
    """Whether ``weight`` currently holds no values (a compact layer's dense handle)."""
    return weight.dim() > 0 and weight.numel() > 1 and all(s == 0 for s in weight.stride())


def to_compact(
    weight: nn.Parameter,
    csr: CSRWeight,
    slot: tuple[torch.optim.Optimizer, dict[str, Any], int],
) -> CompactState:
    """Move ``weight`` (dense, pruned) into compact form under ``csr``: its kept values,
    gradient and weight-shaped optimizer state are gathered, the values take its place in the
    optimizer, and the weight is emptied.

    Positions ``csr`` drops (a mask that changed since the weight was pruned) are dropped with
    their gradient and moments, as the cpu path's pruning zeroes them.
    """
    optimizer, group, index = slot
    with torch.no_grad():
        values = nn.Parameter(csr.gather_values(weight.detach()), requires_grad=True)
        grad = None if weight.grad is None else csr.gather_values(weight.grad)
        old = optimizer.state.get(weight)
        state = None if old is None else _moved(old, weight.shape, csr.gather_values)
    # Commit: nothing below allocates a tensor of the weight's size or can fail halfway.
    _take_place(optimizer, group, index, weight, values, grad, state)
    weight.grad = None
    weight.data = _placeholder(weight)
    return CompactState(weight, values, csr, optimizer)


def park(weight: nn.Parameter, csr: CSRWeight) -> CompactState:
    """``weight`` (dense, pruned) in compact form before any optimizer holds it (a model built
    sparse under Lightning, whose optimizers come after the model is made): its kept values
    become a parameter no optimizer steps yet and the weight is emptied; `adopt` puts the values
    in the optimizer that holds the weight."""
    with torch.no_grad():
        values = nn.Parameter(csr.gather_values(weight.detach()), requires_grad=True)
    weight.grad = None
    weight.data = _placeholder(weight)
    return CompactState(weight, values, csr, None)


def adopt(compact: CompactState, slot: tuple[torch.optim.Optimizer, dict[str, Any], int]) -> None:
    """A parked layer (`park`) found its optimizer: the values take the weight's place at
    ``slot``, with any state the weight has there gathered at the kept positions."""
    optimizer, group, index = slot
    weight = compact.weight
    old = optimizer.state.get(weight)
    with torch.no_grad():
        state = None if old is None else _moved(old, weight.shape, compact.csr.gather_values)
    _take_place(optimizer, group, index, weight, compact.values, compact.values.grad, state)
    compact.optimizer = weakref.ref(optimizer)


def _no_optimizer() -> None:
    """A parked layer's optimizer: none yet."""


def to_dense(compact: CompactState) -> None:
    """Undo `to_compact`: the weight, its gradient and its optimizer state become dense again
    (zeros at pruned positions) and the weight takes the values' place in the optimizer."""
    weight, values, csr = compact.weight, compact.values, compact.csr
    optimizer = compact.optimizer()
    with torch.no_grad():
        dense = csr.to_dense(values.detach())
        grad = None if values.grad is None else csr.to_dense(values.grad)
        old = None if optimizer is None else optimizer.state.get(values)
        state = None if old is None else _moved(old, values.shape, csr.to_dense)
    weight.data = dense
    weight.grad = grad
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if p is values:
                group["params"][i] = weight
    if old is not None:
        del optimizer.state[values]
        optimizer.state[weight] = state


def _take_place(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    index: int,
    old: Tensor,
    values: nn.Parameter,
    grad: Tensor | None,
    state: dict[str, Any] | None,
) -> None:
    """``values`` (with ``grad``) takes ``old``'s place at ``group["params"][index]``, and
    ``state`` (None: ``old`` had none) its optimizer state. Allocates nothing, cannot fail."""
    values.grad = grad
    group["params"][index] = values
    if state is not None:
        del optimizer.state[old]
        optimizer.state[values] = state


def rebuild(
    compact: CompactState,
    csr: CSRWeight,
    grad: Tensor | None = None,
    candidates: tuple[Tensor, Tensor] | None = None,
) -> CompactState | None:
    """The layer's mask changed to ``csr``'s (a mask update): its values, gradient and
    optimizer state under the new structure, exactly as the cpu path prunes them. Kept weights
    keep their values and moments; grown ones start at zero with zero moments; the gradient is
    ``grad`` (the dense ``[out, in]`` gradient of this step, RigL's under accumulation) at the
    kept positions, or the old value gradient's where kept and ``candidates``' (`grow_candidates`)
    or zero where grown. Compact to compact: each ``[nnz]`` tensor is moved through the map from
    new to old positions (both CSR orders are ascending flat positions), nothing of the
    weight's size is made (but ``grad``'s gather). The old compact state is spent; the returned
    one replaces it (None: the optimizer is gone, the layer goes dense, pruned); a parked
    layer's (`park`) stays parked, its values moved.
    """
    if compact.parked:  # only the values move
        with torch.no_grad():
            values = nn.Parameter(
                _mover(compact.csr.flat_indices(), csr.flat_indices())(compact.values.detach()),
                requires_grad=True,
            )
        return CompactState(compact.weight, values, csr, None)
    optimizer = compact.optimizer()
    slot = None if optimizer is None else find_slot([optimizer], compact.values)
    if slot is None:
        to_dense(compact)
        weight = compact.weight
        with torch.no_grad():
            weight.data = csr.to_dense(csr.gather_values(weight.detach()))
        return None
    optimizer, group, index = slot
    new_flat = csr.flat_indices()
    move = _mover(compact.csr.flat_indices(), new_flat)
    old, old_grad = compact.values, compact.values.grad
    with torch.no_grad():
        values = nn.Parameter(move(old.detach()), requires_grad=True)
        if grad is not None:
            new_grad: Tensor | None = csr.gather_values(grad)
        elif old_grad is None and candidates is None:
            new_grad = None
        else:
            new_grad = values.new_zeros(csr.nnz) if old_grad is None else move(old_grad)
            if candidates is not None:
                new_grad = _merge_candidates(new_grad, new_flat, candidates)
        state = optimizer.state.get(old)
        moved = None if state is None else _moved(state, old.shape, move)
    # Commit: nothing below allocates or can fail halfway.
    _take_place(optimizer, group, index, old, values, new_grad, moved)
    # The spent values may outlive this (a graph kept after its backward holds its leaves): let
    # them hold nothing.
    old.grad = None
    old.data = old.data.new_empty(0)
    return CompactState(compact.weight, values, csr, optimizer)


def _mover(old_flat: Tensor, new_flat: Tensor) -> Callable[[Tensor], Tensor]:
    """``t [nnz_old] -> [nnz_new]``: ``t`` at the positions both structures keep, 0 at the new
    ones (``old_flat``, ``new_flat``: ascending flat positions)."""
    if old_flat.numel() == 0:
        return lambda t: t.new_zeros(new_flat.numel())
    where = torch.searchsorted(old_flat, new_flat).clamp_(max=old_flat.numel() - 1)
    fresh = old_flat.index_select(0, where) != new_flat
    return lambda t: t.index_select(0, where).masked_fill_(fresh, 0)


def _merge_candidates(grad: Tensor, new_flat: Tensor, candidates: tuple[Tensor, Tensor]) -> Tensor:
    """``grad [nnz_new]`` with the grow candidates' gradient at the new positions they hold."""
    index, values = candidates
    if index.numel() == 0:
        return grad
    index = index.long()  # ascending (a mask's nonzero positions)
    where = torch.searchsorted(index, new_flat).clamp_(max=index.numel() - 1)
    hit = index.index_select(0, where) == new_flat
    return torch.where(hit, values.index_select(0, where), grad)


def grow_candidates(grad: Tensor, csr: CSRWeight, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` positions outside ``csr``'s mask with the largest ``|grad|``, ties to the
    lower index, and the gradient there: what a RigL/GraNet update reads of the dense gradient
    outside the mask (`DropAndGrow.grow_candidates`), kept in place of it.

    Non-finite entries outside the mask count, and are kept, as 0: the cpu path's gradient hook
    zeroes them before the update. Any other position outside the mask ranks after all of
    these, so an update that grows at most ``count`` of them by ``|grad|`` grows the same ones
    from a gradient that is zero there.

    Args:
        grad: the dense gradient ``[out, in]`` (a transient of the backward).
        csr: the layer's structure (its kept positions are excluded).
        count: how many, at most the positions outside the mask.

    Returns:
        ``(index, values)``: flat positions ``row * in + col`` (int32 where they fit, else
        int64) and the gradient there, ``[count]`` each.
    """
    flat = grad.reshape(-1)
    score = flat.abs()
    score.masked_fill_(~score.isfinite(), 0.0)
    score.index_fill_(0, csr.flat_indices(), -1.0)  # kept: below every candidate (all >= 0)
    # The core's selection (ties to the lower index; on the CPU a sample-narrowed threshold,
    # not a top-k over every weight).
    index = topk_mask(score.view(1, -1), max(count, 0)).view(-1).nonzero().squeeze(1)
    values = flat.index_select(0, index)
    values.masked_fill_(~values.isfinite(), 0.0)
    if flat.numel() <= torch.iinfo(torch.int32).max:
        index = index.to(torch.int32)
    return index, values


def with_candidates(dense: Tensor, candidates: tuple[Tensor, Tensor]) -> Tensor:
    """``dense`` (``[out, in]``, the kept positions' gradient) with `grow_candidates`' gradient
    written at its positions, in place."""
    index, values = candidates
    dense.view(-1).index_copy_(0, index.long(), values)
    return dense


def release(compact: CompactState) -> None:
    """End of training (the executor's removal): the weight holds its dense values again, so the
    model is an ordinary model, and its gradient is dropped. The optimizer keeps the kept values
    and their state, so no dense optimizer state is allocated at the end of a fit; its
    ``state_dict()`` still gives the cpu format (`CompactLayers`)."""
    with torch.no_grad():
        compact.weight.data = compact.csr.to_dense(compact.values.detach())
    compact.weight.grad = None
    held.release(compact.weight)


def _moved(state: dict[str, Any], shape: torch.Size, move: Any) -> dict[str, Any]:
    """``state`` with every tensor of ``shape`` passed through ``move``; the rest (``step``,
    scalars) as they are."""
    return {k: move(v) if torch.is_tensor(v) and v.shape == shape else v for k, v in state.items()}


class Layer(Protocol):
    """What `CompactLayers` needs of a device layer (the executor's per-layer state)."""

    compact: CompactState | None
    built_sparse: bool

    def decompact(self) -> None: ...


class CompactLayers:
    """The compact layers of one executor and the hooks on their optimizers.

    Per optimizer holding compact values (registered at its first compaction): its
    ``state_dict()`` returns the dense moments (the cpu format), ``load_state_dict`` turns its
    layers dense first, after each ``step()`` ``settle(optimizer)`` runs (layers that trained
    dense through a mask update go compact again at once), and a ``step()`` after the layers
    were released (the device removed) gives it the weights back first.

    Args:
        optimizers: the optimizers a layer's weight may be found in (read when compacting).
        settle: called after each step of a hooked optimizer.
    """

    def __init__(
        self,
        optimizers: Callable[[], Sequence[torch.optim.Optimizer]],
        settle: Callable[[torch.optim.Optimizer], None],
    ) -> None:
        self.optimizers = optimizers
        self._settle = settle
        self.layers: dict[int, Layer] = {}  # id(values) -> layer, while compact
        # id(values) -> compact form released at the end of training (`release`): the
        # optimizer still steps the values.
        self.released: dict[int, CompactState] = {}
        self._hooks: dict[int, list[RemovableHandle]] = {}

    def add(self, layer: Layer, optimizer: torch.optim.Optimizer) -> None:
        """``layer`` went compact in ``optimizer``."""
        assert layer.compact is not None
        self.layers[id(layer.compact.values)] = layer
        if id(optimizer) not in self._hooks:
            self._hooks[id(optimizer)] = [
                optimizer.register_state_dict_post_hook(self._dense_state_dict),
                optimizer.register_load_state_dict_pre_hook(self._before_load),
                optimizer.register_step_pre_hook(self._before_step),
                optimizer.register_step_post_hook(self._after_step),
            ]

    def discard(self, compact: CompactState) -> None:
        """A layer went dense."""
        self.layers.pop(id(compact.values), None)

    def of(self, optimizer: torch.optim.Optimizer) -> list[Layer]:
        """The compact layers stepped by ``optimizer``."""
        return [
            layer
            for layer in self.layers.values()
            if layer.compact is not None and layer.compact.optimizer() is optimizer
        ]

    def memory(self) -> dict[str, int]:
        """Bytes the compact layers hold now, by kind (`CompactState.nbytes`)."""
        total = {"values": 0, "grad": 0, "state": 0, "indices": 0}
        for layer in self.layers.values():
            if layer.compact is not None:
                for key, value in layer.compact.nbytes().items():
                    total[key] += value
        return total

    def release(self) -> None:
        """End of training on the device: every compact layer's weight dense again (`release`);
        the optimizers keep the values (no dense state is allocated) until they are stepped or
        loaded again, when the weights take their place back (`_reclaim`); their hooks stay for
        ``state_dict`` / ``load_state_dict`` / ``step``."""
        for key, layer in list(self.layers.items()):
            compact = layer.compact
            if layer.built_sparse:  # stays compact: the model never held its dense weight
                continue
            if compact is not None:
                release(compact)
                self.released[key] = compact
                layer.compact = None
        self.layers = {}

    def _dense_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """Optimizer state-dict post-hook: each compact layer's state as the cpu path holds it
        (weight-shaped, zeros at pruned positions), so checkpoints keep the cpu format; a layer
        built sparse keeps its ``[nnz]`` state (its dense form may not fit)."""
        state = state_dict["state"]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            compact = self._compact_of(param)
            layer = self.layers.get(id(param))
            if layer is not None and layer.built_sparse:  # kept [nnz]: it may not fit dense
                continue
            if compact is not None and index in state:
                state[index] = _moved(state[index], compact.values.shape, compact.csr.to_dense)
        return state_dict

    def _compact_of(self, param: Tensor) -> CompactState | None:
        layer = self.layers.get(id(param))
        compact = layer.compact if layer is not None else self.released.get(id(param))
        return compact if compact is not None and compact.values is param else None

    def _before_load(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Optimizer load pre-hook: the layers dense, so the (dense) state loads as on the cpu;
        released layers' weights take their values' place again."""
        for layer in self.of(optimizer):
            if not layer.built_sparse:  # a layer built sparse loads its [nnz] state as it is
                layer.decompact()
        self._reclaim(optimizer)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: an optimizer stepped after the device was removed (training
        goes on without it) steps the released layers' weights again."""
        self._reclaim(optimizer)

    def _reclaim(self, optimizer: torch.optim.Optimizer) -> None:
        """Each released layer of ``optimizer``: its weight (dense since `release`, with the
        gradient the model gave it since) takes the values' place in the param group, with the
        values' state made dense (zeros at pruned positions), as the cpu path holds it."""
        for key, compact in list(self.released.items()):
            if compact.optimizer() is not optimizer:
                continue
            values, weight = compact.values, compact.weight
            for group in optimizer.param_groups:
                group["params"] = [weight if p is values else p for p in group["params"]]
            state = optimizer.state.pop(values, None)
            if state is not None:
                with torch.no_grad():
                    optimizer.state[weight] = _moved(state, values.shape, compact.csr.to_dense)
            del self.released[key]

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._settle(optimizer)
