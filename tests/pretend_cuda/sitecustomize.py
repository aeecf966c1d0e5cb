"""Imported by every Python process started with this folder on ``PYTHONPATH`` (see
``pretend_cuda.py``): Lightning counts the pretended GPUs there too."""

import pretend_cuda

pretend_cuda.install()
