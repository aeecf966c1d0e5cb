"""Training step of the RigL Llama recipe model: ``accelerator="wse"`` versus ``"cpu"``.

Every variant is a ``Trainer.fit`` of `LitCausalLM` with the recipe's model (``recipes/
rigl_llama.yaml``: dim 128, 4 layers, 4 heads, seq 128, batch 16, vocab 256, fused AdamW with the
warmup-cosine schedule) and the recipe's RigL callback (random init, drop fraction 0.3 cosine,
the 28 ``*layers.*_proj.weight`` matrices) at each sparsity of the curve, once on the CPU
accelerator (masked dense training) and once on the emulated wafer-scale device. A dense CPU run
(no callback) is the reference. All Trainers live in one process, each in its own thread, parked
between steps; one step of each runs per round, order rotated every round, and a step is timed
from ``on_train_batch_start`` to ``on_train_batch_end`` (every callback's batch-end work inside).

RigL updates at step 0 (sparse start, as in the recipe) and once more at step ``warmup + 1``
instead of every 50 steps, so the timed rounds hold one update step (dense weight gradients) and
one step after it (the device rebuilds its CSR structures); both are reported on their own and
left out of the medians of ordinary steps.

    python benchmarks/bench_wse_training.py [--steps 11] [--warmup 3] [--threads 2]
    python benchmarks/bench_wse_training.py --quick     # smoke run: tiny model, 3 steps

Goal: wse at 90% >= 1.5x the cpu accelerator at 90% (ratio of median ordinary steps).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _harness import (
    SteppedFit,
    load_average,
    machine_facts,
    make_batches,
    median_ms,
    min_ms,
    quiet,
    run_interleaved,
)

from lightning_sparse import RigL
from lightning_sparse.models import LitCausalLM
from lightning_sparse.models.llama import LlamaConfig
from lightning_sparse.wse import WSEAccelerator, autotune_choices

SPARSITIES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
GOAL_SPARSITY, GOAL = 0.9, 1.5
RECIPE = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=128)
FILTER = ["*layers.*_proj.weight"]


class TrainerRun(SteppedFit):
    """``Trainer.fit`` of the recipe `LitCausalLM` (with its RigL at ``sparsity``, if given) on
    ``accelerator``, one step at a time."""

    def __init__(
        self,
        accelerator: Any,
        sparsity: float | None,
        update_at: int,
        cfg: dict[str, int],
        batches: list[torch.Tensor],
        seed: int,
    ) -> None:
        torch.manual_seed(seed)  # same initial weights in every variant
        module = LitCausalLM(**cfg, lr=3e-3, warmup_steps=50)
        self.algorithm = None
        if sparsity is not None:
            self.algorithm = RigL(
                sparsity,
                init_method="random",
                drop_fraction={"type": "cosine", "init": 0.3, "half_period": 450},
                update={"steps": [0, update_at]},
                param_filter=FILTER,
            )
        callbacks = [self.algorithm] if self.algorithm else []
        super().__init__(module, callbacks, batches, accelerator=accelerator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=11, help="timed rounds per variant (>= 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sparsities", default=",".join(map(str, SPARSITIES)), help="comma-separated curve"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps (smoke run)")
    args = parser.parse_args()
    cfg = dict(RECIPE)
    sparsities = [float(s) for s in args.sparsities.split(",")]
    if args.quick:
        cfg.update(dim=32, n_layers=1, max_seq_len=16)
        args.batch, args.steps, args.warmup, sparsities = 2, 3, 1, [GOAL_SPARSITY]
    if args.steps < 3 or args.warmup < 1:
        parser.error("--steps must be >= 3 and --warmup >= 1 (the update falls in the rounds)")
    torch.set_num_threads(args.threads)
    quiet()
    seq = cfg["max_seq_len"]
    batches = make_batches(LlamaConfig(**cfg), args.warmup + args.steps, args.batch, seq, args.seed)
    update_at = args.warmup + 1  # timed round 1 updates the masks, round 2 rebuilds
    print(machine_facts())
    print(
        f"model: recipe Llama {cfg}, batch {args.batch} x seq {seq}, fp32, fused AdamW; RigL on "
        f"{FILTER} updating at steps 0 and {update_at}; {args.warmup} warm-up + {args.steps} "
        "timed steps per variant, round-robin, order rotated each round"
    )
    runs: dict[str, TrainerRun] = {}
    try:
        runs["cpu dense"] = TrainerRun("cpu", None, update_at, cfg, batches, args.seed)
        for s in sparsities:
            runs[f"cpu {s:.2f}"] = TrainerRun("cpu", s, update_at, cfg, batches, args.seed)
            runs[f"wse {s:.2f}"] = TrainerRun(
                WSEAccelerator(), s, update_at, cfg, batches, args.seed
            )
        times = run_interleaved(runs, batches, args.warmup, args.steps)
    finally:
        for run in runs.values():
            run.close()
    report(runs, times, sparsities)
    for name, run in runs.items():
        if run.trainer.global_step != len(batches):
            print(f"WARNING: {name} ran {run.trainer.global_step} steps, expected {len(batches)}")
    print(f"\nload average after the run: {load_average()}")


def report(
    runs: dict[str, TrainerRun], times: dict[str, list[float]], sparsities: list[float]
) -> None:
    special = {1: "update", 2: "after"}  # timed round -> what happens in it (see docstring)

    def ordinary(name: str) -> list[float]:
        return [t for i, t in enumerate(times[name]) if i not in special]

    med = {name: median_ms(ordinary(name)) for name in times}
    low = {name: min_ms(ordinary(name)) for name in times}
    dense = med["cpu dense"]
    print(f"\ncpu dense (no sparsity): median {dense:.1f} ms, min {low['cpu dense']:.1f} ms\n")
    print(
        f"{'sparsity':>8} {'cpu ms':>8} {'wse ms':>8} {'speedup':>8} {'(min)':>7} "
        f"{'vs dense':>8} {'update cpu/wse ms':>18} {'after cpu/wse ms':>17} {'wse FLOPs':>10}"
    )
    for s in sparsities:
        cpu, wse = f"cpu {s:.2f}", f"wse {s:.2f}"
        stats = runs[wse].trainer.accelerator.stats
        flops = stats.total_flops
        executed = sum(c[0] for c in flops.values()) / sum(c[1] for c in flops.values())
        upd = f"{1e3 * times[cpu][1]:.0f}/{1e3 * times[wse][1]:.0f}"
        aft = f"{1e3 * times[cpu][2]:.0f}/{1e3 * times[wse][2]:.0f}"
        print(
            f"{s:>8.2f} {med[cpu]:>8.1f} {med[wse]:>8.1f} {med[cpu] / med[wse]:>7.2f}x "
            f"{low[cpu] / low[wse]:>6.2f}x {dense / med[wse]:>7.2f}x {upd:>18} {aft:>17} "
            f"{executed:>10.3f}"
        )
    print(
        "\nspeedup = cpu / wse at the same sparsity (median of ordinary steps; (min) = ratio of "
        "minimums); vs dense = cpu dense / wse; update = the RigL update step (dense weight "
        "gradients), after = the step after it (CSR rebuild); wse FLOPs = executed / dense-"
        "equivalent Linear FLOPs over the whole run (WSEStats)."
    )
    wse_run = runs.get(f"wse {GOAL_SPARSITY:.2f}")
    if wse_run is not None:
        stats = wse_run.trainer.accelerator.stats
        print(
            f"wse {GOAL_SPARSITY}: {stats.total_rebuilds} CSR builds, "
            f"{1e3 * stats.total_rebuild_seconds:.1f} ms in all"
        )
        choices = sorted({(k[2], k[3], k[5], v) for k, v in autotune_choices().items()})
        print(
            "kernel paths chosen by 'auto' (shape, density bucket 4*log2(density), grad): "
            + ", ".join(
                f"{shape} {bucket} {'fwd+bwd' if grad else 'fwd'} -> {path}"
                for shape, bucket, grad, path in choices
            )
        )
        ratio = med[f"cpu {GOAL_SPARSITY:.2f}"] / med[f"wse {GOAL_SPARSITY:.2f}"]
        verdict = "PASS" if ratio >= GOAL else "FAIL"
        print(
            f"\ngoal: wse / cpu speedup at {GOAL_SPARSITY:.0%} >= {GOAL}x: {ratio:.2f}x {verdict}"
        )


if __name__ == "__main__":
    main()
