"""Train a Llama built sparse (issue 36): its peak memory against what dense training would need.

The model is built under ``torch.device("meta")``, the algorithm applied there (masks
deferred), and ``on_wse(model, optimizer=..., init=model.init_tensor)`` makes it one module at
a time, each masked layer compact as soon as it exists (`lightning_sparse.wse.materialize`):
no dense weight of the whole model is ever allocated. Then ``--steps`` training steps of
AdamW on random byte tokens (batch ``--batch`` x ``--seq``). Printed: the dense and kept
parameter counts, peak RSS after building and after training (``ru_maxrss``), seconds per step,
tokens per second, and dense AdamW's requirement (16 bytes per parameter: weights, gradients,
two moments) for comparison.

    python benchmarks/bench_build_sparse.py                       # ~0.45B, Static 90%
    python benchmarks/bench_build_sparse.py --dim 3200 --layers 26 --ffn 8640 --heads 25
        # the 3.0B model of issue 36 (see the README's table for what it needs today)
    python benchmarks/bench_build_sparse.py --kind rigl --update-every 2 --steps 3
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _harness import load_average, machine_facts

from lightning_sparse import RigL, Static
from lightning_sparse.models.llama import Llama, LlamaConfig
from lightning_sparse.wse import on_wse

GB = 1e9


def peak_rss_gb() -> float:
    """Peak resident set size of this process so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    numbers = {
        "dim": 2048, "layers": 8, "ffn": 5504, "heads": 16, "sparsity": 0.9,
        "update-every": 2, "steps": 3, "batch": 1, "seq": 256, "threads": 2,
    }  # fmt: skip
    for name, default in numbers.items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    parser.add_argument("--kind", choices=("static", "rigl"), default="static")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_facts())
    print(f"load average before: {load_average()}")

    cfg = LlamaConfig(
        dim=args.dim, n_layers=args.layers, n_heads=args.heads, ffn_hidden=args.ffn,
        max_seq_len=args.seq,
    )  # fmt: skip
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("meta"):
        model = Llama(cfg)
    if args.kind == "static":
        algorithm: Static | RigL = Static(args.sparsity)
    else:
        algorithm = RigL(args.sparsity, update={"freq": args.update_every}, track_itop=False)
    model.apply(algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    algorithm.apply(optimizer)
    dense_params = model.num_params()
    masked = sum(sp.param.numel() for sp in algorithm.sparse_params.values())
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    with on_wse(model, optimizer=optimizer, init=model.init_tensor) as executor:
        built_s = time.perf_counter() - start
        rss_built = peak_rss_gb()
        assert executor.compact is not None
        held = executor.compact.memory()
        kept = sum(int(sp.mask.count_nonzero()) for sp in algorithm.sparse_params.values())
        print(
            f"model: dim {cfg.dim}, {cfg.n_layers} layers, ffn {cfg.ffn_hidden}: "
            f"{dense_params / 1e9:.3f}B parameters, {masked / 1e9:.3f}B masked, "
            f"{kept / 1e9:.3f}B kept ({args.kind} {args.sparsity})"
        )
        print(
            f"built sparse in {built_s:.1f} s; peak RSS {rss_built:.2f} GB; compact layers "
            + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in held.items())
        )
        times = []
        for step in range(args.steps):
            t0 = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - t0)
            print(
                f"step {step + 1}: loss {loss.item():.4f}, {times[-1]:.2f} s, "
                f"peak RSS {peak_rss_gb():.2f} GB"
            )
        per_step = statistics.median(times[1:] or times)  # the first step times the kernels
        print(
            f"peak RSS {peak_rss_gb():.2f} GB through {args.steps} steps "
            f"(dense AdamW would need {16 * dense_params / GB:.1f} GB for weights, gradients "
            f"and moments alone); median {per_step:.2f} s/step, "
            f"{args.batch * args.seq / per_step:.0f} tokens/s"
        )
        print(f"load average after: {load_average()}")
        # Leaving the block gives the model its dense weights back (`on_wse`), which a model
        # that only fits sparse cannot hold: the process ends here.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
