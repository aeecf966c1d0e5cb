"""A model built sparse: made from the meta device one module at a time, its masks drawn as made.

Sparse training's memory scales with the kept weights only if the dense weights never exist.
A model built under ``torch.device("meta")`` holds no values; an algorithm applied to it defers
its masks (`SparsityAlgorithm.initial_mask`). `materialize` then walks the model's modules in
``named_modules`` order and, for each module with tensors on the meta device:

1. makes each of its parameters and buffers on ``device`` (a new tensor; the optimizers'
   parameter groups are pointed at the new parameter, a tied parameter is made once);
2. initialises them with ``init(name, tensor)`` (full dotted name), parameters first: the
   order, and so the random draws, of a dense build that runs the same ``init`` over
   ``named_parameters`` (`models.llama.Llama.reset_parameters`);
3. draws the masks of its masked parameters (`SparsityAlgorithm.materialize`: the seed and the
   per-parameter generator of ``apply``, so the masks a dense build gets) and prunes them;
4. tells ``made(module)``: the device (the package's ``wse/materialize.py``) moves each masked
   layer to compact form there, so at most one module's dense weight exists at a time and the
   model never holds more than its unmasked tensors, the masks (one byte per masked weight)
   and the compact layers. Without it (the cpu path) the model ends whole, pruned.

The result equals building dense with the same ``init`` (under ``torch.device("meta")``, then
``to_empty`` and ``init`` over ``named_parameters``) and applying the algorithm:
`tests/wse/test_materialize.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from . import applied
from .algorithms import SparsityAlgorithm
from .sparse_parameter import ever_active_buffer_name, mask_buffer_name

__all__ = ["Init", "materialize", "placeholders_for_meta"]

Init = Callable[[str, Tensor], None]
"""``init(name, tensor)``: fill the parameter or buffer ``name`` (full dotted name) in place."""

Owners = dict[tuple[int, str], list[tuple[SparsityAlgorithm, str]]]


def materialize(
    model: nn.Module,
    init: Init,
    optimizers: Sequence[torch.optim.Optimizer],
    device: torch.device | str = "cpu",
    made: Callable[[nn.Module], None] | None = None,
) -> None:
    """Make every tensor of ``model`` on the meta device real on ``device``, one module at a
    time (module docstring).

    Args:
        model: a model (or part of one) whose parameters and buffers may be on the meta device;
            tensors elsewhere are left as they are.
        init: fills one parameter or buffer in place (``Llama.init_tensor``).
        optimizers: the optimizers holding ``model``'s parameters: each new parameter takes
            the meta one's place in their parameter groups.
        device: where the tensors are made.
        made: called with each module once its tensors are made and its masks drawn.

    Raises:
        ValueError: a mask or ever-active buffer on the meta device that no applied algorithm
            owns (its values could not be drawn); checked before anything is made.
    """
    device = torch.device(device)
    owners = _owners(model)
    _check_masks(model, owners)
    made_params: dict[int, nn.Parameter] = {}  # id of a meta parameter -> its new one (tied)
    for prefix, module in model.named_modules(remove_duplicate=False):
        params = [(k, p) for k, p in module._parameters.items() if p is not None and p.is_meta]
        buffers = [
            k
            for k, b in module._buffers.items()
            if b is not None and b.is_meta and (id(module), _masked_name(k)) not in owners
        ]
        if not params and not buffers:
            continue
        for key, param in params:
            new = made_params.get(id(param))
            if new is None:
                new = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=param.requires_grad,
                )
                init(_join(prefix, key), new)
                _replace_in(optimizers, param, new)
                made_params[id(param)] = new
            module._parameters[key] = new
        for key in buffers:
            buffer = module._buffers[key]
            assert buffer is not None
            module._buffers[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
            init(_join(prefix, key), module._buffers[key])
        for key, _ in params:
            for algorithm, name in owners.get((id(module), key), []):
                algorithm.materialize(name)
        if made is not None:
            made(module)


def _owners(model: nn.Module) -> Owners:
    """``{(id(module), parameter attribute): [(algorithm, full name)]}`` of every algorithm
    applied to ``model`` or to a module inside it."""
    found: Owners = {}
    for module in model.modules():
        for algorithm in applied.algorithms_of(module):
            for name, sp in algorithm.sparse_params.items():
                pairs = found.setdefault((id(sp.module), sp.param_name), [])
                if (algorithm, name) not in pairs:
                    pairs.append((algorithm, name))
    return found


def _check_masks(model: nn.Module, owners: Owners) -> None:
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            attr = _masked_name(key)
            if buffer is not None and buffer.is_meta and attr and (id(module), attr) not in owners:
                raise ValueError(
                    f"{_join(prefix, key)!r} is a mask on the meta device that no applied "
                    "algorithm owns, so its values cannot be drawn; apply the algorithm to the "
                    "model before materializing it (model.apply(sparsity))"
                )


def _masked_name(buffer_key: str) -> str:
    """The parameter attribute a mask or ever-active buffer belongs to ('' for another buffer)."""
    for make in (mask_buffer_name, ever_active_buffer_name):
        suffix = make("")
        if buffer_key.endswith(suffix) and make(buffer_key[: -len(suffix)]) == buffer_key:
            return buffer_key[: -len(suffix)]
    return ""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _replace_in(optimizers: Sequence[torch.optim.Optimizer], old: Tensor, new: Tensor) -> None:
    """``new`` takes ``old``'s place in every parameter group that holds it."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [new if p is old else p for p in group["params"]]


def placeholders_for_meta(model: nn.Module) -> None:
    """Give each tensor of ``model`` still on the meta device a CPU stand-in without storage
    (one zero expanded to its shape): for a model that will never be made (its run failed
    before, a refused configuration), so that moving it (Lightning's teardown calls ``.cpu()``)
    works and the error a user sees is the one that stopped the run. Tied tensors stay tied."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for key, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    stand_in = torch.zeros((), dtype=t.dtype).expand(t.shape)
                    done[id(t)] = (
                        nn.Parameter(stand_in, requires_grad=t.requires_grad)
                        if isinstance(t, nn.Parameter)
                        else stand_in
                    )
                store[key] = done[id(t)]  # type: ignore[assignment]
