"""Applying an algorithm to a model, all or nothing: select, validate everything, then modify.

``apply(model)`` either sparsifies every selected parameter or raises, before the model changed,
naming the parameter, the rule and the fix: parameters that are not floating point, shapes the
shaper cannot structure, init-method masks of the wrong shape, dtype or count, masks already
owned by another algorithm, ``requires_dense`` parameters. Modification registers buffers and
hooks first (undone on failure) and prunes the weights last.

Masks no algorithm owns (restored from a checkpoint by `restore_masks` or the loading mixin, or
carried by a deep copy) are replaced by the new algorithm's initial masks; ``init_method="topk"``
chooses them from the loaded weights, whose pruned positions are zeros.

Frozen parameters (``requires_grad=False``): the default filter leaves them dense (a warning names
them and how to select them);
one selected explicitly keeps a fixed mask: pruned at ``apply``, never updated, still re-pruned
after every load (the PEFT base-weight case).
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import applied
from ..filters import (
    default_sparse_param_filter,
    dense_by_default_ids,
    frozen_left_dense,
    is_dense_by_module,
    unselected_patterns,
)
from ..layouts import is_in_out
from ..rng import generator_for, resolve_seed
from ..selection import Candidate, candidates, tied_parameter_ids
from ..shapers import Shaper
from ..sharding import full, shard_like
from ..sparse_parameter import SparseParameter, mask_buffer_name

if TYPE_CHECKING:
    from .base import SparsityAlgorithm

__all__ = [
    "apply_model", "commit", "is_root_visit", "register", "select", "validate",
]

log = logging.getLogger("lightning_sparse")


def unregister(algorithm: SparsityAlgorithm) -> None:
    """Forget ``algorithm`` in `algorithms_of` (it was removed)."""
    applied.forget(algorithm.root, algorithm)


def is_root_visit() -> bool:
    """Whether the caller's caller is the outermost frame of ``nn.Module.apply``.

    ``model.apply(fn)`` calls ``fn`` on every submodule, root last, and says nothing of which
    call is the root's; the only way to tell is whether ``Module.apply`` called us from inside
    another ``Module.apply`` frame.
    """
    caller = sys._getframe(2)
    if caller.f_code is not nn.Module.apply.__code__:
        return True
    outer = caller.f_back
    return outer is None or outer.f_code is not nn.Module.apply.__code__


def check_shaper(shaper: object) -> Shaper:
    """``shaper`` if it is a `Shaper`, else a TypeError naming it."""
    if not isinstance(shaper, Shaper):
        raise TypeError(
            f"shaper={shaper!r} must be a Shaper such as Unstructured(), NM(2, 4) or "
            "OutputGroups(8) (lightning_sparse.core.shapers)"
        )
    return shaper


def select(algorithm: SparsityAlgorithm, root: nn.Module) -> list[Candidate]:
    """Parameters of ``root`` the algorithm's filter picks, in registration order."""
    tied = tied_parameter_ids(root) | dense_by_default_ids(root)  # heads, PEFT adapters
    chosen, frozen, names = [], [], []
    for candidate in candidates(root):
        names.append(candidate[0])
        if algorithm.param_filter is not None:
            if algorithm.param_filter(candidate[0], candidate[3]):
                chosen.append(candidate)
        elif default_selects(candidate, tied):
            if candidate[3].requires_grad:
                chosen.append(candidate)
            else:
                frozen.append(candidate[0])
    for message in unselected_patterns(algorithm.name, algorithm.param_filter, names):
        warnings.warn(message, stacklevel=4)  # a typo in one glob of a list
    if frozen:
        log.warning(frozen_left_dense(algorithm.name, frozen))
    return chosen


def default_selects(candidate: Candidate, tied: set[int]) -> bool:
    """The default filter: Cerebras' name rule plus module types (embeddings, norms, heads)."""
    name, module, _, param = candidate
    if not default_sparse_param_filter(name, param):
        return False
    module_name = name.rsplit(".", 1)[0] if "." in name else ""
    return not is_dense_by_module(module, module_name, tied, param)


def validate(algorithm: SparsityAlgorithm, chosen: list[Candidate]) -> None:
    """Raise, before anything is modified, if ``chosen`` cannot be sparsified by ``algorithm``."""
    if algorithm.root is not None:
        raise RuntimeError(
            f"{algorithm.name} is already applied to a model; create a new algorithm object per "
            "model (applying twice would stack masks)"
        )
    algorithm.in_out_params = {name for name, module, attr, _ in chosen if is_in_out(module, attr)}
    owned = applied.owned_masks()
    orphans = []
    for name, module, attr, param in chosen:
        buffer = mask_buffer_name(attr)
        if buffer in module._buffers and (id(module), buffer) not in owned:
            orphans.append(name)
        elif buffer in module._buffers:
            raise RuntimeError(
                f"{name!r} already has a mask ({buffer}): it is sparsified by another algorithm; "
                "use one Group to give parameters different algorithms"
            )
        elif hasattr(module, buffer):
            raise RuntimeError(f"{type(module).__name__} already has an attribute {buffer!r}, "
                               f"where the mask of {name!r} would go; rename that attribute")
        if getattr(param, "requires_dense", False):
            raise RuntimeError(f"{name!r} has requires_dense=True and cannot be sparsified")
        if not param.is_floating_point():
            raise TypeError(
                f"{name!r} has dtype {param.dtype}; only floating-point parameters can be "
                "sparsified: exclude it with param_filter"
            )
        if param.ndim < 2 and algorithm.param_filter is not None:
            warnings.warn(f"{algorithm.name}: param_filter selected the {param.ndim}-D parameter "
                          f"{name!r} (a bias or norm scale?); sparsifying it is rarely intended",
                          stacklevel=4)
        in_out = name in algorithm.in_out_params  # HF Conv1D: shaped as [out, in]
        algorithm.shaper.check(param.shape[::-1] if in_out else param.shape, name)
    algorithm.layers.set_shapes({name: param.shape for name, _, _, param in chosen})
    algorithm.check_range(algorithm.horizon())
    if orphans:
        log.info("%s: %d parameter(s) carry masks no algorithm owns (first: %s; restored from a "
                 "checkpoint or copied): replaced by this algorithm's initial masks (%s)",
                 algorithm.name, len(orphans), orphans[0],
                 getattr(algorithm.init_method, "__name__", algorithm.init_method))


def check_mask(mask: object, param: torch.Tensor, name: str, init_method: object) -> torch.Tensor:
    """An init method's output as a bool mask of ``param``'s shape, or an error naming it."""
    if not torch.is_tensor(mask) or tuple(mask.shape) != tuple(param.shape):
        shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(
            f"init_method {getattr(init_method, '__name__', init_method)!r} returned {shape} for "
            f"{name!r} of shape {tuple(param.shape)}; it must return a bool mask of that shape"
        )
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or not bool(((mask == 0) | (mask == 1)).all()):
            raise TypeError(
                f"init_method {getattr(init_method, '__name__', init_method)!r} returned dtype "
                f"{mask.dtype} for {name!r}; return a torch.bool mask (True = kept)"
            )
        mask = mask.to(torch.bool)
    return mask


def initial_mask(algorithm: SparsityAlgorithm, name: str, param: torch.Tensor) -> torch.Tensor:
    """The mask at ``apply``: ``init_method`` at the step-0 target (checked), or all-ones when
    training starts dense (step 0 is not an update step)."""
    if not algorithm.starts_sparse:
        return torch.ones_like(param, dtype=torch.bool)
    generator = generator_for(algorithm.seed, 0, name, param.device)
    dense = full(param.detach())
    in_out = name in algorithm.in_out_params  # GPT-2 Conv1D: shapers see [out, in]
    view = dense.t() if in_out else dense
    target = algorithm.initial_target(name)
    mask = algorithm.init_method(view, target, generator=generator, shaper=algorithm.shaper)
    mask = check_mask(mask, view, name, algorithm.init_method)
    return shard_like(mask.t().contiguous() if in_out else mask, param)


def build_masks(algorithm: SparsityAlgorithm, chosen: list[Candidate]) -> list[torch.Tensor]:
    """Initial masks of ``chosen`` (checked), computed before anything is modified."""
    return algorithm.initial_masks(chosen)


def register(
    algorithm: SparsityAlgorithm,
    root: nn.Module,
    chosen: list[Candidate],
    masks: list[torch.Tensor],
) -> list[SparseParameter]:
    """Register masks and hooks for ``chosen``; on failure undo them and raise. Reversible
    (`unregister_params`) until `commit` prunes the weights."""
    sps = [SparseParameter(module, name, attr) for name, module, attr, _ in chosen]
    replaced = {sp.name: sp.mask for sp in sps if sp.has_mask}  # unowned masks (`validate`)
    try:
        for sp, mask in zip(sps, masks, strict=True):
            sp.register_mask(mask)
        algorithm.hooks.install(root, sps)
    except BaseException:
        unregister_params(algorithm, sps)
        for sp in sps:
            if sp.name in replaced:
                sp.register_mask(replaced[sp.name])
        raise
    return sps


def unregister_params(algorithm: SparsityAlgorithm, sps: list[SparseParameter]) -> None:
    """Undo `register`."""
    algorithm.hooks.remove()
    for sp in sps:
        sp.remove_mask()


def commit(algorithm: SparsityAlgorithm, root: nn.Module, sps: list[SparseParameter]) -> None:
    """Prune the registered parameters: from here ``algorithm`` owns them."""
    algorithm.root = root
    algorithm.sparse_params.update((sp.name, sp) for sp in sps)
    with torch.no_grad():
        for sp in sps:
            sp.prune_()
            if algorithm.track_itop:
                algorithm.ever_active[sp.name] = sp.mask.clone()
    algorithm.mask_targets = {sp.name: algorithm.initial_target(sp.name) for sp in sps}
    if sps:
        applied.record(root, algorithm)
    algorithm.observers.emit_sparsity(algorithm)


def apply_model(algorithm: SparsityAlgorithm, root: nn.Module) -> None:
    """``algorithm.apply(root)``: select, validate, build masks, then attach; a failure leaves
    the algorithm's settings as they were (`settings_of`)."""
    chosen = select(algorithm, root)
    if not chosen:
        warnings.warn(
            f"{algorithm.name}: no parameter of {type(root).__name__} matched the parameter "
            "filter, so nothing was sparsified; check param_filter against "
            "model.named_parameters()",
            stacklevel=4,
        )
    before = settings_of(algorithm)
    try:
        validate(algorithm, chosen)
        algorithm.seed = resolve_seed(algorithm.seed)
        sps = register(algorithm, root, chosen, build_masks(algorithm, chosen))
    except BaseException:
        reset_settings(algorithm, before)
        raise
    commit(algorithm, root, sps)


def settings_of(algorithm: SparsityAlgorithm) -> tuple[Any, ...]:
    """What `validate` and seeding set on ``algorithm`` before its masks exist: the seed, the
    [in, out] parameters and the layer shapes of the distribution."""
    return algorithm.seed, algorithm.in_out_params, dict(algorithm.layers.shapes)


def reset_settings(algorithm: SparsityAlgorithm, settings: tuple[Any, ...]) -> None:
    """Undo what a refused ``apply`` set (`settings_of`)."""
    algorithm.seed, algorithm.in_out_params, shapes = settings
    algorithm.layers.set_shapes(shapes)


def check_optimizer(algorithm: SparsityAlgorithm, optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` can be made sparse by ``algorithm`` now."""
    if algorithm.root is None:
        raise RuntimeError(
            f"apply the sparsity to the model first (model.apply({algorithm.name})), then to the "
            "optimizer"
        )
    if any(o is optimizer for o in algorithm.hooks.optimizers):
        raise RuntimeError(f"{algorithm.name} is already applied to this optimizer")
    own = {id(p) for p in algorithm.root.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) (first shape "
            f"{tuple(foreign[0].shape)}) that the sparsified model does not own; build the "
            "optimizer from that model's parameters()"
        )
