"""Per-step cost of sparsity on a CUDA GPU: a ~100M-parameter Llama, bf16 autocast, AdamW.

One process builds every variant from the same seed (same initial weights, same batches, all on
the GPU before timing starts) and times them one step each per round, in a new order each
round (`_harness.run_interleaved`). Each timed step is bracketed by ``torch.cuda.synchronize()``,
so it measures the GPU work of the whole step, not just its launch; the report gives medians.

1. ``dense``        forward + backward under ``torch.autocast("cuda", torch.bfloat16)``, AdamW.
2. ``static``       the same with ``Static(0.8)`` applied to the model and the optimizer.
3. ``rigl``         ``RigL(0.8, update={"freq": 100})``: ordinary (non-update) steps.
4. ``rigl update``  update steps: before each (untimed) the algorithm's state is loaded with
   ``step=100``, so the gradient hooks leave the gradient dense and ``sparsity.update()`` runs
   between backward and ``optimizer.step()`` (timed on its own too, synchronized).

Goals: ``static / dense <= 1.02``; one RigL ``update() / dense step <= 0.25``; RigL amortized over
an update every 100 steps, ``(99 * ordinary + update step) / 100 / dense <= 1.02``. It exits 0
whatever the verdicts, and with "skipped: no CUDA" (also 0) on a machine without a GPU.

    python benchmarks/bench_gpu_step.py                  # ~100M Llama, batch 8 x 512
    python benchmarks/bench_gpu_step.py --adamw default  # PyTorch's default (foreach) AdamW
    python benchmarks/bench_gpu_step.py --quick          # small model, few steps: smoke run
    python benchmarks/bench_gpu_step.py --quick --device cpu   # the same code on the CPU (CI)

``--device cpu`` runs the same loop on the CPU (bf16 autocast there too): its figures mean
nothing, it only shows the script works before a GPU is lent (`gpu_check.sh --dry-run`). Progress
(model builds, each warm-up step, every tenth round) goes to stderr, so a run stopped at a time
limit says where it was.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from collections.abc import Callable

import torch
from _harness import (
    LlamaConfig,
    adamw,
    build_model,
    lm_loss,
    loop_parser,
    machine_facts,
    make_batches,
    median_ms,
    print_ratio_table,
    quiet,
    run_interleaved,
)
from torch import nn

from lightning_sparse import RigL, SparsityAlgorithm, Static

SPARSITY = 0.8
DROP_FRACTION = 0.3
FREQ = 100
STATIC_GOAL = 1.02  # Static(0.8) step / dense step
UPDATE_GOAL = 0.25  # one RigL update() / dense step
AMORTIZED_GOAL = 1.02  # (99 ordinary + 1 update step) / 100 / dense step
# ~100M parameters: 12 blocks of width 768 (85M in the projections, the sparse weights) and a
# vocabulary of 8192 (6.3M each in the embedding and the output head, both kept dense).
FULL = dict(vocab_size=8192, dim=768, n_layers=12, n_heads=12, max_seq_len=512)
QUICK = dict(vocab_size=1024, dim=256, n_layers=2, n_heads=4, max_seq_len=128)


def make_algorithm(name: str) -> SparsityAlgorithm:
    if name == "static":
        return Static(SPARSITY, seed=0)
    return RigL(SPARSITY, update={"freq": FREQ}, drop_fraction=DROP_FRACTION, seed=0)


def arm_update(algorithm: SparsityAlgorithm) -> None:
    """Make the next optimizer step an update step (the counters as if ``FREQ`` steps had run and
    none updated). Not through ``load_state_dict``: that round trip packs every mask on the host
    and loads it back (0.4 s a round for the 85M masked weights on a CPU)."""
    algorithm.step, algorithm.last_update_step = FREQ, -1


SYNCED = ", each step bracketed by torch.cuda.synchronize()"


def progress(line: str) -> None:
    print(f"bench_gpu_step: {line}", file=sys.stderr, flush=True)


class CudaRun:
    """A plain bf16-autocast training loop on the model's device; `step(batch)` returns its
    seconds, each step bracketed by a synchronize on a GPU.

    Args:
        model: the model on the GPU, sparsified if the variant is sparse.
        optimizer: AdamW over its parameters (sparsity hooks installed if sparse).
        before_step: run between backward and ``optimizer.step()``, timed on its own
            (``extra``, synchronized): a mask update driven by hand.
        prepare: run before each step, outside the timed region.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        before_step: Callable[[], object] | None = None,
        prepare: Callable[[], object] | None = None,
    ) -> None:
        self.net, self.optimizer = model, optimizer
        self.before_step, self.prepare = before_step, prepare
        self.extra: list[float] = []
        self.device = next(model.parameters()).device
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None

    def step(self, batch: torch.Tensor) -> float:
        if self.prepare is not None:
            self.prepare()
        self.sync()
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = lm_loss(self.net, batch)
        loss.backward()
        if self.before_step is not None:
            self.sync()
            begin = time.perf_counter()
            self.before_step()
            self.sync()
            self.extra.append(time.perf_counter() - begin)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - start

    def reset_records(self) -> None:
        self.extra.clear()


def sparse_run(
    cfg: LlamaConfig, seed: int, fused: bool, name: str, updates: bool, device: str
) -> tuple[CudaRun, SparsityAlgorithm]:
    model = build_model(cfg, seed).to(device)
    algorithm = make_algorithm(name)
    model.apply(algorithm)
    optimizer = adamw(model.parameters(), fused)
    algorithm.apply(optimizer)
    if not updates:
        return CudaRun(model, optimizer), algorithm
    # update() by hand between backward and optimizer.step(), timed on its own; the step
    # pre-hook's own update() call then finds this step done and only prunes with the new masks.
    run = CudaRun(
        model, optimizer, before_step=algorithm.update, prepare=lambda: arm_update(algorithm)
    )
    return run, algorithm


def verdict(ratio: float, goal: float) -> str:
    return "PASS" if ratio <= goal else "FAIL"


def gpu_facts(device: str) -> str:
    if device == "cpu":
        return "no GPU: --device cpu, a smoke run of the script (its figures mean nothing)"
    props = torch.cuda.get_device_properties(0)
    return (
        f"GPU {torch.cuda.get_device_name(0)!r} ({props.total_memory / 2**30:.0f} GiB, "
        f"{torch.cuda.device_count()} visible), CUDA {torch.version.cuda}, torch "
        f"{torch.__version__}, date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        "UTC"
    )


def main() -> None:
    parser = loop_parser(__doc__.splitlines()[0])
    parser.set_defaults(steps=30, warmup=5, batch=8, seq=512)
    parser.add_argument(
        "--adamw", choices=("fused", "default"), default="fused", help="AdamW implementation"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small model, few steps (smoke run)")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the same loop on the CPU, with --quick only (a smoke run; figures mean nothing)",
    )
    args = parser.parse_args()
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu is a smoke run of the script: add --quick")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"skipped: no CUDA (torch {torch.__version__}, torch.cuda.is_available() is False)")
        sys.exit(0)
    shape = QUICK if args.quick else FULL
    if args.quick:
        args.batch, args.seq, args.steps, args.warmup = 2, 64, 3, 1
    if args.steps < 1 or args.warmup < 0 or args.warmup + args.steps >= FREQ:
        parser.error(
            f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0, with fewer than "
            f"{FREQ} in all (the ordinary RigL run must not reach its first update step)"
        )
    quiet()
    fused = args.adamw == "fused"
    cfg = LlamaConfig(**{**shape, "max_seq_len": max(args.seq, shape["max_seq_len"])})
    batches = [
        b.to(args.device)
        for b in make_batches(cfg, args.warmup + args.steps, args.batch, args.seq, args.seed)
    ]
    print(machine_facts())
    print(gpu_facts(args.device))
    began = time.perf_counter()
    dense_model = build_model(cfg, args.seed).to(args.device)
    n_sparse = sum(p.numel() for *_, p in make_algorithm("rigl").select(dense_model))
    print(
        f"model Llama dim {cfg.dim} x {cfg.n_layers} layers, vocab {cfg.vocab_size} "
        f"({dense_model.num_params() / 1e6:.1f}M params, {n_sparse / 1e6:.1f}M in the sparse "
        f"weights), batch {args.batch} x seq {args.seq}, bf16 autocast, AdamW({args.adamw}); "
        f"sparsity {SPARSITY}, RigL drop_fraction {DROP_FRACTION} every {FREQ} steps; "
        f"{args.warmup} warm-up + {args.steps} timed rounds, round-robin, order shuffled each "
        f"round{SYNCED if args.device == 'cuda' else ''}\n"
    )
    runs: dict[str, CudaRun] = {
        "dense": CudaRun(dense_model, adamw(dense_model.parameters(), fused))
    }
    algorithms: dict[str, SparsityAlgorithm] = {}
    for name, kind, updates in (
        ("static", "static", False),
        ("rigl", "rigl", False),
        ("rigl update", "rigl", True),
    ):
        runs[name], algorithms[name] = sparse_run(cfg, args.seed, fused, kind, updates, args.device)
    progress(f"built {len(runs)} variants in {time.perf_counter() - began:.1f} s")
    times = run_interleaved(runs, batches, args.warmup, args.steps, progress)

    print_ratio_table(times, {name: "dense" for name in times})
    dense = median_ms(times["dense"])
    for name, algorithm in algorithms.items():
        _, actual = algorithm.overall_sparsity()
        print(f"  sparsity check: {name} {float(actual):.3f}")

    print(f"\ngoal: Static / dense <= {STATIC_GOAL}")
    ratio = median_ms(times["static"]) / dense
    print(f"  Static / dense = {ratio:.3f}  {verdict(ratio, STATIC_GOAL)}")

    update = runs["rigl update"].extra
    print(f"\ngoal: one RigL update() / dense step <= {UPDATE_GOAL}")
    ratio = median_ms(update) / dense
    print(
        f"  rigl update / dense = {ratio:.3f}  {verdict(ratio, UPDATE_GOAL)}  "
        f"(update() median {median_ms(update):.1f} ms, min {1e3 * min(update):.1f} ms)"
    )

    print(
        "\ngoal: RigL amortized (99 * ordinary step + update step) / 100 / dense <= "
        f"{AMORTIZED_GOAL}"
    )
    ordinary, update_step = median_ms(times["rigl"]), median_ms(times["rigl update"])
    ratio = ((FREQ - 1) * ordinary + update_step) / FREQ / dense
    print(
        f"  rigl amortized = {ratio:.3f}  {verdict(ratio, AMORTIZED_GOAL)}  "
        f"(ordinary {ordinary / dense:.3f}, update step {update_step / dense:.3f})"
    )
    spread = statistics.pstdev(times["dense"]) / statistics.mean(times["dense"])
    peak = (
        f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        if args.device == "cuda"
        else ""
    )
    print(f"\ndense step spread (std / mean over {args.steps} rounds): {spread:.3f}{peak}")


if __name__ == "__main__":
    main()
