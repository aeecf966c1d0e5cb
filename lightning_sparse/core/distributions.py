"""Per-layer sparsity from one global target.

Every distribution has one signature, ``(shapes, sparsity, **kwargs) -> {name: sparsity}``
(``shapes``: parameter name -> shape; ``sparsity``: the target fraction of zeros in ``[0, 1)``;
the result in ``shapes``' order), and keeps the parameter-weighted mean sparsity equal to the
target (before each layer's keep count truncates to ``int((1 - s) * n)``). ``global_magnitude``
ranks all layers' weights together instead, so it needs the weights and returns masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from . import validate
from .mask_ops import topk_mask

Distribution = Callable[..., dict[str, float]]
"""``(shapes: Mapping[str, torch.Size], sparsity: float, **kwargs) -> dict[str, float]``."""


def uniform(shapes: Mapping[str, torch.Size], sparsity: float) -> dict[str, float]:
    """Give every layer the target sparsity (Cerebras' only 2.x behaviour)."""
    sparsity = validate.sparsity(sparsity, "uniform sparsity")
    return {name: sparsity for name in shapes}


def _erdos_renyi(
    shapes: Mapping[str, torch.Size], sparsity: float, power_scale: float, dims: int | None
) -> dict[str, float]:
    """Density ``eps * (sum(d) / prod(d)) ** power_scale`` over ``shape[:dims]``.

    ``eps`` is solved so the kept parameter count is ``(1 - sparsity) * total``. A layer whose
    density would exceed 1 is made dense and ``eps`` re-solved for the rest, until all fit.
    """
    if not math.isfinite(power_scale) or power_scale < 0:
        raise ValueError(f"power_scale must be a finite float >= 0, got {power_scale!r}")
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    raw = {}
    for name, shape in shapes.items():
        used = tuple(shape)[:dims] or (1,)
        if numel[name] == 0:
            continue
        raw[name] = (sum(used) / math.prod(used)) ** power_scale
    dense: set[str] = set()
    while True:
        # Kept count to spread over the sparse layers: the target minus the dense layers.
        budget = (1.0 - sparsity) * sum(numel.values()) - sum(numel[name] for name in dense)
        weight = sum(raw[name] * numel[name] for name in raw if name not in dense)
        eps = budget / weight if weight > 0 else 0.0
        too_dense = {name for name in raw if name not in dense and eps * raw[name] > 1.0}
        if not too_dense:
            break
        # The paper's code densifies only the layers with the largest raw density per round.
        largest = max(raw[name] for name in too_dense)
        dense |= {name for name in too_dense if raw[name] == largest}
    return {
        name: 0.0 if name in dense or name not in raw else max(0.0, 1.0 - eps * raw[name])
        for name in shapes
    }


def er(
    shapes: Mapping[str, torch.Size], sparsity: float, *, power_scale: float = 1.0
) -> dict[str, float]:
    """Erdős-Rényi: density proportional to ``(n_out + n_in) / (n_out * n_in)``.

    Uses only ``shape[:2]`` (``[out, in]``), ignoring conv kernel dims. Mocanu et al. 2018,
    arXiv:1707.04780; with the dense fallback of Evci et al. 2020, "Rigging the Lottery: Making
    All Tickets Winners", arXiv:1911.11134. ``power_scale``: the exponent on the raw density (1
    is the paper's ER; 0 gives uniform). Layers that would exceed density 1 get 0.0 (dense).
    """
    return _erdos_renyi(shapes, validate.sparsity(sparsity, "er sparsity"), power_scale, dims=2)


def erk(
    shapes: Mapping[str, torch.Size], sparsity: float, *, power_scale: float = 1.0
) -> dict[str, float]:
    """Erdős-Rényi-Kernel: density proportional to ``sum(shape) / prod(shape)``.

    Includes the conv kernel dims. Evci et al. 2020, "Rigging the Lottery: Making All Tickets
    Winners", arXiv:1911.11134 (``erk_power_scale`` in its code). ``power_scale``: as `er`'s (1
    is the paper's ERK). Layers that would exceed density 1 get 0.0 (dense).
    """
    return _erdos_renyi(shapes, validate.sparsity(sparsity, "erk sparsity"), power_scale, dims=None)


def global_magnitude(weights: Mapping[str, Tensor], sparsity: float) -> dict[str, Tensor]:
    """Keep the largest ``|w|`` across all layers together (global magnitude pruning).

    One top-k of ``int((1 - sparsity) * total)`` over every weight, ties to the earlier layer in
    ``weights``' order, then to the lower flat index; NaN counts as ``-inf``.

    Args:
        weights: Name -> weight tensor (any shapes; all on one device).
        sparsity: Target fraction of zeros over all weights, in ``[0, 1)``.

    Returns:
        Name -> bool mask of that weight's shape; exactly ``int((1 - s) * total)`` True in all.
    """
    sparsity = validate.sparsity(sparsity, "global_magnitude sparsity")
    if not weights:
        return {}
    flat = torch.cat([w.detach().abs().reshape(-1) for w in weights.values()])
    keep = topk_mask(flat.unsqueeze(0), int((1.0 - sparsity) * flat.numel())).squeeze(0)
    masks = keep.split([w.numel() for w in weights.values()])
    return {
        name: mask.reshape(w.shape) for (name, w), mask in zip(weights.items(), masks, strict=True)
    }


DISTRIBUTIONS: dict[str, Distribution] = {"uniform": uniform, "er": er, "erk": erk}


def make_distribution(name: str) -> Distribution:
    """Return the distribution registered as ``name`` in ``DISTRIBUTIONS``.

    Raises:
        ValueError: If ``name`` is unknown; the message lists the valid names.
    """
    if not isinstance(name, str) or name not in DISTRIBUTIONS:
        raise ValueError(
            f"unknown sparsity distribution {name!r}; valid names are {sorted(DISTRIBUTIONS)} "
            f"(global magnitude ranking is global_magnitude(weights, sparsity))"
        )
    return DISTRIBUTIONS[name]


class LayerSparsity:
    """An algorithm's per-layer sparsity: ``distribution`` over the selected shapes, memoised
    for the last overall target (so the per-step path never recomputes it).

    Args:
        name: a key of ``DISTRIBUTIONS``.
        power_scale: the ER/ERK exponent (1.0 in the RigL paper).
    """

    def __init__(self, name: str, power_scale: float = 1.0) -> None:
        self.name = name
        self.distribution = make_distribution(name)
        self.power_scale = float(power_scale)
        self.shapes: dict[str, torch.Size] = {}
        self._cache: dict[float, dict[str, float]] = {}

    def set_shapes(self, shapes: dict[str, torch.Size]) -> None:
        """The shapes of the selected parameters (set at ``apply``)."""
        self.shapes, self._cache = dict(shapes), {}

    def __call__(self, name: str, sparsity: float) -> float:
        """Sparsity of parameter ``name`` when the overall target is ``sparsity``."""
        if self.name == "uniform" or name not in self.shapes:
            return sparsity
        if sparsity not in self._cache:
            spread = self.distribution(self.shapes, sparsity, power_scale=self.power_scale)
            self._cache = {sparsity: spread}
        return self._cache[sparsity][name]
