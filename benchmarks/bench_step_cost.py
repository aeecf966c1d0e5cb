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

The goal is ``Static / dense <= 1.03`` both in the plain loop and under Lightning. The benchmark
exits 0 whether or not the goal is met.

    python benchmarks/bench_step_cost.py [--steps 21] [--batch 4] [--seq 128] [--threads 2]
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
from collections.abc import Callable
from pathlib import Path

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


# ---------------------------------------------------------------------- plain PyTorch variants
def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of batch [B, T + 1] (the loss `LitCausalLM` trains on)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


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
        after_step: Callable[[], None] | None = None,
    ) -> None:
        self.model, self.optimizer, self.after_step = model, optimizer, after_step
        self.phases: list[tuple[float, float, float]] = []  # forward, backward, optimizer

    def step(self, batch: torch.Tensor) -> float:
        start = time.perf_counter()
        # 1. forward
        loss = lm_loss(self.model, batch)
        forward = time.perf_counter()
        # 2. backward (a sparse variant's post-accumulate-grad hooks run here)
        loss.backward()
        backward = time.perf_counter()
        # 3. optimizer step (Static's step pre/post hooks run here), then clear gradients
        self.optimizer.step()
        if self.after_step is not None:
            self.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        self.phases.append((forward - start, backward - forward, end - backward))
        return end - start

    def close(self) -> None:
        pass

    @property
    def net(self) -> nn.Module:
        return self.model


def build_model(cfg: LlamaConfig, seed: int) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def plain_dense(cfg: LlamaConfig, seed: int) -> PlainRun:
    model = build_model(cfg, seed)
    return PlainRun(model, torch.optim.AdamW(model.parameters(), lr=LR))


def plain_static(cfg: LlamaConfig, seed: int) -> PlainRun:
    model = build_model(cfg, seed)
    sparsity = Static(sparsity=SPARSITY)
    model.apply(sparsity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    sparsity.apply(optimizer)
    return PlainRun(model, optimizer)


def plain_torch_ao(cfg: LlamaConfig, seed: int) -> PlainRun:
    from torch.ao.pruning import WeightNormSparsifier

    model = build_model(cfg, seed)
    names = [name for name, *_ in Static(sparsity=SPARSITY).select(model)]  # the same layers
    sparsifier = WeightNormSparsifier(
        sparsity_level=SPARSITY, sparse_block_shape=(1, 1), zeros_per_block=1
    )
    sparsifier.prepare(model, config=[{"tensor_fqn": name} for name in names])
    sparsifier.step()  # start at the target sparsity, as the other sparse variants do
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after prepare: parametrized weights
    return PlainRun(model, optimizer, after_step=sparsifier.step)


# ---------------------------------------------------------------------- Lightning variants
class StepGate(pl.Callback):
    """Runs a Trainer one optimizer step at a time on the driver's signal, timing each step.

    The trainer thread parks in ``on_train_batch_end`` (and before the first batch) until the
    driver releases it, so the loop's own work between batches (fetching the next batch) runs
    while the driver waits, never beside another variant's timed step.
    """

    def __init__(self) -> None:
        self.ready = threading.Semaphore(0)  # the trainer reached its first batch
        self.go = threading.Semaphore(0)  # driver -> trainer: run one step
        self.done = threading.Semaphore(0)  # trainer -> driver: step finished (or failed)
        self.elapsed = 0.0
        self.started = False
        self.error: BaseException | None = None
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if not self.started:
            self.started = True
            self.ready.release()
            self.go.acquire()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.elapsed = time.perf_counter() - self._start
        self.done.release()
        self.go.acquire()


class LightningRun:
    """``Trainer.fit`` in a background thread, stepped one optimizer step at a time."""

    def __init__(
        self, cfg: LlamaConfig, seed: int, batches: list[torch.Tensor], sparse: bool
    ) -> None:
        self.gate = StepGate()
        model = build_model(cfg, seed)
        self.module = LitCausalLM(model=model, lr=LR, warmup_steps=1, max_steps=len(batches))
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
        loader = DataLoader(batches, batch_size=None, shuffle=False)
        self.thread = threading.Thread(target=self._fit, args=(loader,), daemon=True)
        self.thread.start()
        self._wait(self.gate.ready)

    def _fit(self, loader: DataLoader) -> None:
        try:
            self.trainer.fit(self.module, train_dataloaders=loader)
        except BaseException as error:  # noqa: BLE001 - reported to the driver thread
            self.gate.error = error
        finally:
            self.gate.ready.release()
            self.gate.done.release()

    def _wait(self, semaphore: threading.Semaphore) -> None:
        semaphore.acquire()
        if self.gate.error is not None:
            raise RuntimeError("the Lightning run failed") from self.gate.error

    def step(self, batch: torch.Tensor) -> float:
        """One optimizer step (the trainer draws ``batch`` itself, in the same order)."""
        self.gate.go.release()
        self._wait(self.gate.done)
        return self.gate.elapsed

    def close(self) -> None:
        self.gate.go.release()  # let the parked trainer finish its last step
        self.thread.join(timeout=60)

    @property
    def net(self) -> nn.Module:
        return self.module.model


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
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (
        f"date {datetime.datetime.now().isoformat(timespec='seconds')}; CPU {cpu!r}, {cores} "
        f"cores visible, torch threads {torch.get_num_threads()}; load average {load}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, lightning "
        f"{lightning.__version__}"
    )


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
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(steps):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
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
        if name in med:
            ratio = med[name] / med[baseline[name]]
            verdict = "PASS" if ratio <= GOAL else "FAIL"
            print(f"  {label:<10} Static / dense = {ratio:.3f}  {verdict}")
    if "torch.ao" in med:
        ratio = med["torch.ao"] / med[baseline["torch.ao"]]
        print(f"  torch.ao   WeightNormSparsifier / dense = {ratio:.3f}  (for comparison)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--preset", default="small", help="LlamaConfig preset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 16, 3, 1
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
    n_params = build_model(cfg, args.seed).num_params()
    print(
        f"model Llama preset {args.preset!r} ({n_params / 1e6:.2f}M params), batch {args.batch} x "
        f"seq {args.seq}, fp32, AdamW, sparsity {SPARSITY}; {args.warmup} warm-up + "
        f"{args.steps} timed steps per variant, interleaved round-robin (order rotated each round)"
    )
    runs: dict[str, PlainRun | LightningRun] = {
        "dense": plain_dense(cfg, args.seed),
        "static": plain_static(cfg, args.seed),
        "torch.ao": plain_torch_ao(cfg, args.seed),
    }
    try:
        runs["lightning dense"] = LightningRun(cfg, args.seed, batches, sparse=False)
        runs["lightning static"] = LightningRun(cfg, args.seed, batches, sparse=True)
        times = run_interleaved(runs, batches, args.warmup, args.steps)
    finally:
        for run in runs.values():
            run.close()
    baseline = {
        "dense": "dense",
        "static": "dense",
        "torch.ao": "dense",
        "lightning dense": "dense",
        "lightning static": "lightning dense",
    }
    names = [name for name, *_ in Static(sparsity=SPARSITY).select(build_model(cfg, args.seed))]
    print("\nzeros in the sparsified Linear weights after the run: " + ", ".join(
        f"{name} {zero_fraction(run.net, names):.3f}" for name, run in runs.items()
    ))
    for name, run in runs.items():
        if isinstance(run, LightningRun) and run.trainer.global_step != n_batches:
            print(f"WARNING: {name} ran {run.trainer.global_step} steps, expected {n_batches}")
    print()
    report(times, baseline)
    print(f"\nmachine load average after the run: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
