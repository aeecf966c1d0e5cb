"""Training step of the RigL Llama recipe model: ``accelerator="wse"`` versus ``"cpu"``.

Every variant is a ``Trainer.fit`` of `LitCausalLM` with the recipe's model (``recipes/
rigl_llama.yaml``: dim 128, 4 layers, 4 heads, seq 128, batch 16, vocab 256, fused AdamW with the
warmup-cosine schedule) and the recipe's RigL callback (random init, drop fraction 0.3 cosine,
the 28 ``*layers.*_proj.weight`` matrices) at each sparsity of the curve, once on the CPU
accelerator (masked dense training) and once on the emulated wafer-scale device. A dense CPU run
(no callback) is the reference. All Trainers live in one process, each in its own thread, parked
between steps; one step of each runs per round, order shuffled every round, and a step is timed
from ``on_train_batch_start`` to ``on_train_batch_end`` (every callback's batch-end work inside).

RigL updates at step 0 (sparse start, as in the recipe) and once more at step ``warmup + 1``
instead of every 50 steps, so the timed rounds hold one update step (dense weight gradients) and
one step after it (the device rebuilds its CSR structures); both are reported on their own and
left out of the medians of ordinary steps.

    python benchmarks/bench_wse_training.py [--steps 11] [--warmup 3] [--threads 2]
    python benchmarks/bench_wse_training.py --quick     # smoke run: tiny model, 3 steps
    python benchmarks/bench_wse_training.py --sparsities 0.9 --breakdown   # + Amdahl breakdown

Goal: wse at 90% >= 1.5x the cpu accelerator at 90% (ratio of median ordinary steps).
"""

from __future__ import annotations

import argparse
import functools
import time
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
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the 28 sparse layers alone at 90%% (Amdahl bound of the step speedup)",
    )
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
        "timed steps per variant, round-robin, order shuffled each round"
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
    if args.breakdown and f"wse {GOAL_SPARSITY:.2f}" in runs:
        ordinary = [t for i, t in enumerate(times[f"cpu {GOAL_SPARSITY:.2f}"]) if i not in (1, 2)]
        wse_ordinary = [
            t for i, t in enumerate(times[f"wse {GOAL_SPARSITY:.2f}"]) if i not in (1, 2)
        ]
        breakdown(cfg, args.batch * seq, median_ms(ordinary), median_ms(wse_ordinary))
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
        choices = sorted({(k[2], k[3], k[5], k[6], v) for k, v in autotune_choices().items()})
        print(
            "kernel paths chosen by 'auto' (shape, density bucket 4*log2(density), grad, mode: "
            "kept = dense is plain F.linear under the algorithm, compact = the layer trains its "
            "kept values): "
            + ", ".join(
                f"{shape} {bucket} {'fwd+bwd ' + mode if grad else 'fwd'} -> {path}"
                for shape, bucket, grad, mode, path in choices
            )
        )
        ratio = med[f"cpu {GOAL_SPARSITY:.2f}"] / med[f"wse {GOAL_SPARSITY:.2f}"]
        verdict = "PASS" if ratio >= GOAL else "FAIL"
        print(
            f"\ngoal: wse / cpu speedup at {GOAL_SPARSITY:.0%} >= {GOAL}x: {ratio:.2f}x {verdict}"
        )


_CATEGORIES = {  # aten operator name fragments -> part of the step
    "matmul (all Linear layers, head included)": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention (SDPA)": ("scaled_dot_product",),
    "loss (log-softmax, NLL)": ("log_softmax", "nll_loss"),
    "optimizer (fused AdamW)": ("adamw", "_foreach"),
}


def rest_by_operator(cfg: dict[str, int], tokens: int, cpu_ms: float) -> str:
    """Self CPU time per part of one plain-PyTorch dense step of the same model (no Lightning,
    no sparsity: torch.profiler over 3 steps), against the Lightning cpu step at 90%."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_sparse.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    seq = cfg["max_seq_len"]
    batch = torch.randint(0, cfg["vocab_size"], (max(tokens // seq, 1), seq + 1))

    def step() -> None:
        optimizer.zero_grad()
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(3):
        step()
    plain_ms = (time.perf_counter() - start) / 3 * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    parts = dict.fromkeys(
        [*_CATEGORIES, "elementwise (norms, RoPE, SwiGLU, residuals) + rest"], 0.0
    )
    total = 0.0
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        ms = event.self_cpu_time_total / 1e3 / 3
        total += ms
        part = next(
            (c for c, keys in _CATEGORIES.items() if any(k in event.key for k in keys)), None
        )
        parts[part or "elementwise (norms, RoPE, SwiGLU, residuals) + rest"] += ms
    shares = ", ".join(f"{name} {ms / total:.0%}" for name, ms in parts.items())
    return (
        f"plain dense step (no Lightning, no sparsity) {plain_ms:.1f} ms; Lightning + RigL + "
        f"masking around it: {cpu_ms - plain_ms:.1f} ms of the cpu step; aten self time by part: "
        f"{shares}"
    )


def _gathers(csr: Any, weight: torch.Tensor) -> None:
    """The device's per-step value gathers of one layer (forward and backward: CSR order)."""
    csr.gather_values(weight)
    csr.gather_values(weight)


def breakdown(cfg: dict[str, int], tokens: int, cpu_ms: float, wse_ms: float) -> None:
    """Amdahl's law for the step at 90%: the 28 masked Linear layers timed alone (fwd+bwd at the
    step's token count, 15 interleaved repeats, minimums), dense as the cpu accelerator runs them
    (plain ``F.linear``: its algorithm keeps pruned weights at 0) against what the device runs
    (the path "auto" picks with ``zeros_kept``), plus the device's per-step value gathers; the
    rest of the step (attention, norms, SwiGLU, embeddings, head, loss, optimizer, Lightning) is
    the cpu step minus its layers."""
    from bench_sparse_linear import _interleaved_medians, _step_fn

    from lightning_sparse.wse import CSRWeight, resolve_path

    cfg_full = LlamaConfig(**cfg)
    dim, hidden = cfg_full.dim, cfg_full.ffn_hidden
    shapes = {
        (dim, dim): 4,
        (hidden, dim): 2,
        (dim, hidden): 1,
    }  # per block: q k v o, gate up, down
    generator = torch.Generator().manual_seed(0)
    dense_total = sparse_total = gather_total = 0.0
    print(f"\nbreakdown at {GOAL_SPARSITY:.0%}, {tokens} tokens, per layer fwd+bwd (ms):")
    for (out_features, in_features), count in shapes.items():
        count *= cfg["n_layers"]
        x = torch.randn(tokens, in_features, generator=generator).requires_grad_()
        weight = torch.randn(out_features, in_features, generator=generator).requires_grad_()
        bias = None
        grad_y = torch.randn(tokens, out_features, generator=generator)
        mask = torch.rand(out_features, in_features, generator=generator) >= GOAL_SPARSITY
        csr = CSRWeight.from_dense(weight, mask)
        path = resolve_path(x, weight, csr, "auto", zeros_kept=True)
        fns = {
            "dense": _step_fn(None, x, weight, bias, csr, grad_y),
            "device": _step_fn(None if path == "dense" else path, x, weight, bias, csr, grad_y),
            "gathers": functools.partial(_gathers, csr, weight.detach()),
        }
        # Minimums: each layer's intrinsic cost, the least disturbed by other processes.
        medians = _interleaved_medians(fns, 15, time.perf_counter, min)
        dense_total += count * medians["dense"] * 1e3
        sparse_total += count * medians["device"] * 1e3
        if path == "dense":  # plain F.linear gathers nothing
            medians["gathers"] = 0.0
        gather_total += count * medians["gathers"] * 1e3
        print(
            f"  {out_features}x{in_features} x{count}: dense {1e3 * medians['dense']:.2f}, "
            f"device ({path}) {1e3 * medians['device']:.2f}, of which value gathers "
            f"{1e3 * medians['gathers']:.3f}"
        )
    rest = cpu_ms - dense_total
    print(rest_by_operator(cfg, tokens, cpu_ms))
    if rest <= 0:
        print(f"cpu step {cpu_ms:.1f} ms <= its layers alone {dense_total:.1f} ms: too noisy")
        return
    print(
        f"per step: masked layers dense {dense_total:.1f} ms, on the device {sparse_total:.1f} ms "
        f"(value gathers {gather_total:.1f} ms); cpu step {cpu_ms:.1f} ms = layers "
        f"{dense_total:.1f} + rest {rest:.1f}; predicted wse step rest + device layers = "
        f"{rest + sparse_total:.1f} ms (measured {wse_ms:.1f}); predicted speedup "
        f"{cpu_ms / (rest + sparse_total):.2f}x; bound with free sparse layers "
        f"{cpu_ms / rest:.2f}x"
    )


if __name__ == "__main__":
    main()
