"""Byte-level text data: a real corpus present on every machine, no downloads, no tokenizer.

By default the corpus is the Python standard library's own `.py` sources (excluding
site-packages and test directories). Files are split into train / held-out by a stable hash
of their relative path, so the split never depends on the machine, the file order or the seed.
The held-out files give the validation windows first, then the test windows after them (never
trained on, never validated on); the predict prompts are the starts of the test windows.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_sparse.data.errors import DataError
from lightning_sparse.data.sampler import ResumableDataLoader, ResumableSampler

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict

VOCAB_SIZE = 256
# Directory names never read from the standard library: installed packages and test suites.
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def is_validation_file(relative_path: str, val_every: int) -> bool:
    """True for about one file in `val_every`, decided by a blake2b hash of the POSIX path."""
    digest = hashlib.blake2b(relative_path.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % val_every == 0


@functools.cache
def stdlib_files() -> tuple[tuple[Path, str], ...]:
    """The standard library's `.py` files as sorted (path, relative path) pairs.

    Cached: the standard library does not change while the process runs.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _STDLIB_EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            files.append((path, rel.as_posix()))
    if not files:
        raise DataError(
            f"no .py files found in the standard library at {root}; pass paths=", ("paths",)
        )
    return tuple(files)


def user_files(paths: Iterable[str], pattern: str) -> list[tuple[Path, str]]:
    """Files named in `paths`, directories searched recursively for `pattern`.

    Relative paths (used for the split) are taken against each given directory; a file given
    directly is known by its name.

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: A directory holds no file matching `pattern`.
    """
    files = []
    for entry in paths:
        path = Path(entry).expanduser()
        if path.is_file():
            files.append((path, path.name))
        elif path.is_dir():
            found = sorted(p for p in path.rglob(pattern) if p.is_file())
            if not found:
                raise DataError(
                    f"no files matching {pattern!r} under directory {str(path)!r}; name files "
                    "or directories that hold some, or change pattern=",
                    ("paths", "pattern"),
                )
            files.extend((p, p.relative_to(path).as_posix()) for p in found)
        else:
            raise FileNotFoundError(f"text data path {str(path)!r} does not exist")
    return files


def read_bytes(files: Iterable[Path], max_bytes: int | None = None) -> Tensor:
    """Concatenates files in order into one uint8 tensor [N], stopping once `max_bytes` is hit."""
    buffer = bytearray()
    for path in files:
        if max_bytes is not None and len(buffer) >= max_bytes:
            break
        buffer += path.read_bytes()
    if max_bytes is not None:
        del buffer[max_bytes:]
    if not buffer:  # torch.frombuffer rejects an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


class WindowDataset(Dataset):
    """Windows of `seq_len + 1` tokens of a byte corpus, at the given start offsets.

    Args:
        data: uint8 corpus [N].
        starts: LongTensor [num_windows] of start offsets; item i starts at `starts[i]`.
        seq_len: Model context; each item has `seq_len + 1` tokens (inputs plus shifted targets).
    """

    def __init__(self, data: Tensor, starts: Tensor, seq_len: int) -> None:
        self.data, self.starts, self.seq_len = data, starts, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Tensor:
        """-> LongTensor [seq_len + 1]."""
        start = int(self.starts[i])
        return self.data[start : start + self.seq_len + 1].long()


def experiment_seed(seed: int | None) -> int:
    """``seed``, or the experiment's seed (``torch.initial_seed()``) when ``None``."""
    return int(torch.initial_seed()) if seed is None else seed


class ByteTextDataModule(L.LightningDataModule):
    """Byte-level (vocab 256) language-model data from the stdlib sources or your text files.

    Batches are LongTensor [batch_size, seq_len + 1]. Training windows tile the train corpus with
    stride `seq_len` (every next-token pair appears once per epoch); their order is a permutation
    fixed by `seed` (by default the experiment's: `seed_everything`), so runs with the same seed
    see the same batches and runs with different seeds different orders. Every epoch repeats that
    order. The training loader is a `ResumableDataLoader`: under DDP each rank takes its share of
    the order, and a run resumed from a mid-epoch checkpoint continues with the batch after the
    last one trained (the position is saved in the checkpoint). Validation is the first
    `val_windows` contiguous windows of the held-out (validation) files, the test split the next
    `test_windows` windows after them, and ``predict`` continues the first `seq_len // 2` tokens
    of the first `predict_prompts` test windows (`decode` turns ids back into text).

    Args:
        paths: Text files or directories (searched recursively for `pattern`); `None` uses the
            Python standard library's `.py` files.
        pattern: Glob for files inside directories given in `paths`.
        val_paths: Validation files or directories; `None` splits `paths` by file instead,
            putting a file in validation when the hash of its relative path is 0 mod `val_every`.
        val_every: About one file in `val_every` goes to validation.
        seq_len: Tokens of context per example.
        batch_size: Windows per batch.
        max_bytes: Cap on the training corpus size in bytes (files are read in `paths` order,
            sorted within each directory); `None` reads everything.
        val_windows: Number of validation windows.
        seed: Fixes the training order; `None` (default): the experiment's seed,
            ``torch.initial_seed()``, which ``seed_everything`` / ``torch.manual_seed`` set (as
            the sparsity algorithms' ``seed=None``), so ``--seed_everything`` varies the model
            init, the masks and the data order together. The resolved seed is the saved hparam.
        num_workers: DataLoader worker processes.
        test_windows: Number of test windows (``lightning-sparse test``).
        predict_prompts: Number of prompts ``lightning-sparse predict`` continues.
    """

    vocab_size = VOCAB_SIZE

    if TYPE_CHECKING:
        # save_hyperparameters() makes hparams an AttributeDict (read as hp.seq_len); Lightning
        # declares the wider MutableMapping.
        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(
        self,
        paths: list[str] | None = None,
        pattern: str = "*.py",
        val_paths: list[str] | None = None,
        val_every: int = 20,
        seq_len: int = 256,
        batch_size: int = 32,
        max_bytes: int | None = 8_000_000,
        val_windows: int = 128,
        seed: int | None = None,
        num_workers: int = 0,
        test_windows: int = 128,
        predict_prompts: int = 8,
    ) -> None:
        super().__init__()
        if val_every < 2:
            raise ValueError(f"val_every must be >= 2 (one file in val_every), got {val_every}")
        sizes = {
            "seq_len": seq_len,
            "batch_size": batch_size,
            "val_windows": val_windows,
            "test_windows": test_windows,
            "predict_prompts": predict_prompts,
        }
        bad = {name: value for name, value in sizes.items() if value < 1}
        if bad:
            raise ValueError(
                f"{', '.join(f'{k}={v}' for k, v in bad.items())}: must be positive (a count of "
                "tokens, windows or prompts)"
            )
        self.save_hyperparameters()
        self.hparams["seed"] = experiment_seed(seed)  # the seed in force, saved and logged
        self.train_data: Tensor | None = None
        self.val_data: Tensor | None = None
        self.test_data: Tensor | None = None
        self.train_sampler: ResumableSampler | None = None

    def split_files(self) -> tuple[list[Path], list[Path]]:
        """The (train, validation) file lists, each in sorted order."""
        hp = self.hparams
        files = stdlib_files() if hp.paths is None else user_files(hp.paths, hp.pattern)
        if hp.val_paths is not None:
            return [p for p, _ in files], [p for p, _ in user_files(hp.val_paths, hp.pattern)]
        train = [p for p, rel in files if not is_validation_file(rel, hp.val_every)]
        val = [p for p, rel in files if is_validation_file(rel, hp.val_every)]
        if not train or not val:
            empty = "training" if not train else "validation"
            raise DataError(
                f"splitting {len(files)} file(s) by path hash (1 in val_every={hp.val_every}) "
                f"left the {empty} split empty; pass more files, change val_every, or name "
                "validation files with val_paths=",
                ("paths", "val_every", "val_paths"),
            )
        return train, val

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        hp = self.hparams
        train_files, val_files = self.split_files()
        window = hp.seq_len + 1
        self.train_data = read_bytes(train_files, hp.max_bytes)
        # The held-out files are read only as far as the validation and test windows need.
        held_out = read_bytes(val_files, self.held_out_size())
        self.val_data, self.test_data = self.held_out_splits(held_out)
        for split, data in (("training", self.train_data), ("validation", self.val_data)):
            if len(data) < window:
                raise DataError(
                    f"the {split} corpus has {len(data)} bytes, fewer than one window of "
                    f"seq_len + 1 = {window}; add text or lower seq_len",
                    ("paths", "seq_len"),
                )

    def held_out_size(self) -> int:
        """Tokens of the held-out files the validation, test and predict windows use."""
        hp = self.hparams
        return (hp.val_windows + max(hp.test_windows, hp.predict_prompts)) * hp.seq_len + 1

    def held_out_splits(self, held_out: Tensor) -> tuple[Tensor, Tensor]:
        """(validation, test) of the held-out tokens: the validation windows' tokens first (the
        same as when no test split existed), the test windows' after them."""
        cut = self.hparams.val_windows * self.hparams.seq_len
        return held_out[: cut + 1], held_out[cut:]

    def _windows(self, data: Tensor) -> Tensor:
        """Start offsets [num_windows] tiling data with stride seq_len."""
        return torch.arange((len(data) - 1) // self.hparams.seq_len) * self.hparams.seq_len

    def _split(self, name: str) -> Tensor:
        """The `name` ("train", "val" or "test") split's data; raises before `setup` has read it,
        and for a test split shorter than one window."""
        data = {"train": self.train_data, "val": self.val_data, "test": self.test_data}[name]
        if data is None:
            raise RuntimeError(
                f"{name}_dataloader() before setup(): call setup('fit') first (the Trainer does)"
            )
        if name == "test" and len(data) < self.hparams.seq_len + 1:
            raise DataError(
                f"the test split has {len(data)} tokens after the {self.hparams.val_windows} "
                f"validation windows, fewer than one window of seq_len + 1 = "
                f"{self.hparams.seq_len + 1}; add held-out text (val_paths, or more files) or "
                "lower val_windows",
                ("val_paths", "val_windows"),
            )
        return data

    def train_dataloader(self) -> ResumableDataLoader:
        hp = self.hparams
        data = self._split("train")
        dataset = WindowDataset(data, self._windows(data), hp.seq_len)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(hp.seed))
        trainer = self.trainer  # None outside Lightning: one process
        world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        sampler = ResumableSampler(dataset, order, hp.batch_size, num_replicas=world, rank=rank)
        if self.train_sampler is not None:  # a reloaded loader continues where the last one was
            sampler.batches_seen = self.train_sampler.batches_seen
        self.train_sampler = sampler
        return ResumableDataLoader(
            dataset, batch_size=hp.batch_size, sampler=sampler, num_workers=hp.num_workers
        )

    def on_before_batch_transfer(self, batch: Tensor, dataloader_idx: int) -> Tensor:
        """Count training batches as they reach the model (the loader runs one batch ahead)."""
        trainer = self.trainer
        if trainer is not None and trainer.training and self.train_sampler is not None:
            self.train_sampler.batches_seen += 1
        return batch

    def val_dataloader(self) -> DataLoader:
        data = self._split("val")
        starts = self._windows(data)[: self.hparams.val_windows]
        return self._loader(WindowDataset(data, starts, self.hparams.seq_len))

    def test_dataloader(self) -> DataLoader:
        data = self._split("test")
        starts = self._windows(data)[: self.hparams.test_windows]
        return self._loader(WindowDataset(data, starts, self.hparams.seq_len))

    def predict_dataloader(self) -> DataLoader:
        """Prompts LongTensor [batch, seq_len // 2]: the starts of the first `predict_prompts`
        test windows (a model continues them; `LitCausalLM.predict_step`)."""
        data = self._split("test")
        starts = self._windows(data)[: self.hparams.predict_prompts]
        prompt_len = max(1, self.hparams.seq_len // 2)
        return self._loader(WindowDataset(data, starts, prompt_len - 1))

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (bytes here; a byte sequence cut inside a character shows U+FFFD)."""
        return bytes(ids).decode("utf-8", errors="replace")

    def _loader(self, dataset: WindowDataset) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=False,  # the order is fixed by the dataset itself
            num_workers=self.hparams.num_workers,
            drop_last=False,
        )
