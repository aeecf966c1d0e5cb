"""Data modules: byte-level text from the standard library or your own files."""

from lightning_sparse.data.text import ByteTextDataModule, WindowDataset

__all__ = ["ByteTextDataModule", "WindowDataset"]
