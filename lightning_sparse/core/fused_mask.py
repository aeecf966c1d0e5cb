"""One kernel that zeroes the pruned positions of many tensors, the bool mask cast inside it.

Pruning multiplies a float tensor's bit pattern (an integer view, `masking`) by its bool mask.
On a GPU one ``torch._foreach_mul_`` over all the tensors is one launch per chunk of tensors,
but only when every tensor of both lists has one dtype: with bool masks and ``int32`` views
CUDA loops over the tensors, a launch each. Keeping the masks as ``int32`` copies (the previous
design) made it one launch for 4 extra bytes per masked weight (2 for bf16), 1.25x the weights'
own memory. Here the product is compiled instead (``torch.compile``, TorchInductor): the
foreach product with each mask cast to its view's dtype becomes one fused in-place kernel that
reads the bool mask and writes the view, so the masks cost their bool bytes only.

What it costs: one compilation per list of a new composition on the first steps, cached on
disk by TorchInductor for later runs. The sizes are compiled as symbols (``dynamic=True``) with
no equalities assumed between them (``use_duck_shape=False``: else two sizes that happen to be
equal on the first call are assumed equal, and a list where they differ compiles again), and a
list is compiled in chunks of `CHUNK` tensors, so a composition is a chunk's length (`CHUNK`, or
the remainder of a list), its dtypes and ranks, and which of its masks are one tensor (the
optimizer state's two moments share their weight's mask). A step's lists are the same every
step (the gradients, the weights, the optimizer state), so a run compiles a handful of small
kernels (unchunked, each list of a 12-block Llama compiled one kernel over 84 or 168 tensors,
several times slower to compile: `bench_mask_memory.py --first-steps`, benchmarks/README.md's
"Figures behind the code"). The price of chunking: one call per chunk, each with TorchDynamo's
fixed host cost for its guards. A process that trains several models (a sweep, a test
session) compiles a handful for each, so TorchDynamo's recompile limit is raised to
`RECOMPILE_LIMIT` for this function while it runs (its default, 8, is per function). Past it,
TorchDynamo warns and the product runs eagerly: correct, with a transient integer copy of each
mask. Where compilation is impossible (no compiler for the platform, a backend error), the
product runs per tensor with the bool masks (`_per_tensor`): the same result, no extra memory,
a launch per tensor; a warning says so once. Under a ``TorchDispatchMode`` (the launch counter
of ``benchmarks/step_ops.py``) TorchDynamo does not compile: the product then runs eagerly.

The product is the op ``lightning_sparse::mul_by_masks_``, so a launch counter sees it as one
op (on the GPU one fused kernel per chunk of `CHUNK` tensors). Host time per call:
TorchDynamo's guards, a few microseconds per tensor (`benchmarks/bench_mask_memory.py` measures
it and the memory; docs/gpu.md says why this way).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["mul_by_masks_"]

log = logging.getLogger("lightning_sparse")


def _product(views: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
    """``views[i] *= masks[i]`` with the cast to the view's dtype inside the kernel."""
    torch._foreach_mul_(
        views, [mask.to(view.dtype) for view, mask in zip(views, masks, strict=True)]
    )


def _per_tensor(views: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
    """The same product without compilation: one in-place multiply per tensor, by the bool."""
    for view, mask in zip(views, masks, strict=True):
        view.mul_(mask)


CHUNK = 32  # tensors per compiled call (module docstring)
RECOMPILE_LIMIT = 64  # compositions compiled in one process (module docstring)
_compiled: Callable[..., Any] | None = None
_broken = False  # compilation failed once in this process: the per-tensor product from now on


def _no_duck_shapes() -> contextlib.AbstractContextManager[object]:
    """Meanwhile, sizes equal on a first call are not assumed equal (module docstring); a torch
    without the setting compiles as before."""
    try:
        from torch.fx.experimental import _config as config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "use_duck_shape"):
        return contextlib.nullcontext()
    return config.patch(use_duck_shape=False)  # type: ignore[attr-defined]  # install_config_module


def _mul_by_masks_(views: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
    """``views[i] *= masks[i]`` in place, in one fused kernel (module docstring)."""
    global _compiled, _broken
    if _broken:
        _per_tensor(views, masks)
        return
    if _compiled is None:
        _compiled = torch.compile(_product, dynamic=True)
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), _no_duck_shapes():
            for start in range(0, len(views), CHUNK):
                _compiled(views[start : start + CHUNK], masks[start : start + CHUNK])
    except Exception as error:  # any backend failure: the eager product is exact (and a chunk
        # already multiplied is multiplied again by the same 0/1 mask: unchanged)
        _broken = True
        log.warning(
            "lightning_sparse: the fused pruning kernel could not be compiled (%s: %s); "
            "pruning runs one kernel per tensor instead (correct, slower on a GPU)",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        _per_tensor(views, masks)


# Registered with the low-level `torch.library` API: ``torch.library.custom_op`` costs more per
# call in Python (benchmarks/README.md, "Figures behind the code"), on a path run twice a step.
_LIBRARY = torch.library.Library("lightning_sparse", "DEF")
_LIBRARY.define("mul_by_masks_(Tensor(a!)[] views, Tensor[] masks) -> ()")
_LIBRARY.impl("mul_by_masks_", _mul_by_masks_, "CompositeExplicitAutograd")
_LIBRARY.impl("mul_by_masks_", lambda views, masks: None, "Meta")  # shapes do not change


def mul_by_masks_(views: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
    """``views[i] *= masks[i]`` in place, in one fused kernel (module docstring): the op
    ``lightning_sparse::mul_by_masks_``.

    Args:
        views: integer tensors (the bit views of the tensors to prune), any shapes.
        masks: bool tensors, ``masks[i]`` of ``views[i]``'s shape and device (True = kept).
    """
    torch.ops.lightning_sparse.mul_by_masks_(views, masks)
