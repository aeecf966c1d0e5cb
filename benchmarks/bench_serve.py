"""Serving a sparse export on the device without building the dense model: peak and held memory
(separate processes) and decode speed, versus the dense model and today's ``on_wse`` path.

Setup: a Llama (``--dim`` 1024, ``--layers`` 4, vocab 256, fp32; 50M parameters in its 28
``*layers.*_proj.weight`` matrices) made ``--sparsity`` sparse with ``Static`` (random masks,
pruned weights exactly zero), written as a dense ``hf`` export, a ``compressed`` export
(sparse-bitmask) and a Lightning checkpoint (``state_dict`` without mask entries + Llama
hyper-parameters, as ``LitCausalLM`` saves).

Memory: each variant runs in a fresh process that first imports what every variant imports
(torch, transformers' Llama, lightning_sparse with its native kernels loaded) and records that
as its ``base`` (the interpreter + libraries, the same in every variant); then loads the model
and generates ``--new`` tokens from a ``--prompt``-token prompt. ``peak`` = VmHWM - base (the
highest resident memory while loading and generating, file pages mapped by a reader included),
``held`` = VmRSS after generating - base (after, not before: ``from_pretrained`` maps the file
and its pages become resident only when generation reads them), ``tensors`` = exact bytes of the
model's parameters and buffers. Variants:

- ``dense``: ``AutoModelForCausalLM.from_pretrained(hf export)``, the usual dense load;
- ``on_wse``: today's device path for the compressed export: ``load_compressed`` (decompresses
  to the dense model), masks from the nonzeros (``register_masks``), ``on_wse``;
- ``served``: ``load_on_wse(compressed export)`` (CSR straight from the bitmask);
- ``served hf`` / ``served ckpt``: ``load_on_wse`` of the dense export / the checkpoint (one
  dense layer read at a time).

Speed: one further process holds the ``on_wse`` model and the ``served`` model (both
transformers' ``LlamaForCausalLM`` and its ``generate``, greedy, KV cache) and the checkpoint's
two (this package's ``Llama.generate``: ``on_wse`` over the dense Llama, and ``served ckpt``),
and times them interleaved (``--rounds`` rotated rounds after a warm-up, medians): tokens/s of
``--new`` tokens.

Goals at 90%: peak and held <= 0.3x dense (base subtracted); served decode >= 0.95x on_wse.

    python benchmarks/bench_serve.py [--dim 1024] [--layers 4] [--sparsity 0.9] [--threads 1]
    python benchmarks/bench_serve.py --quick      # small model, smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _harness import machine_facts, quiet

from lightning_sparse import Static, export, strip_masks
from lightning_sparse.models.llama import Llama, LlamaConfig

FILTER = ["*layers.*_proj.weight"]
MEMORY_GOAL, SPEED_GOAL = 0.3, 0.95
VARIANTS = ("dense", "on_wse", "served", "served hf", "served ckpt")


def status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out


def setup(root: Path, args: argparse.Namespace) -> None:
    """The three files of one sparse model."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    fields = dict(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                  max_seq_len=args.prompt + args.new + 8)  # fmt: skip
    model = Llama(LlamaConfig(**fields)).eval()
    model.apply(Static(args.sparsity, param_filter=FILTER, seed=args.seed))
    export(model, root / "hf")
    export(model, root / "compressed", format="compressed")
    state = {f"model.{k}": v for k, v in strip_masks(model).items()}
    torch.save({"state_dict": state, "hyper_parameters": fields}, root / "last.ckpt")


# ------------------------------------------------------------------------------- child processes
def imports() -> None:
    """What every variant imports and warms before its base is taken."""
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import lightning_sparse.integrations.compressed  # noqa: F401
    import lightning_sparse.integrations.serve  # noqa: F401
    from lightning_sparse.wse import native

    native.compiled_available()  # builds or loads the kernels


def load(variant: str, root: Path) -> tuple[Any, Any]:
    """(the model, a function ``ids, n -> ids`` generating greedily with it)."""
    import transformers

    from lightning_sparse.integrations.compressed import load_compressed
    from lightning_sparse.integrations.serve import load_on_wse
    from lightning_sparse.wse import install_executor, register_masks

    def hf(model: Any) -> Any:
        def run(ids: torch.Tensor, n: int) -> torch.Tensor:
            with torch.no_grad():
                return model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip

        return run

    if variant == "dense":
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
        return model, hf(model)
    if variant == "on_wse":
        model = load_compressed(root / "compressed").eval()
        with_masks(model, register_masks)
        install_executor(model)
        return model, hf(model)
    if variant == "on_wse ckpt":
        checkpoint = torch.load(root / "last.ckpt", weights_only=True)
        model = Llama(LlamaConfig(**checkpoint["hyper_parameters"])).eval()
        model.load_state_dict({k[len("model.") :]: v for k, v in checkpoint["state_dict"].items()})
        del checkpoint
        with_masks(model, register_masks)
        install_executor(model)
        return model, lambda ids, n: model.generate(ids, n, temperature=0.0)
    source = {"served": "compressed", "served hf": "hf", "served ckpt": "last.ckpt"}[variant]
    served = load_on_wse(root / source)
    return served, lambda ids, n: served.generate(ids, n)


def with_masks(model: torch.nn.Module, register_masks: Any) -> None:
    weights = {k: v for k, v in model.state_dict().items() if k.endswith("proj.weight")}
    register_masks(model, {**weights, **{f"{k}_mask": v != 0 for k, v in weights.items()}})


def memory_child(variant: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    imports()
    gc.collect()
    base = status()["VmRSS"]
    start = time.perf_counter()
    model, run = load(variant, root)
    seconds = time.perf_counter() - start
    gc.collect()
    after_load = status()
    held_tensors = model.held_bytes() if hasattr(model, "held_bytes") else tensor_bytes(model)
    ids = torch.randint(1, 256, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    tokens = run(ids, args.new)
    gc.collect()
    end = status()
    return {
        "base": base, "peak": end["VmHWM"] - base, "load_peak": after_load["VmHWM"] - base,
        "held": end["VmRSS"] - base, "tensors": held_tensors, "load_s": seconds,
        "tokens": tokens[0].tolist(),
    }  # fmt: skip


def tensor_bytes(model: torch.nn.Module) -> int:
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.nbytes for t in unique.values())


def speed_child(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    imports()
    runs = {v: load(v, root)[1] for v in ("on_wse", "served", "on_wse ckpt", "served ckpt")}
    ids = torch.randint(1, 256, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    tokens = {name: run(ids, args.new)[0].tolist() for name, run in runs.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            runs[name](ids, args.new)
            times[name].append(time.perf_counter() - start)
    return {
        "tokens_per_s": {n: args.new / statistics.median(t) for n, t in times.items()},
        "tokens": tokens,
    }


# ------------------------------------------------------------------------------------- parent
def child(kind: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", kind, "--root", str(root), *forwarded(args)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def forwarded(args: argparse.Namespace) -> list[str]:
    keys = ("dim", "layers", "heads", "sparsity", "prompt", "new", "rounds", "threads", "seed")
    return [item for key in keys for item in (f"--{key}", str(getattr(args, key)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="generated tokens")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small model, few tokens")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.dim, args.layers, args.prompt, args.new, args.rounds = 256, 2, 8, 8, 2
    torch.set_num_threads(args.threads)
    quiet()
    if args.child is not None:
        root = Path(args.root)
        result = (
            speed_child(root, args)
            if args.child == "speed"
            else memory_child(args.child, root, args)
        )
        print(json.dumps(result))
        return
    print(machine_facts())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        setup(root, args)
        files = {
            "hf": (root / "hf" / "model.safetensors").stat().st_size,
            "compressed": (root / "compressed" / "model.safetensors").stat().st_size,
            "ckpt": (root / "last.ckpt").stat().st_size,
        }
        print(
            f"model: Llama dim {args.dim}, {args.layers} layers, {args.heads} heads, vocab 256, "
            f"fp32, {args.sparsity:.0%} sparse projections; files: "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in files.items())
            + f"; generate {args.prompt}-token prompt + {args.new} tokens, greedy, "
            f"{args.threads} thread(s)"
        )
        memory = {v: child(v, root, args) for v in VARIANTS}
        speed = child("speed", root, args)
    mib = 2**20
    dense = memory["dense"]
    print(f"\nbase (interpreter + torch + transformers + lightning_sparse): "
          f"{dense['base'] / mib:.0f} MiB resident, subtracted below")  # fmt: skip
    print(
        f"{'variant':<12} {'load s':>6} {'load peak':>15} {'peak':>15} {'held':>15} "
        f"{'tensors':>15} {'tokens = dense':>15}"
    )
    for name, m in memory.items():
        cells = [
            f"{m[key] / mib:6.1f} ({m[key] / dense[ref]:.2f}x)"
            for key, ref in (("load_peak", "peak"), ("peak", "peak"), ("held", "held"),
                             ("tensors", "tensors"))
        ]  # fmt: skip
        print(
            f"{name:<12} {m['load_s']:>6.2f} "
            + " ".join(f"{c:>15}" for c in cells)
            + f" {str(m['tokens'] == dense['tokens']):>15}"
        )
    print(
        "MiB above base; (x) = / the dense variant's peak (load peak, peak), held, tensors. "
        "load peak = highest resident memory up to the end of loading"
    )
    tps = speed["tokens_per_s"]
    print(f"\ndecode ({args.new} tokens after a {args.prompt}-token prompt, medians of "
          f"{args.rounds} interleaved rounds, one process):")  # fmt: skip
    for served, baseline in (("served", "on_wse"), ("served ckpt", "on_wse ckpt")):
        same = speed["tokens"][served] == speed["tokens"][baseline]
        print(
            f"  {served:<12} {tps[served]:7.1f} tokens/s vs {baseline:<12} {tps[baseline]:7.1f}: "
            f"{tps[served] / tps[baseline]:.2f}x (same tokens: {same})"
        )
    ratio_peak = memory["served"]["peak"] / dense["peak"]
    ratio_held = memory["served"]["held"] / dense["held"]
    ratio_speed = tps["served"] / tps["on_wse"]
    print(
        f"\ngoals at 90%: served peak {ratio_peak:.2f}x and held {ratio_held:.2f}x dense "
        f"(<= {MEMORY_GOAL}x: {'met' if max(ratio_peak, ratio_held) <= MEMORY_GOAL else 'NOT met'}"
        f"); decode {ratio_speed:.2f}x on_wse (>= {SPEED_GOAL}x: "
        f"{'met' if ratio_speed >= SPEED_GOAL else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
