"""`lightning-sparse generate`: continue a prompt with a sparse model served on the device in CSR::

    lightning-sparse generate --model hf_sparse --prompt "def main(" --max_new_tokens 64
    lightning-sparse generate --model outputs/rigl_llama/version_0/checkpoints/last.ckpt \
        --prompt "import os" --temperature 0.8 --top_k 40 --seed 1

``--model`` is a compressed export (``export --format compressed``), a dense ``hf`` export or a
``fit`` checkpoint; it is loaded by `lightning_sparse.integrations.serve.load_on_wse`, which never
builds the dense model. Text becomes tokens with ``--tokenizer DIR``, else the tokenizer saved in
the export directory (for a checkpoint: the one its run's ``config.yaml`` names in ``data``),
else bytes (models with a 256-token vocabulary, as the byte-level recipes train). The
continuation goes to stdout; one line on stderr says what ran in CSR and the tokens per second.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sparse.app.threads import set_threads
from lightning_sparse.integrations.choices import INFERENCE_DTYPE_NAMES

if TYPE_CHECKING:
    from lightning_sparse.integrations.serve import ServedModel

__all__ = ["main"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-sparse generate",
        allow_abbrev=False,
        description="Continue a prompt with a sparse model loaded onto the device in CSR.",
    )
    parser.add_argument(
        "--model", required=True, help="compressed or hf export directory, or a fit .ckpt"
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="(%(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (%(default)s)")
    parser.add_argument("--top_k", type=int, default=None, help="sample among the k likeliest")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (%(default)s)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (save_pretrained)")
    parser.add_argument(
        "--inference_dtype",
        choices=INFERENCE_DTYPE_NAMES,
        default=None,
        help="storage of the kept values (default: the file's)",
    )
    return parser


def main(args: list[str]) -> None:
    """Parse ``args`` (after ``generate``), load, generate and print; errors exit with one line."""
    options = _parser().parse_args(args)
    import torch  # only when it runs: --help and a bad option load neither torch nor the model

    from lightning_sparse.integrations.serve import load_on_wse

    try:
        _check(options)
        threads = set_threads()
        served = load_on_wse(options.model, inference_dtype=options.inference_dtype)
        encode, decode = _codec(served, options.tokenizer)
        ids = torch.tensor([encode(options.prompt)], dtype=torch.long)
        print(threads, file=sys.stderr, flush=True)
        torch.manual_seed(options.seed)
        generator = torch.Generator().manual_seed(options.seed)
        start = time.perf_counter()
        out = served.generate(
            ids, options.max_new_tokens, options.temperature, options.top_k, generator
        )
        seconds = time.perf_counter() - start
    except (ValueError, FileNotFoundError, ModuleNotFoundError, OSError) as err:
        sys.exit(f"lightning-sparse generate: {' '.join(str(err).split())}")
    new = out.shape[1] - ids.shape[1]
    print(decode(out[0, ids.shape[1] :].tolist()))
    print(
        f"lightning-sparse generate: {served.describe()}; {new} tokens in {seconds:.2f} s "
        f"({new / seconds if seconds else 0.0:.1f} tokens/s)",
        file=sys.stderr,
    )


def _check(options: argparse.Namespace) -> None:
    if options.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens={options.max_new_tokens} must be at least 1")
    if options.temperature < 0:
        raise ValueError(f"--temperature={options.temperature} must be >= 0 (0 = greedy)")
    if options.top_k is not None and options.top_k < 1:
        raise ValueError(f"--top_k={options.top_k} must be at least 1")
    if not options.prompt:
        raise ValueError("--prompt is empty; give the text to continue")
    if options.tokenizer is not None and not Path(options.tokenizer).is_dir():
        raise FileNotFoundError(f"--tokenizer {options.tokenizer!r} is not a directory")


def _codec(served: ServedModel, tokenizer: str | None) -> tuple[Any, Any]:
    """(text -> ids, ids -> text): the tokenizer given or saved with the export, else bytes."""
    where = tokenizer
    if where is None and served.source.is_dir():
        if any((served.source / name).is_file() for name in _TOKENIZER_FILES):
            where = str(served.source)
    elif where is None:
        where = _run_tokenizer(served.source)
    if where is not None:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(where, local_files_only=True)
        return (
            lambda text: loaded(text, add_special_tokens=False)["input_ids"],
            lambda ids: loaded.decode(ids, skip_special_tokens=True),
        )
    vocab = _vocab_size(served)
    if vocab != 256:
        raise ValueError(
            f"{str(served.source)!r} has a {vocab}-token vocabulary and no tokenizer was found; "
            "pass --tokenizer DIR (the tokenizer it was trained with)"
        )
    return (
        lambda text: list(text.encode("utf-8")),
        lambda ids: bytes(ids).decode("utf-8", errors="replace"),
    )


def _run_tokenizer(ckpt: Path) -> str | None:
    """The tokenizer directory a checkpoint's run trained with: ``data.init_args.tokenizer`` or
    ``save_tokenizer`` of its ``config.yaml`` (`TokenizedTextDataModule`), if it exists."""
    import yaml

    for config in (ckpt.parent / "config.yaml", ckpt.parent.parent / "config.yaml"):
        if config.is_file():
            recipe = yaml.safe_load(config.read_text()) or {}
            data = recipe.get("data") if isinstance(recipe, dict) else None
            args = (data or {}).get("init_args") or {} if isinstance(data, dict) else {}
            for key in ("tokenizer", "save_tokenizer"):
                found = args.get(key) if isinstance(args, dict) else None
                if isinstance(found, str) and Path(found).is_dir():
                    return found
            return None
    return None


def _vocab_size(served: ServedModel) -> int:
    config = served.model.config
    return int(getattr(config, "vocab_size", 0))
