"""Kernel launches and host syncs per training step: dense, Static, RigL, a RigL update.

The per-step path at GPU cost, counted on the CPU (`step_ops`: the rules). A plain loop over the
package's `Llama` (every linear weight of the blocks masked, sparsity 0.8, fused AdamW) runs a
few steps; one step of each kind is counted:

* ``dense``: no sparsity;
* ``static``: `Static`, an ordinary step;
* ``rigl``: `RigL`, an ordinary step;
* ``rigl update``: `RigL`, a step that updates the masks.

Printed: kernels and host syncs per step, the difference to dense, that difference per masked
weight, and (``--ops``) the ops behind each difference. Two sizes (``--layers``) show what grows
with the number of masked weights: the last line gives the kernels each further masked weight
adds (the rest is per shape or per step).

    python benchmarks/bench_step_ops.py [--dim 256] [--layers 2 4] [--ops]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from benchmarks.step_ops import Counts, as_on_a_gpu, count  # noqa: E402
from lightning_sparse import RigL, SparsityAlgorithm, Static  # noqa: E402
from lightning_sparse.models.llama import Llama, LlamaConfig  # noqa: E402

KINDS = ("dense", "static", "rigl", "rigl update")
UPDATE_EVERY = 4  # RigL updates at steps 4, 8, ...


def make_sparsity(kind: str) -> SparsityAlgorithm | None:
    if kind == "dense":
        return None
    if kind == "static":
        return Static(0.8, seed=0)
    return RigL(0.8, update={"freq": UPDATE_EVERY}, drop_fraction=0.3, seed=0)


class Loop:
    """A plain training loop: model, fused AdamW and (optionally) sparsity."""

    def __init__(self, kind: str, dim: int, layers: int, batch: int = 2, seq: int = 32) -> None:
        torch.manual_seed(0)
        self.model = Llama(LlamaConfig(dim=dim, n_layers=layers, n_heads=4, max_seq_len=seq))
        self.sparsity = make_sparsity(kind)
        if self.sparsity is not None:
            self.model.apply(self.sparsity)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        if self.sparsity is not None:
            self.sparsity.apply(self.optimizer)
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)

    @property
    def masked(self) -> int:
        return len(self.sparsity.sparse_params) if self.sparsity is not None else 0

    def step(self) -> None:
        logits = self.model(self.tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def measure(kind: str, dim: int, layers: int) -> tuple[Counts, int]:
    """Counts of one step of ``kind`` after a few uncounted ones (state exists, masks synced)."""
    with as_on_a_gpu():  # the whole run: what is kept for the GPU's paths exists when counted
        loop = Loop(kind, dim, layers)
        warmup = UPDATE_EVERY if kind == "rigl update" else UPDATE_EVERY + 1
        for _ in range(warmup):
            loop.step()
        if kind == "rigl update":
            assert loop.sparsity is not None and loop.sparsity.is_update_step()
        counts = count(loop.step)
    return counts, loop.masked


Results = dict[str, tuple[Counts, int]]


def table(dim: int, layers: int, show_ops: bool, out: Callable[[str], None] = print) -> Results:
    results = {kind: measure(kind, dim, layers) for kind in KINDS}
    dense = results["dense"][0]
    masked = results["static"][1]
    out(f"dim {dim}, {layers} layers, {masked} masked weights")
    out(
        f"{'step':<12} {'kernels':>8} {'syncs':>6} {'+kernels':>9} {'+syncs':>7} {'per weight':>11}"
    )
    for kind, (counts, n) in results.items():
        extra = counts.n_kernels - dense.n_kernels
        per = f"{extra / n:.2f}" if n else "-"
        out(
            f"{kind:<12} {counts.n_kernels:>8} {counts.n_syncs:>6} {extra:>+9} "
            f"{counts.n_syncs - dense.n_syncs:>+7} {per:>11}"
        )
        if show_ops and kind != "dense":
            diff = Counter(counts.kernels)
            diff.subtract(dense.kernels)
            ops = ", ".join(f"{k} {v:+d}" for k, v in diff.most_common() if v)
            out(f"    kernels: {ops}")
            if counts.syncs:
                out(f"    syncs: {dict(counts.syncs)}")
    return results


def marginal(small: Results, large: Results) -> str:
    """Kernels each further masked weight adds, per kind, between two sizes."""
    dense = large["dense"][0].n_kernels - small["dense"][0].n_kernels
    n = large["static"][1] - small["static"][1]
    parts = []
    for kind in KINDS[1:]:
        grown = large[kind][0].n_kernels - small[kind][0].n_kernels - dense
        parts.append(f"{kind} {grown / n:.2f}")
    return "kernels per further masked weight: " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ops", action="store_true", help="list the ops behind each difference")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = []
    for layers in args.layers:
        runs.append(table(args.dim, layers, args.ops))
        print()
    if len(runs) > 1:
        print(marginal(runs[0], runs[-1]))


if __name__ == "__main__":
    main()
