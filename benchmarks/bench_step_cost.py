"""Per-step training cost of `Static(sparsity=0.8)` versus dense, in plain PyTorch and Lightning.

Every variant is built once (same seed, so the same initial weights; the same batches) and timed
step by step, one step of each per round in a new order each round, so background load hits
every variant alike. The plain loops run in this process; each Lightning variant runs in a
process of its own (`_harness.IsolatedRun`), since a Trainer parked in a thread here would slow
the plain loops. Each variant reports the median over the timed rounds and
``ratio = median(variant) / median(dense)``, where "dense" is the dense run of the same framework:

1. ``dense``            plain loop: forward, backward, AdamW step.
2. ``static``           the same loop with ``model.apply(s); s.apply(optimizer)``.
3. ``lightning dense`` / ``lightning static``: ``Trainer.fit`` of a ``LitCausalLM`` without and
   with ``callbacks=[Static(0.8)]``. Each Trainer runs in a process of its own, parked between
   steps;
   a step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (one optimizer step).
4. ``dense again``      a second, identical dense loop: ``dense again / dense`` is the run's
   noise floor (what two identical loops differ by under the machine's load).
5. ``torch.ao``         ``torch.ao.pruning.WeightNormSparsifier`` (unstructured: block (1, 1))
   on the same Linear layers, ``sparsifier.step()`` after every optimizer step; for comparison.

Last, where the static loop's time over dense goes: each per-step pass of `StepHooks` (the
gradients in backward, the weights before the step and, with the default AdamW, Adam's pruned
denominators held at 1.0 and released) timed where it runs, the bytes it moves, and the floor:
what the passes would cost at this machine's memory bandwidth (``a.add_(b)`` over 64 MB tensors),
so ``(dense + floor) / dense`` is the best ratio any design that makes these passes can reach.

Every variant uses the same optimizer: ``torch.optim.AdamW(params, lr=1e-3)``, PyTorch's default
implementation, or the fused kernel with ``--fused``. The goal is ``Static / dense <= 1.03`` both
in the plain loop and under Lightning. The benchmark exits 0 whether or not the goal is met.

    python benchmarks/bench_step_cost.py [--steps 21] [--batch 8] [--seq 128] [--threads 2]
    python benchmarks/bench_step_cost.py --fused     # AdamW(fused=True), as LitCausalLM uses
    python benchmarks/bench_step_cost.py --cpu-time  # 1 thread, CPU time: robust to load
    python benchmarks/bench_step_cost.py --quick     # tiny model, a few steps: a smoke run
    python benchmarks/bench_step_cost.py --hold-ab [--dim 1024 --steps 7 --warmup 2]
        # adds "static no hold": the A/B of holding Adam's pruned denominators at 1.0
"""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from _harness import (
    LR,
    IsolatedRun,
    LlamaConfig,
    PlainRun,
    SteppedFit,
    adamw,
    build_model,
    load_average,
    loop_parser,
    machine_facts,
    make_batches,
    median_ms,
    print_phases,
    print_ratio_table,
    quiet,
    run_interleaved,
)
from torch import nn

from lightning_sparse import Static
from lightning_sparse.models.lit_lm import LitCausalLM

SPARSITY = 0.8
GOAL = 1.03
Clock = Callable[[], float]


def sparse_names(model: nn.Module) -> list[str]:
    """Names of the weights `Static` sparsifies by default (the Linear layers of the blocks)."""
    return [name for name, *_ in Static(sparsity=SPARSITY).select(model)]


def zero_fraction(model: nn.Module, names: list[str]) -> float:
    """Fraction of zeros over the named weights as the forward pass sees them (parametrized too)."""
    zeros = total = 0
    with torch.no_grad():
        for name in names:
            owner, _, attr = name.rpartition(".")
            weight = getattr(model.get_submodule(owner), attr)
            zeros += int((weight == 0).sum())
            total += weight.numel()
    return zeros / total


# ---------------------------------------------------------------------- plain PyTorch variants
def plain_dense(cfg: LlamaConfig, seed: int, fused: bool, clock: Clock) -> PlainRun:
    model = build_model(cfg, seed)
    return PlainRun(model, adamw(model.parameters(), fused), clock=clock)


# The per-step passes of `StepHooks` (core/per_step.py), each over every masked tensor of one
# kind, and the bytes each moves per masked weight (fp32 tensor read and written, bool mask
# read; the hold also writes and reads ``~mask``).
PASSES = {
    "_mask_arrived": ("gradients, in backward", 9),
    "sync": ("weights, before the step", 9),
    "hold_denominators": ("exp_avg_sq held at 1.0", 11),
    "after_step": ("exp_avg_sq released", 9),
}


class StaticRun(PlainRun):
    """A plain loop with `Static`, each of its per-step passes (`PASSES`) timed where it runs:
    wrapped methods of the algorithm's `StepHooks`, the loop's clock."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sparsity: Static,
        clock: Clock,
        fused: bool,
    ) -> None:
        super().__init__(model, optimizer, clock=clock)
        self.masked = sum(sp.mask.numel() for sp in sparsity.sparse_params.values())
        # The fused AdamW needs no held denominators: those two methods then move no bytes.
        names = [n for n in PASSES if not fused or n in ("_mask_arrived", "sync")]
        self.passes: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            method = getattr(sparsity.hooks, name)
            setattr(sparsity.hooks, name, self._timed(method, self.passes[name]))

    def _timed(self, method: Callable[..., None], times: list[float]) -> Callable[..., None]:
        def timed(*args: object) -> None:
            start = self.clock()
            method(*args)
            times.append(self.clock() - start)

        return timed

    def reset_records(self) -> None:
        super().reset_records()
        for times in self.passes.values():
            times.clear()


def plain_static(
    cfg: LlamaConfig, seed: int, fused: bool, clock: Clock, hold: bool = True
) -> StaticRun:
    """``hold=False``: without holding Adam's pruned denominators at 1.0 during the step
    (`StepHooks.hold_denominators` a no-op on this run): the A/B of that choice, ``--hold-ab``."""
    model = build_model(cfg, seed)
    sparsity = Static(sparsity=SPARSITY)
    model.apply(sparsity)
    optimizer = adamw(model.parameters(), fused)
    sparsity.apply(optimizer)
    if not hold:
        sparsity.hooks.hold_denominators = lambda optimizer: None  # type: ignore[method-assign]
    return StaticRun(model, optimizer, sparsity, clock, fused)


def stream_bandwidth(numel: int = 1 << 24, rounds: int = 5) -> float:
    """Bytes per second of ``a.add_(b)`` over ``numel`` fp32 (three bytes-of-``a`` moved:
    ``a`` and ``b`` read, ``a`` written), the best of ``rounds``: the memory bandwidth a pass
    over tensors that are not in cache can reach here."""
    a, b = torch.ones(numel), torch.ones(numel)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - start)
    return 3 * 4 * numel / best


def print_passes(run: StaticRun, dense_ms: float, gap_ms: float, bandwidth: float) -> None:
    """Where the static loop's time over dense goes: each pass's median in the loop, its bytes,
    and what the passes would take at ``bandwidth`` (the floor of a design that makes them)."""
    print(
        f"\nthe static loop's per-step passes over its {run.masked / 1e6:.2f}M masked weights, "
        "timed in the loop (median ms)"
    )
    print(f"{'pass':<28} {'ms':>7} {'MB':>7} {'GB/s':>7}")
    total_ms = total_mb = 0.0
    for name, times in run.passes.items():
        label, per_weight = PASSES[name]
        ms, mb = median_ms(times), per_weight * run.masked / 1e6
        total_ms, total_mb = total_ms + ms, total_mb + mb
        print(f"{label:<28} {ms:>7.2f} {mb:>7.1f} {mb / ms:>7.1f}")
    floor_ms = total_mb * 1e6 / bandwidth * 1e3
    print(
        f"{'all passes':<28} {total_ms:>7.2f} {total_mb:>7.1f} {total_mb / total_ms:>7.1f}\n"
        f"static - dense: {gap_ms:.1f} ms a step, of which the passes {total_ms:.1f} and the "
        f"rest {gap_ms - total_ms:+.1f} (the hooks' Python and the caches the passes evict, "
        "less what the step's arithmetic saves on zeros)\n"
        f"memory bandwidth here (a.add_(b), 64 MB each): {bandwidth / 1e9:.1f} GB/s; at it the "
        f"passes would take {floor_ms:.1f} ms: Static / dense >= "
        f"{(dense_ms + floor_ms) / dense_ms:.3f} for any design that makes these passes"
    )


def plain_torch_ao(cfg: LlamaConfig, seed: int, fused: bool, clock: Clock) -> PlainRun:
    from torch.ao.pruning import WeightNormSparsifier

    model = build_model(cfg, seed)
    names = sparse_names(model)
    sparsifier = WeightNormSparsifier(
        sparsity_level=SPARSITY, sparse_block_shape=(1, 1), zeros_per_block=1
    )
    sparsifier.prepare(model, config=[{"tensor_fqn": name} for name in names])
    sparsifier.step()  # start at the target sparsity, as the other sparse variants do
    optimizer = adamw(model.parameters(), fused)  # after prepare: it owns the parametrized weights
    return PlainRun(model, optimizer, after_step=sparsifier.step, clock=clock)


# ---------------------------------------------------------------------- Lightning variants
class BenchLM(LitCausalLM):
    """`LitCausalLM` (its loss, logging and loop) with the plain loops' optimizer, no schedule."""

    def __init__(self, model: nn.Module, fused: bool) -> None:
        super().__init__(model=model, lr=LR)
        self.fused = fused

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.parameters(), self.fused)


class LightningRun(SteppedFit):
    """``Trainer.fit`` of a `BenchLM` (with ``Static`` if ``sparse``), one step at a time."""

    def __init__(
        self,
        cfg: LlamaConfig,
        seed: int,
        fused: bool,
        batches: list[torch.Tensor],
        sparse: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        callbacks: list[pl.Callback] = [Static(sparsity=SPARSITY)] if sparse else []
        module = BenchLM(build_model(cfg, seed), fused)
        super().__init__(module, callbacks, batches, clock, accelerator="cpu")

    @property
    def net(self) -> nn.Module:
        return self.module.model


def lightning_summary(run: LightningRun) -> dict[str, object]:
    """What the driver reads of a Lightning run after it (in the run's own process)."""
    return {
        "global_step": run.trainer.global_step,
        "zeros": zero_fraction(run.net, sparse_names(run.net)),
    }


# ---------------------------------------------------------------------- driver and report
def report(times: dict[str, list[float]], baseline: dict[str, str]) -> None:
    print_ratio_table(times, baseline)
    med = {name: median_ms(ts) for name, ts in times.items()}
    print(f"\ngoal: Static / dense <= {GOAL} (plain and Lightning)")
    for name, label in (("static", "plain"), ("lightning static", "Lightning")):
        ratio = med[name] / med[baseline[name]]
        verdict = "PASS" if ratio <= GOAL else "FAIL"
        print(f"  {label:<10} Static / dense = {ratio:.3f}  {verdict}")
    ratio = med["torch.ao"] / med[baseline["torch.ao"]]
    print(f"  torch.ao   WeightNormSparsifier / dense = {ratio:.3f}  (for comparison)")
    ratio = med["dense again"] / med[baseline["dense again"]]
    print(f"  noise      dense again / dense = {ratio:.3f}  (two identical dense loops)")


def main() -> None:
    parser = loop_parser(__doc__.splitlines()[0])
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True) everywhere")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="one torch thread, timed in CPU time of the stepping thread (robust to load)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    parser.add_argument(
        "--hold-ab", action="store_true",
        help="add 'static no hold': Static without Adam's pruned denominators held at 1.0",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.preset, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 16, 3, 1
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    if args.cpu_time:
        args.threads = 1
    clock: Clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    quiet()  # Lightning's "GPU available: ..." and dataloader advice, torch.ao notices

    width = {} if args.dim is None else {"dim": args.dim}
    cfg = LlamaConfig.from_preset(args.preset, max_seq_len=max(args.seq, 16), **width)
    n_batches = args.warmup + args.steps
    batches = make_batches(cfg, n_batches, args.batch, args.seq, args.seed)
    print(machine_facts())
    print(
        f"model Llama preset {args.preset!r} ({build_model(cfg, args.seed).num_params() / 1e6:.2f}M"
        f" params), batch {args.batch} x seq {args.seq}, fp32, "
        f"AdamW({'fused' if args.fused else 'default'}), sparsity {SPARSITY}; {args.warmup} "
        f"warm-up + {args.steps} timed steps per variant, round-robin, order shuffled each round; "
        + ("CPU time of the stepping thread" if args.cpu_time else "wall clock")
    )
    runs: dict[str, PlainRun | IsolatedRun] = {
        "dense": plain_dense(cfg, args.seed, args.fused, clock),
        # A second, identical dense loop: its ratio to "dense" is the noise of this run.
        "dense again": plain_dense(cfg, args.seed, args.fused, clock),
        "static": plain_static(cfg, args.seed, args.fused, clock),
        "torch.ao": plain_torch_ao(cfg, args.seed, args.fused, clock),
    }
    if args.hold_ab:
        runs["static no hold"] = plain_static(cfg, args.seed, args.fused, clock, hold=False)
    try:
        for name, sparse in (("lightning dense", False), ("lightning static", True)):
            # Each Trainer in a process of its own (`IsolatedRun`: a parked Trainer thread here
            # would slow the plain loops), stepped in turn with the others.
            runs[name] = IsolatedRun(
                LightningRun,
                (cfg, args.seed, args.fused, batches, sparse, clock),
                args.threads,
                lightning_summary,
            )
        times = run_interleaved(runs, batches, args.warmup, args.steps)
    finally:
        for run in runs.values():
            run.close()

    names = sparse_names(build_model(cfg, args.seed))
    zeros = {
        name: run.summary["zeros"]
        if isinstance(run, IsolatedRun)
        else zero_fraction(run.net, names)
        for name, run in runs.items()
    }
    print(
        "\nzeros in the sparsifiable Linear weights after the run: "
        + ", ".join(f"{name} {value:.3f}" for name, value in zeros.items())
    )
    for name, run in runs.items():
        if isinstance(run, IsolatedRun) and run.summary["global_step"] != n_batches:
            print(f"WARNING: {name} ran {run.summary['global_step']} steps, expected {n_batches}")
    print()
    report(
        times,
        baseline={
            "dense": "dense",
            "dense again": "dense",
            "static": "dense",
            "torch.ao": "dense",
            "lightning dense": "dense",
            "lightning static": "lightning dense",
            "static no hold": "dense",
        },
    )
    print_phases(
        {name: run for name, run in runs.items() if isinstance(run, PlainRun)},
        "backward includes grad hooks; optimizer includes\nstep hooks, zero_grad and, for "
        "torch.ao, sparsifier.step()",
    )
    static = runs["static"]
    assert isinstance(static, StaticRun)
    dense_ms = median_ms(times["dense"])
    print_passes(static, dense_ms, median_ms(times["static"]) - dense_ms, stream_bandwidth())
    print(f"\nload average after the run: {load_average()}")


if __name__ == "__main__":
    main()
