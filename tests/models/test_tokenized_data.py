"""`TokenizedTextDataModule`: a deterministic byte-level BPE (trained, saved, reloaded), token ids
that decode back to the corpus, the byte module's split / order / windows, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lightning_sparse.data import ByteTextDataModule, TokenizedTextDataModule  # noqa: E402
from lightning_sparse.data.tokenized import END_OF_TEXT, read_texts  # noqa: E402

SMALL = dict(seq_len=16, batch_size=4, max_bytes=30_000, val_windows=4)


def make_dm(**kwargs: object) -> TokenizedTextDataModule:
    dm = TokenizedTextDataModule(**{"bpe_vocab_size": 300, **SMALL, **kwargs})
    dm.setup("fit")
    return dm


def first_batches(dm: TokenizedTextDataModule, n: int = 3) -> list[torch.Tensor]:
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def test_token_ids_decode_back_to_the_training_text_joined_by_end_of_text() -> None:
    dm = make_dm()
    texts = list(read_texts(dm.split_files()[0], SMALL["max_bytes"]))
    assert sum(len(t.encode()) for t in texts) == SMALL["max_bytes"]
    assert len(texts) > 1  # several files, so the separator is exercised
    decoded = dm.tokenizer.decode(dm.train_data.tolist())
    assert decoded == END_OF_TEXT.join(texts)
    # BPE compresses: fewer ids than bytes, all below the vocabulary size.
    assert len(dm.train_data) < SMALL["max_bytes"]
    assert dm.vocab_size == 300 and int(dm.train_data.max()) < 300


def test_batches_are_shifted_long_windows_like_the_byte_module() -> None:
    dm = make_dm()
    batch = first_batches(dm, 1)[0]
    assert batch.shape == (4, 17) and batch.dtype == torch.long
    starts = dm.train_dataloader().dataset.starts
    assert sorted(starts.tolist()) == list(range(0, (len(dm.train_data) - 1) // 16 * 16, 16))
    val = next(iter(dm.val_dataloader()))
    assert torch.equal(val[0, -1], val[1, 0])  # contiguous validation windows
    assert len(dm.val_data) == 4 * 16 + 1  # tokenized only as far as its windows need
    # The split is the byte module's: same files.
    assert dm.split_files() == ByteTextDataModule(**SMALL).split_files()


def test_training_is_deterministic_and_the_seed_only_moves_the_order() -> None:
    a, b, c = make_dm(seed=1), make_dm(seed=1), make_dm(seed=2)
    assert a.tokenizer.backend_tokenizer.to_str() == b.tokenizer.backend_tokenizer.to_str()
    assert torch.equal(a.train_data, c.train_data)  # the tokenizer does not depend on the seed
    batches_a, batches_b, batches_c = first_batches(a), first_batches(b), first_batches(c)
    assert all(torch.equal(x, y) for x, y in zip(batches_a, batches_b, strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(batches_a, batches_c, strict=True))


def test_saved_tokenizer_reloads_and_gives_the_same_tokens(tmp_path: Path) -> None:
    trained = make_dm(save_tokenizer=str(tmp_path / "tok"))
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    loaded = make_dm(tokenizer=str(tmp_path / "tok"), bpe_vocab_size=999)  # size ignored
    assert loaded.vocab_size == trained.vocab_size == 300
    assert torch.equal(loaded.train_data, trained.train_data)
    assert torch.equal(loaded.val_data, trained.val_data)


def test_user_files_and_a_small_corpus_gives_a_smaller_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("the cat sat on the mat. " * 40)
    (tmp_path / "val.txt").write_text("the mat sat on the cat. " * 10)
    dm = make_dm(
        paths=[str(tmp_path / "train.txt")],
        val_paths=[str(tmp_path / "val.txt")],
        bpe_vocab_size=2000,
    )
    assert 257 < dm.vocab_size < 2000  # ran out of pairs to merge
    assert dm.tokenizer.decode(dm.train_data.tolist()) == "the cat sat on the mat. " * 40
    assert dm.tokenizer.decode(dm.val_data.tolist()).startswith("the mat sat on the cat. ")


def test_errors_name_the_value_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size=100 is below 257"):
        TokenizedTextDataModule(bpe_vocab_size=100)
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        make_dm(tokenizer=str(tmp_path / "missing"))
    (tmp_path / "a.txt").write_text("x" * 2000)
    (tmp_path / "b.txt").write_text("tiny")
    with pytest.raises(ValueError, match="fewer than one window"):
        make_dm(paths=[str(tmp_path / "a.txt")], val_paths=[str(tmp_path / "b.txt")])
