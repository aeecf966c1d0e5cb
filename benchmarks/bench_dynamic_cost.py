"""Per-step cost of dynamic sparsity (`RigL`, `SET` at 0.8, masks updated every 100 steps).

One process builds every variant from the same seed (same initial weights, same batches) and
times them in round-robin order, in a new order each round (`_harness.run_interleaved`):

1. ``dense``            plain loop: forward, backward, AdamW step.
2. ``rigl`` / ``set``   the same loop with ``model.apply(s); s.apply(optimizer)`` and
   ``update={"freq": 100}``: ordinary (non-update) steps.
3. ``rigl update`` / ``set update``: update steps. Before each (untimed) the algorithm's state is
   loaded with ``step=100`` (``load_state_dict``), so the step is an update step: RigL's gradient
   hooks leave the gradient dense, ``sparsity.update()`` runs between backward and
   ``optimizer.step()`` (timed on its own too) and the step pre-hook prunes gradients and
   optimizer state with the new masks.
4. ``masks only`` rows: on a RigL / SET model whose dense gradients are fresh (forward and
   backward untimed), ``compute_masks()`` alone (the masks, without installing them or their
   statistics) and a naive baseline: per layer ``torch.topk`` over ``where(mask, |w|, -inf)`` +
   scatter for the drop, ``torch.topk`` over ``where(kept, -inf, |grad|)`` + scatter for the grow.

Goals (issue 3, item 10): ``update() / dense step <= 0.25`` and, amortized over an update every
100 steps, ``(99 * ordinary step + update step) / 100 / dense <= 1.05``, both for RigL and SET.
The benchmark exits 0 whether or not the goals are met.

    python benchmarks/bench_dynamic_cost.py                  # AdamW(fused=True)
    python benchmarks/bench_dynamic_cost.py --adamw default  # PyTorch's default CPU AdamW
    python benchmarks/bench_dynamic_cost.py --cpu-time       # one thread, CPU time: load-robust
    python benchmarks/bench_dynamic_cost.py --quick          # tiny model, a few steps: smoke run
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from _harness import (
    LlamaConfig,
    PlainRun,
    adamw,
    build_model,
    lm_loss,
    load_average,
    loop_parser,
    machine_facts,
    make_batches,
    median_ms,
    min_ms,
    print_phases,
    print_ratio_table,
    quiet,
    run_interleaved,
)

from lightning_sparse import SET, RigL
from lightning_sparse.core.algorithms import DynamicSparsityAlgorithm

SPARSITY = 0.8
DROP_FRACTION = 0.3
FREQ = 100
UPDATE_GOAL = 0.25  # one update() <= a quarter of a dense step
AMORTIZED_GOAL = 1.05  # (99 ordinary steps + 1 update step) / 100 <= 1.05 dense steps
ALGORITHMS: dict[str, type[DynamicSparsityAlgorithm]] = {"rigl": RigL, "set": SET}


def make_algorithm(name: str) -> DynamicSparsityAlgorithm:
    return ALGORITHMS[name](sparsity=SPARSITY, drop_fraction=DROP_FRACTION, update={"freq": FREQ})


def arm_update(algorithm: DynamicSparsityAlgorithm) -> None:
    """Make the next optimizer step an update step (state as if ``FREQ`` steps had run)."""
    algorithm.load_state_dict({**algorithm.state_dict(), "step": FREQ, "last_update_step": -1})


def sparse_run(
    cfg: LlamaConfig,
    seed: int,
    fused: bool,
    name: str,
    updates: bool,
    clock: Callable[[], float],
) -> PlainRun:
    """A plain loop under ``name``; with ``updates`` every timed step is an update step."""
    model = build_model(cfg, seed)
    algorithm = make_algorithm(name)
    model.apply(algorithm)
    optimizer = adamw(model.parameters(), fused)
    algorithm.apply(optimizer)
    if not updates:
        return PlainRun(model, optimizer, clock=clock)
    # update() by hand between backward and optimizer.step() so it is timed on its own; the
    # step pre-hook's own update() call then finds this step done and only syncs the optimizer.
    return PlainRun(
        model,
        optimizer,
        before_step=algorithm.update,
        prepare=lambda: arm_update(algorithm),
        clock=clock,
    )


# ---------------------------------------------------------------------- update work alone
def naive_drop_and_grow(algorithm: DynamicSparsityAlgorithm) -> None:
    """Naive per-layer RigL masks: two full-size ``torch.topk`` calls and scatters per layer."""
    with torch.no_grad():
        for sp in algorithm.sparse_params.values():
            weight, grad, mask = sp.param, sp.param.grad, sp.mask
            n_active = int((1.0 - SPARSITY) * weight.numel())  # the mask's exact count
            n_kept = int((1.0 - DROP_FRACTION) * n_active)
            drop_score = torch.where(mask, weight.abs(), -torch.inf).flatten()
            kept = torch.zeros(weight.numel(), dtype=torch.bool)
            kept[torch.topk(drop_score, n_kept).indices] = True
            grow_score = torch.where(kept, -torch.inf, grad.abs().flatten())
            kept[torch.topk(grow_score, n_active - n_kept).indices] = True
            kept.view_as(mask)


class MasksOnly:
    """Times functions of a sparse model whose dense gradients are fresh; nothing changes.

    Each ``step(batch)`` runs forward and backward untimed (the algorithm is armed, so RigL's
    gradients stay dense), then times each function once; ``times[name]`` collects seconds.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        seed: int,
        name: str,
        functions: dict[str, Callable[[DynamicSparsityAlgorithm], object]],
        clock: Callable[[], float],
    ) -> None:
        self.net = build_model(cfg, seed)
        self.algorithm = make_algorithm(name)
        self.net.apply(self.algorithm)
        arm_update(self.algorithm)  # no optimizer step runs, so the step stays an update step
        self.functions, self.clock = functions, clock
        self.times: dict[str, list[float]] = {label: [] for label in functions}

    def step(self, batch: torch.Tensor) -> float:
        lm_loss(self.net, batch).backward()
        total = 0.0
        for label, fn in self.functions.items():
            start = self.clock()
            fn(self.algorithm)
            elapsed = self.clock() - start
            self.times[label].append(elapsed)
            total += elapsed
        self.net.zero_grad(set_to_none=True)
        return total

    def reset_records(self) -> None:
        for values in self.times.values():
            values.clear()


def compute_masks(algorithm: DynamicSparsityAlgorithm) -> object:
    with torch.no_grad():
        targets = {n: algorithm.target_sparsity(n, algorithm.step) for n in algorithm.sparse_params}
        return algorithm.compute_masks(targets)


# ---------------------------------------------------------------------- report
def verdict(ratio: float, goal: float) -> str:
    return "PASS" if ratio <= goal else "FAIL"


def report(
    times: dict[str, list[float]], runs: dict[str, PlainRun], alone: dict[str, MasksOnly]
) -> None:
    print_ratio_table(times, {name: "dense" for name in times})
    dense = median_ms(times["dense"])

    print(f"\none mask update, median (min) ms, and / dense step {dense:.1f} ms")
    rows: list[tuple[str, list[float], str]] = []
    for name in ALGORITHMS:
        rows.append((f"{name} update()", runs[f"{name} update"].extra, "in real update steps"))
        rows.append((f"{name} compute_masks()", alone[name].times["compute_masks"], "masks only"))
    rows.append(("naive top-k", alone["rigl"].times["naive"], "RigL-style, masks only"))
    for label, values, note in rows:
        ms = median_ms(values)
        print(f"  {label:<24} {ms:7.1f} ({min_ms(values):6.1f})  {ms / dense:6.3f}  {note}")

    print(f"\ngoal: one update() / dense step <= {UPDATE_GOAL}")
    for name in ALGORITHMS:
        ratio = median_ms(runs[f"{name} update"].extra) / dense
        print(f"  {name:<5} update / dense = {ratio:.3f}  {verdict(ratio, UPDATE_GOAL)}")
    naive = median_ms(alone["rigl"].times["naive"]) / dense
    print(f"  naive top-k / dense = {naive:.3f}  (for comparison)")

    print(f"\ngoal: amortized (99 * ordinary step + update step) / 100 / dense <= {AMORTIZED_GOAL}")
    for name in ALGORITHMS:
        ordinary, update_step = median_ms(times[name]), median_ms(times[f"{name} update"])
        ratio = ((FREQ - 1) * ordinary + update_step) / FREQ / dense
        print(
            f"  {name:<5} amortized = {ratio:.3f}  {verdict(ratio, AMORTIZED_GOAL)}  "
            f"(ordinary {ordinary / dense:.3f}, update step {update_step / dense:.3f})"
        )

    backward = {name: median_ms([p[1] for p in run.phases]) for name, run in runs.items()}
    print(
        "\nno extra backward on RigL's update steps (its hooks only leave the gradient dense): "
        f"backward {backward['rigl update']:.1f} ms on update steps, {backward['rigl']:.1f} ms "
        f"on ordinary steps (ratio {backward['rigl update'] / backward['rigl']:.3f}), "
        f"dense {backward['dense']:.1f} ms"
    )
    print_phases(
        runs,
        "backward includes grad hooks; optimizer includes update(),\nstep hooks and zero_grad",
    )


def main() -> None:
    parser = loop_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--adamw", choices=("fused", "default"), default="fused", help="AdamW implementation"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="one torch thread, timed by its CPU time (time.thread_time): robust to other load",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 16, 3, 1
    if args.steps < 1 or args.warmup < 0 or args.warmup + args.steps >= FREQ:
        parser.error(
            f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0, with fewer than "
            f"{FREQ} in all (the ordinary runs must not reach their first update step)"
        )
    if args.cpu_time:
        args.threads = 1
    torch.set_num_threads(args.threads)
    quiet()
    fused = args.adamw == "fused"
    clock = time.thread_time if args.cpu_time else time.perf_counter

    width = {} if args.dim is None else {"dim": args.dim}
    cfg = LlamaConfig.from_preset(args.preset, max_seq_len=max(args.seq, 16), **width)
    batches = make_batches(cfg, args.warmup + args.steps, args.batch, args.seq, args.seed)
    print(machine_facts())
    model = build_model(cfg, args.seed)
    n_sparse = sum(p.numel() for *_, p in make_algorithm("rigl").select(model))
    print(
        f"model Llama preset {args.preset!r} ({model.num_params() / 1e6:.2f}M params, "
        f"{n_sparse / 1e6:.2f}M in the sparse weights), batch {args.batch} x seq {args.seq}, "
        f"fp32, AdamW({args.adamw}); RigL / SET sparsity {SPARSITY}, drop_fraction "
        f"{DROP_FRACTION}, update every {FREQ} steps; {args.warmup} warm-up + {args.steps} "
        "timed rounds, round-robin, order shuffled each round; "
        + ("CPU time of the one torch thread" if args.cpu_time else "wall clock")
        + "\n"
    )
    runs = {"dense": PlainRun(model, adamw(model.parameters(), fused), clock=clock)}
    for name in ALGORITHMS:
        runs[name] = sparse_run(cfg, args.seed, fused, name, False, clock)
    for name in ALGORITHMS:
        runs[f"{name} update"] = sparse_run(cfg, args.seed, fused, name, True, clock)
    rigl_functions = {"compute_masks": compute_masks, "naive": naive_drop_and_grow}
    alone = {
        "rigl": MasksOnly(cfg, args.seed, "rigl", rigl_functions, clock),
        "set": MasksOnly(cfg, args.seed, "set", {"compute_masks": compute_masks}, clock),
    }
    times = run_interleaved(
        {**runs, **{f"{name} masks only": run for name, run in alone.items()}},
        batches,
        args.warmup,
        args.steps,
    )
    times = {name: times[name] for name in runs}
    report(times, runs, alone)
    print(f"\nload average after the run: {load_average()}")


if __name__ == "__main__":
    main()
