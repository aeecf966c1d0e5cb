"""Where `Static`'s per-step overhead goes: the per-step primitives timed alone, in CPU time.

`bench_step_cost.py` measures the whole step; this script times, on the sparsifiable weights of
the same Llama model (3.2M weights at sparsity 0.8), each piece of work a sparse step adds:

* gradient masking in the post-accumulate-grad hooks: ``torch.where(mask, grad, 0, out=grad)``
  (what the library does) against a NaN-safe alternative, multiplying the same-size integer
  view by the bool mask (zeroes the bit pattern, so NaN/inf become 0 too);
* the weight re-prune of the step post-hook: ``torch._foreach_mul_(params, bool masks)`` against
  the same on integer views;
* ``torch.sqrt`` of AdamW's ``exp_avg_sq`` with and without 80% exact zeros, and a whole AdamW
  step (default and fused) on dense versus sparse gradients and state.

Times are per-thread CPU time (``time.thread_time``) on one thread, minimum of the repeats, so
other processes on a shared machine disturb them far less than wall-clock medians.

    python benchmarks/bench_step_overhead.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from lightning_sparse import Static  # noqa: E402
from lightning_sparse.models.llama import Llama, LlamaConfig  # noqa: E402

INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer tensor of the same element size."""
    return t.view(INT_OF_SIZE[t.element_size()])


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return 1e3 * best


def adamw_after_steps(
    params: list[torch.Tensor], masks: list[torch.Tensor] | None, fused: bool
) -> torch.optim.AdamW:
    """An AdamW over copies of ``params`` that has taken 3 steps (masked gradients if ``masks``)."""
    copies = [p.detach().clone().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(copies, lr=1e-3, **({"fused": True} if fused else {}))
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for i, p in enumerate(copies):
            p.grad = 1e-3 * torch.randn(p.shape, generator=generator)
            if masks is not None:
                p.grad.mul_(masks[i])
                p.data.mul_(masks[i])
        optimizer.step()
    return optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset(args.preset))
    sparsity = Static(sparsity=0.8)
    model.apply(sparsity)
    sps = list(sparsity.sparse_params.values())
    params = [sp.param.detach() for sp in sps]
    masks = [sp.mask for sp in sps]
    grads = [torch.randn_like(p) for p in params]
    zero = torch.zeros(())
    n = sum(p.numel() for p in params)
    print(
        f"torch {torch.__version__}, 1 thread, {len(params)} sparse weights, {n / 1e6:.2f}M "
        f"elements, sparsity 0.8; CPU ms, min of {args.repeats}"
    )

    def where_out() -> None:
        for g, m in zip(grads, masks, strict=True):
            torch.where(m, g, zero, out=g)

    def int_view_mul() -> None:
        for g, m in zip(grads, masks, strict=True):
            bits(g).mul_(m)

    rows = [
        ("grad masking: torch.where(mask, g, 0, out=g)", where_out),
        ("grad masking: g.view(int32).mul_(mask)", int_view_mul),
        ("re-prune: _foreach_mul_(params, bool masks)", lambda: torch._foreach_mul_(params, masks)),
        (
            "re-prune: _foreach_mul_(int views, masks)",
            lambda: torch._foreach_mul_([bits(p) for p in params], masks),
        ),
    ]
    dense_sq = [torch.rand_like(p) for p in params]
    sparse_sq = [s * m for s, m in zip(dense_sq, masks, strict=True)]
    rows += [
        ("torch.sqrt(exp_avg_sq), no zeros", lambda: [s.sqrt() for s in dense_sq]),
        ("torch.sqrt(exp_avg_sq), 80% zeros", lambda: [s.sqrt() for s in sparse_sq]),
    ]
    for fused in (False, True):
        name = "fused" if fused else "default"
        dense_opt = adamw_after_steps(params, None, fused)
        sparse_opt = adamw_after_steps(params, masks, fused)
        rows += [
            (f"AdamW({name}).step, dense grads and state", dense_opt.step),
            (f"AdamW({name}).step, 80%-zero grads and state", sparse_opt.step),
        ]
    for label, fn in rows:
        print(f"  {label:<50} {cpu_ms(fn, args.repeats):7.2f}")


if __name__ == "__main__":
    main()
