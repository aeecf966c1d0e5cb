"""The algorithm registry: lower-cased class name -> class, for ``configure`` and YAML.

An explicit dict. Every concrete `SparsityAlgorithm` subclass adds itself when it is defined
(``class Mine(SparsityAlgorithm, register=False)`` opts out), so a user's algorithm is selectable
by name (``algorithm: mine``) as soon as its module is imported; a user class never replaces a
built-in one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ALGORITHMS", "BUILTIN", "algorithm_class", "available_algorithms", "register_algorithm"]

ALGORITHMS: dict[str, type] = {}
BUILTIN = ("static", "gmp", "set", "rigl", "granet")


def register_algorithm(cls: type, name: str | None = None) -> type:
    """Register ``cls`` under ``name`` (default: its lower-cased class name); returns ``cls``."""
    key = (name or cls.__name__).lower()
    if key in BUILTIN and key in ALGORITHMS and ALGORITHMS[key] is not cls:
        return cls  # a subclass named like a built-in does not replace it
    ALGORITHMS[key] = cls
    return cls


def available_algorithms() -> dict[str, type]:
    """Every registered algorithm by lower-cased name, sorted."""
    return dict(sorted(ALGORITHMS.items()))


def algorithm_class(name: Any) -> type:
    """The registered algorithm called ``name`` (case-insensitive), or a ValueError listing them."""
    key = str(name).lower()
    if key not in ALGORITHMS:
        raise ValueError(
            f"unknown sparsity algorithm {name!r}; valid algorithms: "
            f"{', '.join(available_algorithms())} (or define a SparsityAlgorithm subclass and use "
            "its lower-cased class name)"
        )
    return ALGORITHMS[key]
