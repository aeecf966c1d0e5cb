"""Per-step training cost of `Static(sparsity=0.8)` versus dense, in plain PyTorch and Lightning.

One process builds every variant once (same seed, so the same initial weights; the same batches)
and times them step by step in round-robin order, rotating the order each round, so background
load hits every variant alike. Each variant reports the median over the timed rounds and
``ratio = median(variant) / median(dense)``, where "dense" is the dense run of the same framework:

1. ``dense``            plain loop: forward, backward, AdamW step.
2. ``static``           the same loop with ``model.apply(s); s.apply(optimizer)``.
3. ``lightning dense`` / ``lightning static``: ``Trainer.fit`` of a ``LitCausalLM`` without and
   with ``callbacks=[Static(0.8)]``. Each Trainer runs in its own thread, parked between steps;
   a step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (one optimizer step).
4. ``torch.ao``         ``torch.ao.pruning.WeightNormSparsifier`` (unstructured: block (1, 1))
   on the same Linear layers, ``sparsifier.step()`` after every optimizer step; for comparison.

Every variant uses the same optimizer: ``torch.optim.AdamW(params, lr=1e-3)``, PyTorch's default
implementation, or the fused kernel with ``--fused``. The goal is ``Static / dense <= 1.03`` both
in the plain loop and under Lightning. The benchmark exits 0 whether or not the goal is met.

    python benchmarks/bench_step_cost.py [--steps 21] [--batch 8] [--seq 128] [--threads 2]
    python benchmarks/bench_step_cost.py --quick     # tiny model, a few steps: a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import lightning  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_sparse.algorithms.static import Static  # noqa: E402
from lightning_sparse.models.lit_lm import LitCausalLM  # noqa: E402
from lightning_sparse.models.llama import Llama, LlamaConfig  # noqa: E402

SPARSITY = 0.8
GOAL = 1.03
LR = 1e-3
PHASES = ("forward", "backward", "optimizer")


def adamw(params: Iterable[torch.Tensor], fused: bool) -> torch.optim.AdamW:
    """The optimizer of every variant: PyTorch's default AdamW, or its fused kernel."""
    return torch.optim.AdamW(params, lr=LR, **({"fused": True} if fused else {}))


def build_model(cfg: LlamaConfig, seed: int) -> Llama:
    torch.manual_seed(seed)  # same seed, same initial weights in every variant
    return Llama(cfg)


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


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of batch [B, T + 1], as `LitCausalLM.loss` computes it."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


# ---------------------------------------------------------------------- plain PyTorch variants
class PlainRun:
    """A plain training loop; `step(batch)` runs one optimizer step and returns its seconds.

    Args:
        model: the model, already sparsified (or prepared) if the variant needs it.
        optimizer: AdamW over the model's parameters, with any sparsity hooks installed.
        after_step: called after every optimizer step inside the timed region (torch.ao's
            ``sparsifier.step()``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        after_step: Callable[[], Any] | None = None,
    ) -> None:
        self.net, self.optimizer, self.after_step = model, optimizer, after_step
        self.phases: list[tuple[float, float, float]] = []  # seconds per step, as PHASES

    def step(self, batch: torch.Tensor) -> float:
        start = time.perf_counter()
        # 1. forward
        loss = lm_loss(self.net, batch)
        forward = time.perf_counter()
        # 2. backward (a sparse variant's post-accumulate-grad hooks run here)
        loss.backward()
        backward = time.perf_counter()
        # 3. optimizer step (Static's step pre/post hooks run inside it), then clear gradients
        self.optimizer.step()
        if self.after_step is not None:
            self.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        self.phases.append((forward - start, backward - forward, end - backward))
        return end - start

    def close(self) -> None:
        pass


def plain_dense(cfg: LlamaConfig, seed: int, fused: bool) -> PlainRun:
    model = build_model(cfg, seed)
    return PlainRun(model, adamw(model.parameters(), fused))


def plain_static(cfg: LlamaConfig, seed: int, fused: bool) -> PlainRun:
    model = build_model(cfg, seed)
    sparsity = Static(sparsity=SPARSITY)
    model.apply(sparsity)
    optimizer = adamw(model.parameters(), fused)
    sparsity.apply(optimizer)
    return PlainRun(model, optimizer)


def plain_torch_ao(cfg: LlamaConfig, seed: int, fused: bool) -> PlainRun:
    from torch.ao.pruning import WeightNormSparsifier

    model = build_model(cfg, seed)
    names = sparse_names(model)
    sparsifier = WeightNormSparsifier(
        sparsity_level=SPARSITY, sparse_block_shape=(1, 1), zeros_per_block=1
    )
    sparsifier.prepare(model, config=[{"tensor_fqn": name} for name in names])
    sparsifier.step()  # start at the target sparsity, as the other sparse variants do
    optimizer = adamw(model.parameters(), fused)  # after prepare: it owns the parametrized weights
    return PlainRun(model, optimizer, after_step=sparsifier.step)


# ---------------------------------------------------------------------- Lightning variants
class BenchLM(LitCausalLM):
    """`LitCausalLM` (its loss, logging and loop) with the plain loops' optimizer, no schedule."""

    def __init__(self, model: nn.Module, fused: bool) -> None:
        super().__init__(model=model, lr=LR)
        self.fused = fused

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.parameters(), self.fused)


class StepGate(pl.Callback):
    """Runs a Trainer one optimizer step at a time on the driver's signal, timing each step.

    The trainer thread parks in ``on_train_batch_end`` (and before the first batch) until the
    driver releases it, so the loop's own work between batches (fetching the next batch) runs
    while the driver waits, never beside another variant's timed step.
    """

    def __init__(self) -> None:
        self.ready = threading.Semaphore(0)  # trainer -> driver: reached the first batch
        self.go = threading.Semaphore(0)  # driver -> trainer: run one step
        self.done = threading.Semaphore(0)  # trainer -> driver: step finished (or fit failed)
        self.elapsed = 0.0
        self.started = False
        self.error: BaseException | None = None
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.started:
            self.started = True
            self.ready.release()
            self.go.acquire()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.elapsed = time.perf_counter() - self._start
        self.done.release()
        self.go.acquire()


class LightningRun:
    """``Trainer.fit`` in a background thread, stepped one optimizer step at a time."""

    def __init__(
        self,
        cfg: LlamaConfig,
        seed: int,
        fused: bool,
        batches: list[torch.Tensor],
        sparse: bool,
    ) -> None:
        self.gate = StepGate()
        self.module = BenchLM(build_model(cfg, seed), fused)
        # The gate goes last so the sparsity callback's batch-end work is inside the timed step.
        callbacks = ([Static(sparsity=SPARSITY)] if sparse else []) + [self.gate]
        self.trainer = pl.Trainer(
            callbacks=callbacks,
            accelerator="cpu",
            devices=1,
            max_steps=len(batches),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = DataLoader(batches, batch_size=None, shuffle=False)  # the plain loops' batches
        self.thread = threading.Thread(target=self._fit, args=(loader,), daemon=True)
        self.thread.start()
        self._wait(self.gate.ready)

    @property
    def net(self) -> nn.Module:
        return self.module.model

    def _fit(self, loader: DataLoader) -> None:
        try:
            self.trainer.fit(self.module, train_dataloaders=loader)
        except BaseException as error:  # noqa: BLE001 - handed to the driver thread
            self.gate.error = error
        finally:
            self.gate.ready.release()
            self.gate.done.release()

    def _wait(self, semaphore: threading.Semaphore) -> None:
        semaphore.acquire()
        if self.gate.error is not None:
            raise RuntimeError("the Lightning run failed") from self.gate.error

    def step(self, batch: torch.Tensor) -> float:
        """One optimizer step (the trainer draws the same ``batch`` from its loader)."""
        self.gate.go.release()
        self._wait(self.gate.done)
        return self.gate.elapsed

    def close(self) -> None:
        self.gate.go.release()  # let the parked trainer leave its last step and finish
        self.thread.join(timeout=60)


# ---------------------------------------------------------------------- driver and report
def machine_facts() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"date {datetime.datetime.now().isoformat(timespec='seconds')}; CPU {cpu!r}, {cores} "
        f"cores visible, torch threads {torch.get_num_threads()}; load average {load_average()}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, lightning "
        f"{lightning.__version__}"
    )


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def run_interleaved(
    runs: dict[str, PlainRun | LightningRun],
    batches: list[torch.Tensor],
    warmup: int,
    steps: int,
) -> dict[str, list[float]]:
    """Warm up every run, then time ``steps`` rounds of one step each, rotating the order."""
    names = list(runs)
    for i in range(warmup):
        for name in names:
            runs[name].step(batches[i])
    for run in runs.values():
        if isinstance(run, PlainRun):
            run.phases.clear()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(steps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(runs[name].step(batches[warmup + r]))
    return times


def report(times: dict[str, list[float]], baseline: dict[str, str]) -> None:
    med = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    low = {name: 1e3 * min(ts) for name, ts in times.items()}
    print(f"{'variant':<18} {'median ms':>10} {'ratio':>7} {'min ms':>8} {'min ratio':>9}  vs")
    for name in times:
        base = baseline[name]
        print(
            f"{name:<18} {med[name]:>10.1f} {med[name] / med[base]:>7.3f} {low[name]:>8.1f} "
            f"{low[name] / low[base]:>9.3f}  {base}"
        )
    print(f"\ngoal: Static / dense <= {GOAL} (plain and Lightning)")
    for name, label in (("static", "plain"), ("lightning static", "Lightning")):
        ratio = med[name] / med[baseline[name]]
        verdict = "PASS" if ratio <= GOAL else "FAIL"
        print(f"  {label:<10} Static / dense = {ratio:.3f}  {verdict}")
    ratio = med["torch.ao"] / med[baseline["torch.ao"]]
    print(f"  torch.ao   WeightNormSparsifier / dense = {ratio:.3f}  (for comparison)")


def report_phases(runs: dict[str, PlainRun | LightningRun]) -> None:
    plain = {name: run for name, run in runs.items() if isinstance(run, PlainRun)}
    print("\nplain loops by phase, median ms (backward includes grad hooks; optimizer includes")
    print("step hooks, zero_grad and, for torch.ao, sparsifier.step())")
    print(f"{'variant':<18} " + " ".join(f"{p:>10}" for p in PHASES))
    for name, run in plain.items():
        cols = zip(*run.phases, strict=True)
        print(f"{name:<18} " + " ".join(f"{1e3 * statistics.median(c):>10.1f}" for c in cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--preset", default="small", help="LlamaConfig preset")
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True) everywhere")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 16, 3, 1
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Lightning's dataloader-worker advice, torch.ao notices
    for name in ("lightning.pytorch", "lightning.fabric"):  # "GPU available: ..." and such
        logging.getLogger(name).setLevel(logging.ERROR)

    cfg = LlamaConfig.from_preset(args.preset, max_seq_len=max(args.seq, 16))
    generator = torch.Generator().manual_seed(args.seed)
    n_batches = args.warmup + args.steps
    batches = [
        torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=generator)
        for _ in range(n_batches)
    ]
    print(machine_facts())
    print(
        f"model Llama preset {args.preset!r} ({build_model(cfg, args.seed).num_params() / 1e6:.2f}M"
        f" params), batch {args.batch} x seq {args.seq}, fp32, "
        f"AdamW({'fused' if args.fused else 'default'}), sparsity {SPARSITY}; {args.warmup} "
        f"warm-up + {args.steps} timed steps per variant, round-robin, order rotated each round"
    )
    runs: dict[str, PlainRun | LightningRun] = {
        "dense": plain_dense(cfg, args.seed, args.fused),
        "static": plain_static(cfg, args.seed, args.fused),
        "torch.ao": plain_torch_ao(cfg, args.seed, args.fused),
    }
    try:
        for name, sparse in (("lightning dense", False), ("lightning static", True)):
            runs[name] = LightningRun(cfg, args.seed, args.fused, batches, sparse)
        times = run_interleaved(runs, batches, args.warmup, args.steps)
    finally:
        for run in runs.values():
            run.close()

    names = sparse_names(build_model(cfg, args.seed))
    print(
        "\nzeros in the sparsifiable Linear weights after the run: "
        + ", ".join(f"{name} {zero_fraction(run.net, names):.3f}" for name, run in runs.items())
    )
    for name, run in runs.items():
        if isinstance(run, LightningRun) and run.trainer.global_step != n_batches:
            print(f"WARNING: {name} ran {run.trainer.global_step} steps, expected {n_batches}")
    print()
    report(
        times,
        baseline={
            "dense": "dense",
            "static": "dense",
            "torch.ao": "dense",
            "lightning dense": "dense",
            "lightning static": "lightning dense",
        },
    )
    report_phases(runs)
    print(f"\nload average after the run: {load_average()}")


if __name__ == "__main__":
    main()
