"""Bytes an algorithm adds per masked weight, on the CPU's path and the GPU's.

Beyond the weights and the optimizer's own state, sparsity costs the bool mask (1 B per masked
weight) and, where ITOP is tracked (RigL, SET, GraNet by default), the ever-active set (1 B).
Anything else the algorithm holds across steps is counted too (`held.bytes_per_masked_weight`:
its buffers on the model and every tensor reachable from it that is not the model's or the
optimizer's; 0-d tensors, the last update's figures, cost so much per masked tensor, not per
weight, and are given apart as ``scalars``). The GPU's path is taken on the CPU
(`step_ops.as_on_a_gpu`): it is the path that once kept an integer copy of each mask for the
fused foreach product (4 B per fp32 weight).

A plain loop over the package's `Llama` (every linear weight of the blocks masked, sparsity
0.8, fused AdamW) runs a few steps, a mask update included, in fp32 and in bf16; then the bytes
are counted. Goal (issue 32): at most 1 B, plus 1 B with ITOP, on both paths.

Then the price, the host time of one pruning pass over as many tensors as the model masks
(one thread, the best of 5 rounds of 200 calls), each of 64 elements so that the kernels' own
time is negligible (on a GPU the kernels run asynchronously; the host time is what a
launch-bound step pays): the compiled product the GPU's path runs (`fused_mask`, TorchDynamo's
guards included), ``_foreach_mul_`` by the bool masks (on a GPU a launch per tensor), and the
same by integer copies of the masks (the previous GPU path: one launch, 4 B per fp32 weight).
On the CPU the compiled kernel is not used: it is slower than the CPU's own loop.

With ``--first-steps``, instead: what the compiled product costs on the first steps of a
larger model, where it compiles. Each way runs in a fresh process with an empty TorchInductor
cache (as on a machine just lent): a 12-block Llama (dim 768, 84 masked weights), RigL(0.8)
updating at step 2, fused AdamW, four steps on the GPU's path; the seconds of the build
(`model.apply` prunes) and of each step, and the kernels compiled, chunked as the package does
(`fused_mask.CHUNK`, or ``--chunk``) and unchunked (one kernel over each whole list, as before
2026-11-28; both ways assume no sizes equal).

    python benchmarks/bench_mask_memory.py [--dim 128] [--layers 4]
    python benchmarks/bench_mask_memory.py --first-steps [--dim 768] [--layers 12] [--chunk N]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from benchmarks._harness import machine_facts  # noqa: E402
from benchmarks.held import bytes_per_masked_weight  # noqa: E402
from benchmarks.step_ops import as_on_a_gpu  # noqa: E402
from lightning_sparse import RigL, SparsityAlgorithm, Static  # noqa: E402
from lightning_sparse.models.llama import Llama, LlamaConfig  # noqa: E402

STEPS = 5  # RigL updates at step 4


def algorithm(kind: str) -> SparsityAlgorithm:
    if kind == "static":
        return Static(0.8, seed=0)
    return RigL(0.8, update={"freq": 4}, drop_fraction=0.3, seed=0)


def measure(kind: str, dtype: torch.dtype, gpu_path: bool, dim: int, layers: int) -> str:
    with as_on_a_gpu() if gpu_path else contextlib.nullcontext():
        torch.manual_seed(0)
        model = Llama(LlamaConfig(dim=dim, n_layers=layers, n_heads=4, max_seq_len=32))
        model.to(dtype)
        sparsity = algorithm(kind)
        model.apply(sparsity)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        sparsity.apply(optimizer)
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        for _ in range(STEPS):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        per_weight, kinds = bytes_per_masked_weight(model, sparsity, optimizer)
    itop = "yes" if sparsity.ever_active else "no"
    path = "gpu" if gpu_path else "cpu"
    return (
        f"{kind:<7} {str(dtype).removeprefix('torch.'):<9} {path:<5} {itop:<5} "
        f"{per_weight:>8.2f} {kinds['buffers']:>10} {kinds['held']:>9} {kinds['scalars']:>8}"
    )


def host_time(dim: int, layers: int) -> None:
    """Microseconds of host time per pruning pass over the masked weights, three ways."""
    from lightning_sparse.core.fused_mask import mul_by_masks_

    torch.set_num_threads(1)
    model = Llama(LlamaConfig(dim=dim, n_layers=layers, n_heads=4, max_seq_len=32))
    count = sum(1 for name, p in model.named_parameters() if "layers." in name and p.ndim == 2)
    g = torch.Generator().manual_seed(0)
    views = [torch.randn(8, 8, generator=g).view(torch.int32) for _ in range(count)]
    masks = [torch.rand(8, 8, generator=g) > 0.2 for _ in range(count)]
    copies = [m.to(torch.int32) for m in masks]
    ways = {
        "compiled product (GPU path)": lambda: mul_by_masks_(views, masks),
        "foreach by bool masks (CPU path)": lambda: torch._foreach_mul_(views, masks),
        "foreach by integer copies (before)": lambda: torch._foreach_mul_(views, copies),
    }
    ways["compiled product (GPU path)"]()  # compile
    print(f"\nhost time of one pruning pass over {count} tensors of 64 (us, best of 5 x 200):")
    for name, way in ways.items():
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                way()
            best = min(best, (time.perf_counter() - start) / 200)
        print(f"  {name:<36} {best * 1e6:>8.1f}")


def first_steps_here(dim: int, layers: int, chunk: int) -> None:
    """One way of `--first-steps`, in this process: one line of seconds and compilations."""
    from torch._dynamo.utils import counters

    from lightning_sparse.core import fused_mask

    fused_mask.CHUNK = chunk
    torch.set_num_threads(2)
    cfg = LlamaConfig(vocab_size=8192, dim=dim, n_layers=layers, n_heads=dim // 64, max_seq_len=64)
    with as_on_a_gpu():
        torch.manual_seed(0)
        model = Llama(cfg)
        sparsity = RigL(0.8, update={"freq": 2}, drop_fraction=0.3, seed=0)
        began = time.perf_counter()
        model.apply(sparsity)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        sparsity.apply(optimizer)
        seconds = [time.perf_counter() - began]
        tokens = torch.randint(
            0, cfg.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0)
        )
        for _ in range(4):
            began = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(
                model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - began)
    masked = len(sparsity.sparse_params)
    steps = " ".join(f"{s:6.1f}" for s in seconds)
    print(
        f"{'chunks of ' + str(chunk) if chunk < masked else 'unchunked':<14} {steps}  "
        f"{sum(seconds):7.1f}  {counters['stats']['unique_graphs']:>8}"
    )


def first_steps(dim: int, layers: int, chunk: int | None) -> None:
    """`--first-steps`: each way in a fresh process with an empty TorchInductor cache; chunks of
    ``chunk`` tensors (default: the package's `fused_mask.CHUNK`) against one whole list."""
    import os
    import subprocess
    import tempfile

    from lightning_sparse.core.fused_mask import CHUNK

    print(
        f"first steps on the GPU's path, Llama dim {dim} x {layers} blocks ({7 * layers} masked "
        "weights), RigL(0.8) updating at step 2, fused AdamW, a fresh process and empty "
        "TorchInductor cache each; seconds:"
    )
    print(
        f"{'way':<14} {'build':>6} {'step 0':>6} {'step 1':>6} {'step 2':>6} {'step 3':>6}", end=""
    )
    print(f"  {'total':>7}  {'compiled':>8}", flush=True)
    for way in (chunk or CHUNK, 1 << 30):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            command = [sys.executable, __file__, "--first-steps-here", str(way)]
            command += ["--dim", str(dim), "--layers", str(layers)]
            subprocess.run(command, env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dim", type=int, default=None, help="default 128 (768 with --first-steps)"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="default 4 (12 with --first-steps)"
    )
    parser.add_argument("--first-steps", action="store_true", help="compilation on the first steps")
    parser.add_argument(
        "--chunk", type=int, default=None, help="--first-steps: tensors per chunk (default CHUNK)"
    )
    parser.add_argument("--first-steps-here", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    big = args.first_steps or args.first_steps_here is not None
    args.dim = args.dim or (768 if big else 128)
    args.layers = args.layers or (12 if big else 4)
    if args.first_steps_here is not None:
        first_steps_here(args.dim, args.layers, args.first_steps_here)
        return
    print(machine_facts())
    if args.first_steps:
        first_steps(args.dim, args.layers, args.chunk)
        return
    print(machine_facts())
    print(f"Llama dim {args.dim}, {args.layers} blocks, sparsity 0.8, {STEPS} steps, fused AdamW")
    print(f"{'kind':<7} {'dtype':<9} {'path':<5} {'itop':<5} {'B/weight':>8}", end="")
    print(f" {'buffers':>10} {'held':>9} {'scalars':>8}")
    for kind in ("static", "rigl"):
        for dtype in (torch.float32, torch.bfloat16):
            for gpu_path in (False, True):
                print(measure(kind, dtype, gpu_path, args.dim, args.layers))
    host_time(args.dim, args.layers)


if __name__ == "__main__":
    main()
