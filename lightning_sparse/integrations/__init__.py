"""Bridges to the Hugging Face ecosystem: export to ``save_pretrained`` directories (dense or in
the compressed-tensors sparse-bitmask format), serving such a directory (or a checkpoint) on the
device in CSR (`serve.load_on_wse`) and a ``transformers.Trainer`` callback.

Optional: these modules need ``transformers`` (and ``compressed-tensors`` for the compressed
format), installed by ``pip install lightning_sparse[hf]``; importing this package needs neither.
"""
