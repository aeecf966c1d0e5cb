"""The checks ``apply`` runs before it changes anything: pure functions that raise or warn.

Each names the parameter, the rule and the fix. They read the candidates, the shaper, the masks
already on the model and the optimizer; they never modify them and never see an algorithm.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from types import FrameType

import torch
from torch import nn

from .selection import Candidate
from .shapers import Shaper
from .sparse_parameter import mask_buffer_name

__all__ = ["check_candidates", "check_mask", "check_optimizer", "check_shaper"]


def already_applied(name: str, applied_to: nn.Module, model: nn.Module) -> RuntimeError:
    """The error of applying ``name``, already applied to ``applied_to``, to ``model`` too; when
    that happens inside a ``Module.apply`` walk, the likely cause: a function that calls the
    algorithm, passed to ``model.apply``, calls it on every submodule, the first one acting."""
    hint = (
        f"; it was applied to a {type(applied_to).__name__} during a model.apply(fn) walk, "
        "which calls fn on every submodule: pass the algorithm itself (model.apply(sparsity)) "
        "or call sparsity.apply(model)"
        if model is not applied_to and _inside_module_apply()
        else ""
    )
    return RuntimeError(
        f"{name} is already applied to a model; create a new algorithm object per model "
        f"(applying twice would stack masks){hint}"
    )


def _inside_module_apply(depth: int = 12) -> bool:
    """Whether one of the ``depth`` innermost frames runs ``nn.Module.apply``."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is nn.Module.apply.__code__:
            return True
        frame = frame.f_back
    return False


def check_shaper(shaper: object) -> Shaper:
    """``shaper`` if it is a `Shaper`, else a TypeError naming it."""
    if not isinstance(shaper, Shaper):
        raise TypeError(
            f"shaper={shaper!r} must be a Shaper such as Unstructured(), NM(2, 4) or "
            "OutputGroups(8) (lightning_sparse.core.shapers)"
        )
    return shaper


def check_candidates(
    chosen: list[Candidate],
    *,
    owner: str,
    shaper: Shaper,
    in_out: set[str],
    filtered: bool,
    owned: set[tuple[int, str]],
) -> list[str]:
    """Raise unless every chosen parameter can be sparsified; return the names of those that
    carry a mask no algorithm owns (restored or copied; the caller replaces it).

    Args:
        chosen: the candidates `selection.select` picked.
        owner: the algorithm's name, for messages.
        shaper: its structure; every shape must fit it (an ``in_out`` one transposed).
        in_out: names of parameters stored ``[in, out]`` (HF ``Conv1D``).
        filtered: whether a ``param_filter`` chose them (a 1-D one then draws a warning).
        owned: ``(id(module), buffer)`` of the masks applied algorithms own.

    Raises:
        RuntimeError: a mask owned by another algorithm, an attribute where the mask would go,
            ``requires_dense=True``.
        TypeError: a parameter that is not floating point.
        ValueError: a shape the shaper cannot structure (`Shaper.check`).
    """
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
            raise RuntimeError(
                f"{type(module).__name__} already has an attribute {buffer!r}, "
                f"where the mask of {name!r} would go; rename that attribute"
            )
        if getattr(param, "requires_dense", False):
            raise RuntimeError(f"{name!r} has requires_dense=True and cannot be sparsified")
        if not param.is_floating_point():
            raise TypeError(
                f"{name!r} has dtype {param.dtype}; only floating-point parameters can be "
                "sparsified: exclude it with param_filter"
            )
        if param.ndim < 2 and filtered:
            warnings.warn(
                f"{owner}: param_filter selected the {param.ndim}-D parameter "
                f"{name!r} (a bias or norm scale?); sparsifying it is rarely intended",
                stacklevel=5,
            )
        shaper.check(param.shape[::-1] if name in in_out else param.shape, name)
    return orphans


def check_mask(mask: object, param: torch.Tensor, name: str, init_method: object) -> torch.Tensor:
    """An init method's output as a bool mask of ``param``'s shape, or an error naming it."""
    method = getattr(init_method, "__name__", init_method)
    if not torch.is_tensor(mask) or tuple(mask.shape) != tuple(param.shape):
        shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(
            f"init_method {method!r} returned {shape} for {name!r} of shape "
            f"{tuple(param.shape)}; it must return a bool mask of that shape"
        )
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or not bool(((mask == 0) | (mask == 1)).all()):
            raise TypeError(
                f"init_method {method!r} returned dtype {mask.dtype} for {name!r}; return a "
                "torch.bool mask (True = kept)"
            )
        mask = mask.to(torch.bool)
    return mask


def check_optimizer(
    owner: str,
    root: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    attached: Iterable[torch.optim.Optimizer],
) -> None:
    """Raise unless ``optimizer`` can be made sparse now: the algorithm is applied to ``root``,
    not yet to this optimizer, and the optimizer holds ``root``'s parameters only."""
    if root is None:
        raise RuntimeError(
            f"apply the sparsity to the model first (model.apply({owner})), then to the optimizer"
        )
    if any(o is optimizer for o in attached):
        raise RuntimeError(f"{owner} is already applied to this optimizer")
    own = {id(p) for p in root.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) (first shape "
            f"{tuple(foreign[0].shape)}) that the sparsified model does not own; build the "
            "optimizer from that model's parameters()"
        )
