"""Tokenized text data: a local Hugging Face tokenizer, or a small byte-level BPE trained here.

`TokenizedTextDataModule` is `ByteTextDataModule` with token ids instead of bytes: the same
corpus (by default the Python standard library's `.py` sources), the same file split by path
hash, the same seeded, resumable training order and DDP sharding. Optional: needs
``transformers`` (and ``tokenizers`` to train a BPE), which this package does not depend on.

Token ids of each file are concatenated with the tokenizer's end-of-text token between files
(when it has one), then cut into windows of ``seq_len + 1`` tokens, exactly like the bytes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sparse.data.errors import DataError
from lightning_sparse.data.text import ByteTextDataModule, experiment_seed

__all__ = ["TokenizedTextDataModule", "load_tokenizer", "read_texts", "train_byte_bpe"]

END_OF_TEXT = "<|endoftext|>"
# A byte-level BPE starts from the 256 byte symbols plus the end-of-text token; merges add more.
MIN_BPE_VOCAB = 257


def _require(package: str, why: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(
            f"{why} needs the optional package {package!r}, which is not installed; run "
            f"`pip install {package}`, or use ByteTextDataModule (bytes, no tokenizer)"
        )


def read_texts(files: Iterable[Path], max_bytes: int | None = None) -> Iterator[str]:
    """Each file's text in turn (UTF-8, undecodable bytes replaced), read lazily, stopping once
    `max_bytes` is read; the last file is cut so the total is at most `max_bytes` bytes."""
    left = max_bytes
    for path in files:
        if left is not None and left <= 0:
            return
        data = path.read_bytes()
        if left is not None:
            data = data[:left]
            left -= len(data)
        yield data.decode("utf-8", errors="replace")


def check_bpe_vocab(vocab_size: int) -> None:
    """Raise unless a byte-level BPE can have `vocab_size` ids."""
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is below {MIN_BPE_VOCAB}, the 256 byte symbols plus the "
            "end-of-text token a byte-level BPE starts from; pass vocab_size >= 257"
        )


def train_byte_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2's scheme) trained on `texts`, as a Hugging Face fast tokenizer.

    Deterministic: the same texts and `vocab_size` give the same vocabulary and merges. The
    vocabulary is `vocab_size` ids unless the texts run out of pairs to merge (then fewer).

    Raises:
        ValueError: `vocab_size` < 257 (the 256 byte symbols and the end-of-text token).
    """
    check_bpe_vocab(vocab_size)
    _require("tokenizers", "training a byte-level BPE")
    _require("transformers", "training a byte-level BPE")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no <unk>
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT)


def load_tokenizer(directory: str) -> Any:
    """``AutoTokenizer.from_pretrained(directory, local_files_only=True)``; nothing downloaded.

    Raises:
        FileNotFoundError: `directory` is not a directory.
    """
    if not Path(directory).is_dir():
        raise FileNotFoundError(
            f"tokenizer={directory!r} is not a local directory; pass the directory that "
            "save_pretrained() wrote (nothing is downloaded), or tokenizer=None to train a BPE"
        )
    _require("transformers", f"loading the tokenizer at {directory!r}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


class TokenizedTextDataModule(ByteTextDataModule):
    """`ByteTextDataModule` over token ids: batches are LongTensor [batch_size, seq_len + 1].

    Args:
        tokenizer: A local Hugging Face tokenizer directory; `None` trains a byte-level BPE of
            `bpe_vocab_size` ids on the training split (capped by `max_bytes`).
        bpe_vocab_size: Vocabulary of the trained BPE (ignored with `tokenizer`). The model's
            vocabulary must be at least `self.vocab_size`, the tokenizer's length. (Not named
            ``vocab_size``: Lightning refuses a data hparam that `LitCausalLM`'s contradicts.)
        save_tokenizer: Directory the trained BPE is saved to (``save_pretrained``; rank 0
            only), so a model, an export or a later run can load it with `tokenizer=`.
        **kwargs: `ByteTextDataModule`'s (``paths``, ``pattern``, ``val_paths``, ``val_every``,
            ``seq_len``, ``batch_size``, ``max_bytes``, ``val_windows``, ``seed``,
            ``num_workers``, ``test_windows``, ``predict_prompts``); ``max_bytes`` caps the
            training text read.
    """

    def __init__(
        self,
        tokenizer: str | None = None,
        bpe_vocab_size: int = 512,
        save_tokenizer: str | None = None,
        **kwargs: Any,
    ) -> None:
        if tokenizer is None:
            check_bpe_vocab(bpe_vocab_size)
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.hparams["seed"] = experiment_seed(kwargs.get("seed"))  # as the parent: the seed
        self._tokenizer: Any = None
        self._train_texts: list[str] | None = None

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer: loaded, or trained (and saved) on first use."""
        if self._tokenizer is None:
            hp = self.hparams
            if hp.tokenizer is not None:
                self._tokenizer = load_tokenizer(hp.tokenizer)
            else:
                self._tokenizer = train_byte_bpe(self.train_texts(), hp.bpe_vocab_size)
                trainer = self.trainer
                if hp.save_tokenizer is not None and (trainer is None or trainer.global_rank == 0):
                    self._tokenizer.save_pretrained(hp.save_tokenizer)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:  # type: ignore[override]  # a class constant in the parent
        """Token ids are below this: the tokenizer's length (special tokens included)."""
        return len(self.tokenizer)

    def train_texts(self) -> list[str]:
        """The training split's text, capped by `max_bytes` (read once)."""
        if self._train_texts is None:
            self._train_texts = list(read_texts(self.split_files()[0], self.hparams.max_bytes))
        return self._train_texts

    def token_ids(self, texts: Iterable[str], limit: int | None = None) -> Tensor:
        """Token ids of `texts` joined by end-of-text, as int32 [N]; stops after `limit` ids."""
        eos = self.tokenizer.eos_token_id
        ids: list[int] = []
        for text in texts:
            if limit is not None and len(ids) >= limit:
                break
            if ids and eos is not None:
                ids.append(eos)
            ids.extend(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return torch.tensor(ids[:limit] if limit is not None else ids, dtype=torch.int32)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (the tokenizer's)."""
        return str(self.tokenizer.decode(ids))

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        hp = self.hparams
        window = hp.seq_len + 1
        self.train_data = self.token_ids(self.train_texts())
        self._train_texts = None  # the ids are kept; the text is not needed any more
        # The held-out files are tokenized only until the validation and test windows are filled.
        val_files = self.split_files()[1]
        held_out = self.token_ids(read_texts(val_files), self.held_out_size())
        self.val_data, self.test_data = self.held_out_splits(held_out)
        for split, data in (("training", self.train_data), ("validation", self.val_data)):
            if len(data) < window:
                raise DataError(
                    f"the {split} corpus has {len(data)} tokens, fewer than one window of "
                    f"seq_len + 1 = {window}; add text or lower seq_len",
                    ("paths", "seq_len"),
                )
