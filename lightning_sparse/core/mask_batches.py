"""The drop count of drop-and-grow, shared by `algorithms.drop_grow`'s paths."""

from __future__ import annotations

__all__ = ["drop_count"]


def drop_count(active: int, n_total: int, drop_fraction: float, prune_to_target: bool) -> int:
    """Connections a row with ``active`` kept drops (Cerebras' counts, `shaped_drop_and_grow`):
    ``active - int((1 - d) * base)``, ``base`` the active count, or with ``prune_to_target``
    (GraNet) that count capped at the target ``n_total``."""
    keep_share = 1.0 - min(max(drop_fraction, 0.0), 1.0)
    base = min(active, n_total) if prune_to_target else active
    return active - int(keep_share * base)
