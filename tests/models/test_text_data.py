"""Tests for ByteTextDataModule: file-level split, determinism, user paths, errors."""

from pathlib import Path

import pytest
import torch

from lightning_sparse.data.text import (
    ByteTextDataModule,
    is_validation_file,
    read_bytes,
    stdlib_files,
)


def make_dm(**kw) -> ByteTextDataModule:
    kw = {"seq_len": 32, "batch_size": 4, "max_bytes": 50_000, "val_windows": 8, **kw}
    dm = ByteTextDataModule(**kw)
    dm.setup("fit")
    return dm


def first_batches(dm: ByteTextDataModule, n: int = 3) -> list[torch.Tensor]:
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def test_stdlib_split_is_by_file_deterministic_and_disjoint():
    train_a, val_a = ByteTextDataModule().split_files()
    train_b, val_b = ByteTextDataModule(seed=123).split_files()
    assert train_a == train_b and val_a == val_b  # the seed never moves files between splits
    assert set(train_a).isdisjoint(val_a)
    assert 0 < len(val_a) < len(train_a) / 5
    assert not any({"site-packages", "test", "tests"} & set(p.parts) for p in train_a + val_a)
    assert len(train_a) + len(val_a) == len(stdlib_files())


def test_split_rule_is_a_stable_hash_of_the_relative_path():
    # Pinned values: changing the hash rule would silently move files between splits.
    assert [is_validation_file(p, 20) for p in ["decimal.py", "os.py", "json/decoder.py"]] == [
        True,
        False,
        False,
    ]


def test_batches_shape_dtype_and_shifted_windows():
    dm = make_dm()
    batch = first_batches(dm, 1)[0]
    assert batch.shape == (4, 33) and batch.dtype == torch.long
    assert int(batch.max()) < 256
    assert dm.train_data.dtype == torch.uint8 and len(dm.train_data) == 50_000
    val = next(iter(dm.val_dataloader()))
    # Validation windows are contiguous: window i+1 starts where window i's targets end.
    torch.testing.assert_close(val[0, -1], val[1, 0])
    assert len(dm.val_dataloader().dataset) == 8


def test_same_seed_same_batches_different_seed_different_batches():
    a, b, c = (
        first_batches(make_dm(seed=1)),
        first_batches(make_dm(seed=1)),
        first_batches(make_dm(seed=2)),
    )
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(a, c, strict=True))
    # Validation does not depend on the seed.
    assert torch.equal(
        next(iter(make_dm(seed=1).val_dataloader())), next(iter(make_dm(seed=2).val_dataloader()))
    )


def test_default_seed_is_the_experiments_seed():
    """``seed=None`` follows ``seed_everything`` / ``torch.manual_seed`` (as the sparsity
    algorithms do), so one experiment seed varies the data order with the init and masks."""
    torch.manual_seed(5)
    five = make_dm()
    assert five.hparams.seed == 5  # the seed in force is what the checkpoint and loggers keep
    torch.manual_seed(6)
    six = make_dm()
    explicit = first_batches(make_dm(seed=5))
    assert all(torch.equal(x, y) for x, y in zip(first_batches(five), explicit, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(first_batches(six), explicit, strict=True))


def test_train_epoch_covers_every_window_once():
    dm = make_dm(max_bytes=3_000)
    starts = dm.train_dataloader().dataset.starts
    assert sorted(starts.tolist()) == list(range(0, (3_000 - 1) // 32 * 32, 32))


def write_corpus(root: Path, n: int = 12) -> list[str]:
    names = []
    for i in range(n):
        path = root / f"sub{i % 3}" / f"doc{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"document {i}: " + "lorem ipsum dolor sit amet " * 20)
        names.append(path.relative_to(root).as_posix())
    (root / "ignored.bin").write_bytes(bytes(range(256)))
    return names


def test_user_directory_split_by_file(tmp_path: Path):
    names = write_corpus(tmp_path)
    dm = make_dm(paths=[str(tmp_path)], pattern="*.txt", val_every=3)
    train, val = dm.split_files()
    expected_val = {n for n in names if is_validation_file(n, 3)}
    assert {p.relative_to(tmp_path).as_posix() for p in val} == expected_val
    assert len(train) + len(val) == len(names)  # ignored.bin does not match the pattern
    assert set(train).isdisjoint(val)
    assert bytes(dm.train_data[:9].tolist()) == b"document "


def test_user_files_with_explicit_validation(tmp_path: Path):
    train_file, val_file = tmp_path / "train.txt", tmp_path / "val.txt"
    train_file.write_text("a" * 500)
    val_file.write_text("b" * 500)
    dm = make_dm(paths=[str(train_file)], val_paths=[str(val_file)])
    assert set(dm.train_data.tolist()) == {ord("a")}
    assert set(dm.val_data.tolist()) == {ord("b")}


def test_errors_name_the_problem(tmp_path: Path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        make_dm(paths=[str(missing)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        make_dm(paths=[str(tmp_path / "empty")])
    single = tmp_path / "one.txt"
    single.write_text("x" * 1000)
    with pytest.raises(ValueError, match="val_paths"):
        make_dm(paths=[str(single)])
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ValueError, match="seq_len"):
        make_dm(paths=[str(single)], val_paths=[str(short)])


@pytest.mark.parametrize("split", ["train", "val"])
def test_loader_before_setup_says_to_call_setup(split: str):
    # Before setup() has read the corpus the loaders raise an error that names the fix (it was a
    # TypeError from len(None) deep in the window arithmetic).
    dm = ByteTextDataModule(seq_len=32, batch_size=4, max_bytes=50_000, val_windows=8)
    with pytest.raises(RuntimeError, match=rf"{split}_dataloader\(\) before setup\(\)"):
        getattr(dm, f"{split}_dataloader")()


def test_test_split_and_prompts_are_held_out_windows_after_the_validation_ones():
    """Validation is what it was before the test split existed (recorded results compare);
    the test windows follow it in the held-out files, and predict continues their starts."""
    dm = make_dm(test_windows=3, predict_prompts=5)
    _, val_files = dm.split_files()
    held_out = read_bytes(val_files, (8 + 5) * 32 + 1)
    assert torch.equal(dm.val_data, read_bytes(val_files, 8 * 32 + 1))
    val = torch.cat(list(dm.val_dataloader()))
    test = torch.cat(list(dm.test_dataloader()))
    assert val.shape == (8, 33) and test.shape == (3, 33)
    assert torch.equal(test[0], held_out[8 * 32 : 8 * 32 + 33].long())  # right after validation
    prompts = torch.cat(list(dm.predict_dataloader()))
    assert prompts.shape == (5, 16)  # predict_prompts prompts of seq_len // 2 tokens
    assert torch.equal(prompts[:3], test[:, :16])
    assert dm.decode(list(b"def f():")) == "def f():"


def test_test_split_shorter_than_a_window_names_the_fix(tmp_path: Path):
    corpus = tmp_path / "train.txt"
    corpus.write_text("x = 1\n" * 5000)
    held_out = tmp_path / "val.txt"
    held_out.write_text("y" * (8 * 32 + 10))  # the validation windows, and 9 bytes after them
    dm = make_dm(paths=[str(corpus)], val_paths=[str(held_out)])
    with pytest.raises(ValueError, match="the test split has 10 tokens after the 8 validation"):
        dm.test_dataloader()
