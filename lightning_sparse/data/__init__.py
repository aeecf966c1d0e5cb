"""Data modules: byte-level text from the standard library or your own files."""

from lightning_sparse.data.errors import DataError
from lightning_sparse.data.text import ByteTextDataModule, WindowDataset
from lightning_sparse.data.tokenized import TokenizedTextDataModule

__all__ = ["ByteTextDataModule", "DataError", "TokenizedTextDataModule", "WindowDataset"]
