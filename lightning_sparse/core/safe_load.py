"""`load_torch_file`: read a file a user hands in without running code from it.

``torch.load(weights_only=False)`` unpickles arbitrary globals, so a crafted checkpoint runs code
the moment it is read. Every file this package reads on a user's behalf (``LoadWeights``,
``FlopCounter(previous=...)``, ``export`` of a checkpoint) goes through here: tensors, containers
and plain Python values load (``weights_only=True``); anything else is refused with a message
naming the file and the opt-in for a file the user trusts (``trust_file=True``).

Checkpoints written by ``lightning-sparse fit`` and by the recipes hold only such values
(hyper-parameters, callback states and optimizer states are plain dicts, lists and numbers), so
no type of this package is registered with ``torch.serialization.add_safe_globals``.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

__all__ = ["UntrustedFileError", "load_torch_file"]


class UntrustedFileError(ValueError):
    """A file holds Python objects that a weights-only load refuses (loading them runs code)."""


def load_torch_file(
    path: str | Path, *, trust_file: bool = False, what: str = "checkpoint", opt_in: str = ""
) -> Any:
    """``torch.load(path)`` on the CPU, weights only unless ``trust_file``.

    Args:
        path: the file (a Lightning checkpoint, a ``torch.save``'d state dict ...).
        trust_file: unpickle arbitrary objects (``weights_only=False``): only for a file from a
            source you trust, since a crafted file runs code when it is read.
        what: what the file is, for the messages (``"LoadWeights: checkpoint"``).
        opt_in: how the caller's user passes ``trust_file`` (``"LoadWeights(trust_file=True)"``);
            default ``"trust_file=True"``.

    Returns:
        The loaded object.

    Raises:
        FileNotFoundError: no file at ``path``.
        UntrustedFileError: the file holds objects other than tensors and plain values.
        ValueError: the file is not something ``torch.load`` reads (corrupt, another format).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} is not a file; fix the path")
    if trust_file:
        return torch.load(path, map_location="cpu", weights_only=False)
    opt_in = opt_in or "trust_file=True"
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = _weights_only_reason(str(err))
        if "global" not in reason.lower():  # not a pickle of objects: a corrupt or foreign file
            raise _unreadable(path, what, err, reason) from None
        raise UntrustedFileError(
            f"{what} {str(path)!r} holds Python objects that a weights-only load refuses "
            f"({reason}); loading it would run code from the file, so it was not loaded. Only "
            f"if you trust the file's source, pass {opt_in}"
        ) from None
    except (RuntimeError, KeyError, EOFError, ValueError, AttributeError) as err:
        raise _unreadable(path, what, err, " ".join(str(err).split())) from err


def _weights_only_reason(text: str) -> str:
    """The reason in torch's weights-only paragraph: the text after "WeightsUnpickler error:",
    without its advice (``Unsupported global: GLOBAL builtins.exec was not an allowed global by
    default``)."""
    if "WeightsUnpickler error:" not in text:
        return " ".join(text.split())[:200]
    reason = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0]
    return " ".join(reason.split()).split(". Please use")[0][:200]


def _unreadable(path: Path, what: str, err: BaseException, detail: str) -> ValueError:
    """A file no load reads, weights-only or not (text, another format, a truncated file): the
    opt-in for trusted objects would not help, so it is not offered."""
    cut = detail if len(detail) <= 200 else detail[:200].rsplit(" ", 1)[0] + " ..."
    return ValueError(
        f"{what} {str(path)!r} is not a file torch.load reads (text, another format, or a "
        f"truncated file; {type(err).__name__}: {cut}); pass a checkpoint written by torch.save "
        "or Lightning"
    )
