"""`WSEStats`: what the emulated wafer-scale device executed, held and rebuilt.

The executor (`executor.py`) records every matmul of a `WSELinear` (or Hugging Face ``Conv1D``,
counted as the ``[out, in]`` Linear it transposes to) here; the accelerator's
`WSEStatsMonitor` logs the figures once per optimizer step (``accelerator.stats.as_dict()``
returns them; `get_device_stats` only with ``log_stats=False``). Pure bookkeeping: no
tensors, no host syncs (every count is a Python int known from shapes and `CSRWeight.nnz`).

FLOPs count the matmuls of Linear layers (a multiply-add is 2 FLOPs; bias adds and everything
outside Linear layers are left out), for ``N`` tokens through a ``[out, in]`` weight with ``nnz``
kept entries, as below: `add_matmul` computes them with
`lightning_sparse.core.flop_account.matmul_flops`, the formula the run summary and `FlopCounter`
use, so a training step here costs what they charge for it (forward, input gradient and weight
gradient: their ``3 x`` forward; a dense weight gradient: their dense-gradient extra).
Masked ``Conv2d`` layers run dense on the device and are recorded with
``nnz = numel`` (executed = dense equivalent; ``N`` is the output positions, examples times
output pixels); unmasked ones and embeddings are not recorded.

========================  ==================  ====================
kind                      executed            dense equivalent
========================  ==================  ====================
``forward``               ``2 * N * nnz``     ``2 * N * out * in``
``input_grad``            ``2 * N * nnz``     ``2 * N * out * in``
``weight_grad``           ``2 * N * nnz``     ``2 * N * out * in``
``dense_weight_grad``     ``2 * N * out * in``  ``2 * N * out * in``
========================  ==================  ====================

``dense_weight_grad`` replaces ``weight_grad`` in the backward of a step whose mask update reads
the dense gradient (RigL, GraNet); forward and input gradient stay sparse on those steps. A layer
without a mask executes dense (executed = dense equivalent); an input gradient is counted only
when autograd computes it (the first layer's input usually needs none).

Weight memory, per masked layer with ``b`` bytes per value:

- ``csr``: ``nnz * (b + c) + (out + 1) * 4``: values, column indices (``c`` = 2 bytes where
  ``in <= 65536``, else 4) and int32 row pointers: what training and inference both walk (the
  input gradient scatters along the same rows, no transposed structure).
- ``dense``: ``out * in * b``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_sparse.core.flop_account import matmul_flops
from lightning_sparse.wse.policy import narrow_columns

__all__ = ["FLOP_KINDS", "LayerMemory", "WSEStats"]

FLOP_KINDS = ("forward", "input_grad", "weight_grad", "dense_weight_grad")


@dataclass(frozen=True)
class LayerMemory:
    """Weight bytes of one masked layer in each storage format (see the module docstring)."""

    dense: int
    csr: int

    @classmethod
    def of(cls, out_features: int, in_features: int, nnz: int, value_bytes: int) -> LayerMemory:
        """Bytes of a ``[out_features, in_features]`` weight with ``nnz`` kept entries."""
        index_bytes = 2 if narrow_columns(in_features) else 4
        return cls(
            dense=out_features * in_features * value_bytes,
            csr=nnz * (value_bytes + index_bytes) + (out_features + 1) * 4,
        )


@dataclass
class WSEStats:
    """FLOP counters (per step and since creation), weight memory and structure rebuilds.

    Attributes:
        step_flops: ``{kind: [executed, dense equivalent]}`` of training since the last
            `end_step`.
        eval_flops: the same for matmuls run while ``evaluating`` is set, since `end_eval`.
        total_flops: everything since creation.
        evaluating: route FLOPs to ``eval_flops`` (set during validation).
        memory: weight bytes of each masked layer by name, as of its last rebuild.
        rebuilds / rebuild_seconds: CSR structure builds and their wall time since `end_step`.
        total_rebuilds / total_rebuild_seconds: the same since creation.
        steps / dense_grad_steps: completed `end_step` calls, and those with dense weight grads.
    """

    step_flops: dict[str, list[int]] = field(default_factory=lambda: _zero_flops())
    eval_flops: dict[str, list[int]] = field(default_factory=lambda: _zero_flops())
    total_flops: dict[str, list[int]] = field(default_factory=lambda: _zero_flops())
    evaluating: bool = False
    memory: dict[str, LayerMemory] = field(default_factory=dict)
    rebuilds: int = 0
    rebuild_seconds: float = 0.0
    total_rebuilds: int = 0
    total_rebuild_seconds: float = 0.0
    steps: int = 0
    dense_grad_steps: int = 0
    _last: dict[str, float] = field(default_factory=dict, repr=False)

    def add_flops(self, kind: str, executed: int, dense: int) -> None:
        """Record one matmul of ``kind`` (one of `FLOP_KINDS`)."""
        window = self.eval_flops if self.evaluating else self.step_flops
        for table in (window, self.total_flops):
            counts = table[kind]
            counts[0] += executed
            counts[1] += dense

    def add_matmul(self, kind: str, tokens: int, kept: int, numel: int) -> None:
        """Record one matmul of ``kind`` (one of `FLOP_KINDS`): ``tokens`` rows through a weight of
        ``numel`` entries of which ``kept`` are executed (``numel`` when it runs dense);
        `matmul_flops` of each, executed and dense equivalent."""
        self.add_flops(kind, matmul_flops(tokens, kept), matmul_flops(tokens, numel))

    def add_rebuild(self, name: str, seconds: float, memory: LayerMemory) -> None:
        """Record one CSR structure build of layer ``name``."""
        self.rebuilds += 1
        self.total_rebuilds += 1
        self.rebuild_seconds += seconds
        self.total_rebuild_seconds += seconds
        self.memory[name] = memory

    def forget_layer(self, name: str) -> None:
        """Drop a layer's memory figures (its mask was removed)."""
        self.memory.pop(name, None)

    def end_step(self) -> dict[str, float]:
        """Close the current training step: return its figures and reset the step counters.

        Keys: ``flops_<kind>`` / ``flops_<kind>_dense`` per kind, ``flops_executed``,
        ``flops_dense``, ``flops_ratio`` (executed / dense), ``rebuilds``, ``rebuild_seconds``.
        """
        self._last = _flop_dict(self.step_flops)
        self._last["rebuilds"] = float(self.rebuilds)
        self._last["rebuild_seconds"] = self.rebuild_seconds
        self.steps += 1
        self.dense_grad_steps += self.step_flops["dense_weight_grad"][0] > 0
        self.step_flops = _zero_flops()
        self.rebuilds, self.rebuild_seconds = 0, 0.0
        return dict(self._last)

    def end_eval(self) -> dict[str, float]:
        """Figures of the FLOPs recorded while ``evaluating`` (keys as `end_step`'s flops_*),
        then reset them."""
        out = _flop_dict(self.eval_flops)
        self.eval_flops = _zero_flops()
        return out

    def as_dict(self) -> dict[str, float]:
        """Figures of the last completed step (see `end_step`; zeros before the first), weight
        memory now (see `memory_dict`), and running totals: ``total_flops_<kind>`` and
        ``total_flops_<kind>_dense`` per kind, ``total_flops_executed``, ``total_flops_dense``,
        ``total_rebuilds``, ``total_rebuild_seconds``, ``steps``, ``dense_grad_steps``."""
        out = (
            dict(self._last)
            if self._last
            else {**_flop_dict(_zero_flops()), "rebuilds": 0.0, "rebuild_seconds": 0.0}
        )
        out.update(self.memory_dict())
        out.update({f"total_{k}": v for k, v in _flop_dict(self.total_flops).items()})
        out.pop("total_flops_ratio")
        out.update(
            total_rebuilds=float(self.total_rebuilds),
            total_rebuild_seconds=self.total_rebuild_seconds,
            steps=float(self.steps),
            dense_grad_steps=float(self.dense_grad_steps),
        )
        return out

    def memory_dict(self) -> dict[str, float]:
        """Weight bytes of the masked layers now, per format, and each format's ratio to dense."""
        dense = sum(m.dense for m in self.memory.values())
        csr = sum(m.csr for m in self.memory.values())
        return {
            "weight_bytes_dense": float(dense),
            "weight_bytes_csr": float(csr),
            "weight_bytes_ratio_csr": csr / dense if dense else 1.0,
        }


def _flop_dict(flops: dict[str, list[int]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind, (executed, dense) in flops.items():
        out[f"flops_{kind}"] = float(executed)
        out[f"flops_{kind}_dense"] = float(dense)
    executed = sum(c[0] for c in flops.values())
    dense = sum(c[1] for c in flops.values())
    out["flops_executed"] = float(executed)
    out["flops_dense"] = float(dense)
    out["flops_ratio"] = executed / dense if dense else 1.0
    return out


def _zero_flops() -> dict[str, list[int]]:
    return {kind: [0, 0] for kind in FLOP_KINDS}
