"""A 51M-parameter Llama on the emulated wafer-scale device versus the cpu path: memory and speed.

The model: `LitCausalLM` with dim 1024, 4 layers, 4 heads, vocab 256, seq 128 (51.1M
parameters: 28 masked projections of 50.6M, embeddings and head dense), batch 4 x 128, fp32,
the module's AdamW (fused); sparsity `Static` (random masks) or `RigL` on the 28
``*layers.*_proj.weight`` matrices.

``memory``: one fresh process per variant, each runs ``--steps`` optimizer steps of
``Trainer.fit`` and reports its peak RSS (``getrusage`` of the process: the whole training
process, model construction included) and, measured at the last step's
``on_before_optimizer_step`` (gradients present, optimizer state allocated), the bytes the masked
layers hold: weights (or kept values and CSR indices), gradients and optimizer state (the
tensors' ``nbytes``; the algorithms' bool masks listed apart). Variants: ``dense`` (cpu, no
sparsity), ``cpu`` (masked dense training), ``wse`` (compact training state, the default) and
``wse-dense-state`` (``WSEAccelerator(compact=False)``). Goals at 90%: masked layers' weights +
gradients + state on the device <= 0.2x the cpu path's; peak RSS <= 0.6x the cpu path's
(<= 0.65x with ``--kind rigl``).
``--kind rigl --update-every 3`` puts a RigL mask update (dense gradients, masks rebuilt) at
step 3 and adds its step time. ``--live`` runs the children with glibc's mmap threshold fixed at
64 KiB, so a freed block leaves the process: peak RSS is then what was live at the peak, apart
from the free heap space glibc keeps by default (steps run slower; memory figures only).
``--plain`` runs ``cpu`` and ``wse`` beside ``plain-cpu`` and ``plain-wse``: a plain-PyTorch
loop over the same model, optimizer and batches, masked dense or inside
``on_wse(model, optimizer=...)`` (compact training without Lightning); the goals then compare
``plain-wse`` with ``plain-cpu``.

``speed``: the cpu path and the device at each sparsity (plus a dense cpu run), every Trainer in
one process, stepped round-robin with the order shuffled each round (`_harness.run_interleaved`);
median and minimum step time. ``--busy`` starts one busy-looping process pinned to CPU 0
(``taskset -c 0``) for the whole measurement. Goals: 90% >= 3.5x, 95% >= 5x the cpu path; with
one busy process >= 1.5x.

    python benchmarks/bench_wse_large.py memory [--sparsity 0.9] [--steps 6]
    python benchmarks/bench_wse_large.py memory --kind rigl --update-every 3 [--live]
    python benchmarks/bench_wse_large.py memory --plain [--kind rigl --update-every 3]
    python benchmarks/bench_wse_large.py speed [--sparsities 0.9,0.95] [--steps 7] [--busy]
    python benchmarks/bench_wse_large.py {memory,speed} --quick   # tiny model, smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import (
    SteppedFit,
    lm_loss,
    load_average,
    machine_facts,
    make_batches,
    median_ms,
    min_ms,
    quiet,
    run_interleaved,
)

from lightning_sparse import RigL, Static
from lightning_sparse.models import LitCausalLM
from lightning_sparse.models.llama import LlamaConfig
from lightning_sparse.wse import WSEAccelerator, on_wse

MODEL = dict(vocab_size=256, dim=1024, n_layers=4, n_heads=4, max_seq_len=128)
QUICK = dict(vocab_size=256, dim=64, n_layers=1, n_heads=2, max_seq_len=16)
FILTER = ["*layers.*_proj.weight"]
BATCH = 4
VARIANTS = ("dense", "cpu", "wse", "wse-dense-state")
PLAIN_VARIANTS = ("cpu", "wse", "plain-cpu", "plain-wse")
GOALS = {"state": 0.2, "rss": 0.6, "rss_rigl": 0.65, 0.9: 3.5, 0.95: 5.0, "busy": 1.5}


def algorithm(kind: str, sparsity: float, every: int = 100) -> Any:
    if kind == "rigl":
        return RigL(
            sparsity, update={"freq": every}, drop_fraction=0.3, param_filter=FILTER, seed=0
        )
    return Static(sparsity, param_filter=FILTER, seed=0)


def accelerator(variant: str) -> Any:
    if variant.startswith("wse"):
        return WSEAccelerator(compact=variant == "wse")
    return "cpu"


class HeldBytes(pl.Callback):
    """Bytes the masked layers hold at the last step's ``on_before_optimizer_step``."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step
        self.figures: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any):
        if trainer.global_step != self.last_step:
            return
        algorithms = [c for c in trainer.callbacks if hasattr(c, "sparse_params")]
        executor = getattr(trainer.accelerator, "executor", None)
        self.figures = held_bytes(algorithms, optimizer, executor)


def held_bytes(algorithms: list[Any], optimizer: Any, executor: Any) -> dict[str, int]:
    """Bytes the masked layers of ``algorithms`` hold now, by kind."""
    state_of = optimizer.state
    compact = getattr(executor, "compact", None)
    figures = dict.fromkeys(("weights", "indices", "grads", "state", "masks", "dense"), 0)
    for alg in algorithms:
        for sp in alg.sparse_params.values():
            param = sp.param
            figures["masks"] += sp.mask.nbytes
            figures["dense"] += param.numel() * param.element_size()
            layer = None if compact is None else _compact_of(compact, param)
            if layer is not None:
                held = layer.nbytes()
                figures["weights"] += held["values"]
                figures["grads"] += held["grad"]
                figures["state"] += held["state"]
                figures["indices"] += held["indices"]
                continue
            figures["weights"] += param.untyped_storage().nbytes()
            figures["grads"] += 0 if param.grad is None else param.grad.nbytes
            figures["state"] += sum(
                v.nbytes for v in state_of.get(param, {}).values() if torch.is_tensor(v)
            )
            csr = _csr_of(executor, sp.module)
            figures["indices"] += 0 if csr is None else csr.nbytes
    return figures


def _compact_of(compact: Any, param: torch.Tensor) -> Any:
    for layer in compact.layers.values():
        if layer.compact is not None and layer.compact.weight is param:
            return layer.compact
    return None


def _csr_of(executor: Any, module: torch.nn.Module) -> Any:
    if executor is None:
        return None
    from lightning_sparse.wse.layer import STATE as _STATE

    state = _STATE.get(module)
    return None if state is None else state.csr


def child(
    variant: str, sparsity: float, kind: str, steps: int, quick: bool, threads: int, every: int
) -> None:
    """One training process: prints a JSON line of its figures."""
    torch.set_num_threads(threads)
    quiet()
    cfg = QUICK if quick else MODEL
    torch.manual_seed(0)
    module = LitCausalLM(**cfg, lr=1e-3, warmup_steps=0)
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if variant.startswith("plain"):
        plain_child(variant, module, sparsity, kind, steps, cfg, every, rss_model)
        return
    held = HeldBytes(steps - 1)
    callbacks: list[Any] = [held]
    if variant != "dense":
        callbacks.append(algorithm(kind, sparsity, every))
    batches = make_batches(LlamaConfig(**cfg), steps, BATCH, cfg["max_seq_len"], 0)
    times: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - self.start)

    trainer = pl.Trainer(
        accelerator=accelerator(variant), devices=1, max_steps=steps,
        callbacks=[*callbacks, Timer()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({
        "variant": variant, "peak_rss_kb": rss, "rss_after_model_kb": rss_model,
        "held": held.figures, "step_s": times,
    }))  # fmt: skip


def plain_child(
    variant: str, module: Any, sparsity: float, kind: str, steps: int, cfg: dict, every: int,
    rss_model: int,
) -> None:  # fmt: skip
    """The plain-PyTorch loop of the same model, optimizer (`LitCausalLM`'s fused AdamW, decay
    on matrices) and batches: ``plain-cpu`` masked dense, ``plain-wse`` inside
    ``on_wse(model, optimizer=...)`` (compact training without Lightning)."""
    model = module.model
    decay = [p for p in model.parameters() if p.ndim >= 2 and p is not model.embed_tokens.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3, fused=True,
    )  # fmt: skip
    sparse = algorithm(kind, sparsity, every)
    module.apply(sparse)  # the names the Lightning run's masks are drawn by
    sparse.apply(optimizer)
    batches = make_batches(LlamaConfig(**cfg), steps, BATCH, cfg["max_seq_len"], 0)
    times: list[float] = []
    figures: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        executor = None
        if variant == "plain-wse":
            executor = stack.enter_context(on_wse(model, optimizer=optimizer))
        for step, batch in enumerate(batches):
            start = time.perf_counter()
            loss = lm_loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            if step == steps - 1:
                figures = held_bytes([sparse], optimizer, executor)
            optimizer.step()
            times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({
        "variant": variant, "peak_rss_kb": rss, "rss_after_model_kb": rss_model,
        "held": figures, "step_s": times,
    }))  # fmt: skip


def run_child(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "_child", variant, "--sparsity", str(args.sparsity),
        "--kind", args.kind, "--steps", str(args.steps), "--threads", str(args.threads),
        "--update-every", str(args.update_every),
    ] + (["--quick"] if args.quick else [])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    if args.live:  # glibc: every block of 64 KiB or more is mmapped, so a free unmaps it
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(args: argparse.Namespace) -> None:
    print(machine_facts())
    cfg = QUICK if args.quick else MODEL
    print(
        f"model: Llama {cfg}, batch {BATCH} x {cfg['max_seq_len']}, fp32, AdamW (fused); "
        f"{args.kind} {args.sparsity:.0%} on {FILTER}"
        + (f" (mask update every {args.update_every} steps)" if args.kind == "rigl" else "")
        + f"; {args.steps} steps per process, {args.threads} threads"
        + ("; MALLOC_MMAP_THRESHOLD_=65536 (--live)" if args.live else "")
    )
    update = args.update_every if args.kind == "rigl" and args.update_every < args.steps else None
    variants = PLAIN_VARIANTS if args.plain else VARIANTS
    results = {v: run_child(args, v) for v in variants}
    mb = 1 / 1024
    print(f"\n{'variant':<16} {'peak RSS MB':>11} {'x cpu':>6} {'after model MB':>14} "
          f"{'median step ms':>14}" + (f" {'update step ms':>14}" if update else ""))  # fmt: skip
    cpu_rss = results["cpu"]["peak_rss_kb"]
    for name, r in results.items():
        steps = sorted(r["step_s"][1:]) or r["step_s"]
        print(
            f"{name:<16} {r['peak_rss_kb'] * mb:>11.0f} {r['peak_rss_kb'] / cpu_rss:>6.2f} "
            f"{r['rss_after_model_kb'] * mb:>14.0f} {1e3 * steps[len(steps) // 2]:>14.1f}"
            + (f" {1e3 * r['step_s'][update]:>14.1f}" if update and name != "dense" else "")
        )
    print("\nmasked layers at the last step (MB; masks are the algorithm's, listed apart):")
    print(f"{'variant':<16} {'weights':>8} {'indices':>8} {'grads':>8} {'state':>8} "
          f"{'total':>8} {'x cpu':>6} {'masks':>7}")  # fmt: skip
    cpu_total = _total(results["cpu"]["held"])
    for name, r in results.items():
        h = r["held"]
        if not h:
            continue
        total = _total(h)
        print(
            f"{name:<16} {h['weights'] / 2**20:>8.1f} {h['indices'] / 2**20:>8.1f} "
            f"{h['grads'] / 2**20:>8.1f} {h['state'] / 2**20:>8.1f} {total / 2**20:>8.1f} "
            f"{total / cpu_total:>6.3f} {h['masks'] / 2**20:>7.1f}"
        )
    if args.plain:
        cpu_rss = results["plain-cpu"]["peak_rss_kb"]
        cpu_total = _total(results["plain-cpu"]["held"])
    device = "plain-wse" if args.plain else "wse"
    state = _total(results[device]["held"]) / cpu_total
    rss = results[device]["peak_rss_kb"] / cpu_rss
    print("\nplain loop, plain-wse against plain-cpu:" if args.plain else "")
    print(f"goal: masked layers' weights + grads + state, {device} / cpu <= {GOALS['state']}: "
          f"{state:.3f} {'PASS' if state <= GOALS['state'] else 'FAIL'}")  # fmt: skip
    goal = GOALS["rss_rigl" if args.kind == "rigl" else "rss"]  # issue 27.3: RigL's own goal
    print(f"goal: peak RSS, {device} / cpu <= {goal}: {rss:.2f} "
          f"{'PASS' if rss <= goal else 'FAIL'}")  # fmt: skip
    print(f"load average after the run: {load_average()}")


def _total(held: dict[str, int]) -> int:
    return held["weights"] + held["indices"] + held["grads"] + held["state"]


class Run(SteppedFit):
    def __init__(
        self, variant: str, sparsity: float | None, kind: str, cfg: dict, batches: list, clock: Any
    ) -> None:
        torch.manual_seed(0)
        module = LitCausalLM(**cfg, lr=1e-3, warmup_steps=0)
        callbacks = [] if sparsity is None else [algorithm(kind, sparsity)]
        super().__init__(module, callbacks, batches, clock, accelerator=accelerator(variant))


def speed(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    quiet()
    cfg = QUICK if args.quick else MODEL
    sparsities = [float(s) for s in args.sparsities.split(",")]
    batches = make_batches(LlamaConfig(**cfg), args.warmup + args.steps, BATCH,
                           cfg["max_seq_len"], 0)  # fmt: skip
    hog = None
    if args.busy:
        hog = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
        time.sleep(1.0)
    print(machine_facts())
    print(
        f"model: Llama {cfg}, batch {BATCH} x {cfg['max_seq_len']}, fp32, AdamW (fused); "
        f"{args.kind} on {FILTER}; {args.warmup} warm-up + {args.steps} timed steps, "
        f"round-robin; {args.threads} threads, {args.clock} clock"
        f"{'; one busy process on CPU 0' if hog else ''}"
    )
    runs: dict[str, Run] = {}
    try:
        clock = time.thread_time if args.clock == "thread" else time.perf_counter
        if not args.no_dense:
            runs["cpu dense"] = Run("dense", None, args.kind, cfg, batches, clock)
        for s in sparsities:
            runs[f"cpu {s:.2f}"] = Run("cpu", s, args.kind, cfg, batches, clock)
            runs[f"wse {s:.2f}"] = Run("wse", s, args.kind, cfg, batches, clock)
        times = run_interleaved(runs, batches, args.warmup, args.steps)
    finally:
        for run in runs.values():
            run.close()
        if hog is not None:
            hog.kill()
            hog.wait()
    med = {n: median_ms(t) for n, t in times.items()}
    low = {n: min_ms(t) for n, t in times.items()}
    print(f"\n{'variant':<10} {'median ms':>10} {'min ms':>8}")
    for name in times:
        print(f"{name:<10} {med[name]:>10.1f} {low[name]:>8.1f}")
    for s in sparsities:
        ratio = med[f"cpu {s:.2f}"] / med[f"wse {s:.2f}"]
        ratio_min = low[f"cpu {s:.2f}"] / low[f"wse {s:.2f}"]
        goal = GOALS["busy"] if args.busy else GOALS.get(s)
        verdict = (
            "" if goal is None else f" (goal >= {goal}x: {'PASS' if ratio >= goal else 'FAIL'})"
        )
        print(f"wse / cpu at {s:.0%}: {ratio:.2f}x median, {ratio_min:.2f}x min{verdict}")
    print(f"load average after the run: {load_average()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("memory", "speed", "_child"))
    parser.add_argument("variant", nargs="?", choices=VARIANTS + PLAIN_VARIANTS[2:])
    parser.add_argument(
        "--plain", action="store_true",
        help="memory: the plain-PyTorch loop (on_wse(model, optimizer=...)) beside Lightning's",
    )  # fmt: skip
    parser.add_argument("--sparsity", type=float, default=0.9, help="memory: the sparsity")
    parser.add_argument("--sparsities", default="0.9,0.95", help="speed: comma-separated")
    parser.add_argument("--kind", choices=("static", "rigl"), default="static")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--update-every", type=int, default=100,
        help="RigL's update cadence (memory --kind rigl --update-every 3: an update at step 3)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--busy", action="store_true", help="speed: beside one busy process")
    parser.add_argument(
        "--clock", choices=("wall", "thread"), default="wall",
        help="speed: wall clock, or the trainer thread's CPU time (meaningful with --threads 1)",
    )  # fmt: skip
    parser.add_argument("--no-dense", action="store_true", help="speed: skip the dense cpu run")
    parser.add_argument("--quick", action="store_true", help="tiny model (smoke run)")
    parser.add_argument(
        "--live", action="store_true",
        help="memory: children run with MALLOC_MMAP_THRESHOLD_=65536 (glibc), so freed blocks "
        "leave the process and peak RSS is what was live at the peak, not what the allocator "
        "kept; slower steps",
    )  # fmt: skip
    args = parser.parse_args()
    if args.steps is None:
        args.steps = {"memory": 6, "speed": 7, "_child": 6}[args.mode]
    if args.mode == "_child":
        child(args.variant, args.sparsity, args.kind, args.steps, args.quick, args.threads,
              args.update_every)  # fmt: skip
    elif args.mode == "memory":
        memory(args)
    else:
        speed(args)


if __name__ == "__main__":
    main()
