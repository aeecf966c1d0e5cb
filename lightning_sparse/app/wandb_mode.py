"""Weights & Biases for `lightning-sparse` runs: online only when an account is configured.

``WANDB_MODE`` set by the user always wins; otherwise runs go online with ``WANDB_API_KEY`` or a
``~/.netrc`` entry for the W&B host, and offline (kept under the logger's ``save_dir``, uploaded
later with ``wandb sync``) without one. wandb itself is never imported here.
"""

from __future__ import annotations

import netrc
import os
import sys
from typing import Any
from urllib.parse import urlparse

from jsonargparse import Namespace
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from lightning_sparse.app.common import as_list, class_of

__all__ = ["active_wandb_run", "set_wandb_mode", "wandb_mode"]


def wandb_mode() -> str:
    """``WANDB_MODE`` if set; ``online`` when a W&B account is configured; else ``offline``.

    An account is ``WANDB_API_KEY`` or a ``~/.netrc`` (``$NETRC``) entry for the W&B host
    (``api.wandb.ai``, or the host of ``WANDB_BASE_URL``).
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host or "api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        entry = None
    return "online" if entry and entry[2] else "offline"


def set_wandb_mode(config: Namespace) -> None:
    """Decide ``WANDB_MODE`` once (DDP workers and wandb inherit it); say so if a W&B logger
    is configured and it is offline. Runs after parsing, so not for ``--help``."""
    if os.environ.get("WANDB_MODE"):
        return
    os.environ["WANDB_MODE"] = wandb_mode()
    uses_wandb = any(
        (cls := class_of(e)) is not None and issubclass(cls, WandbLogger)
        for e in as_list(config.get("trainer.logger"))
    )
    if os.environ["WANDB_MODE"] == "offline" and uses_wandb:
        rank_zero_info(
            "W&B: offline (no account configured): runs are kept under the logger's "
            "save_dir; upload them later with `wandb sync`"
        )


def active_wandb_run() -> Any:
    """The process's active W&B run (``wandb.run``), or None; never imports wandb."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None)
