"""Which parameters of a model an algorithm sparsifies: candidates, each exactly once.

Pure model inspection: no masks, optimizers or algorithms. A tied parameter (one tensor under
several names, e.g. an embedding shared with the output head) is a single candidate under its
first name, so it is sparsified once. Without a ``param_filter`` the default selects trainable
weights with ``ndim >= 2`` that are not embeddings, norms, output heads or PEFT adapters
(`filters`); frozen ones it would take are left dense and reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import nn

from .filters import (
    ParamFilter,
    default_sparse_param_filter,
    dense_by_default_ids,
    is_dense_by_module,
)

__all__ = [
    "Candidate",
    "Selection",
    "candidates",
    "default_dense_ids",
    "default_selects",
    "select",
    "tied_parameter_ids",
]

Candidate = tuple[str, nn.Module, str, nn.Parameter]  # (full name, owner, attribute, parameter)


def tied_parameter_ids(root: nn.Module) -> set[int]:
    """``id``s of parameters registered under more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def candidates(root: nn.Module) -> Iterator[Candidate]:
    """Every parameter once (a tied parameter under its first name), skipping opted-out ones.

    Modules with ``requires_dense = True`` are skipped with their children; parameters with
    ``requires_dense = True`` are skipped.
    """
    seen: set[int] = set()
    skipped: list[str] = []
    for module_name, module in root.named_modules():
        if any(module_name == s or module_name.startswith(s + ".") for s in skipped):
            continue
        if getattr(module, "requires_dense", False):
            skipped.append(module_name)
            continue
        for attr, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            if getattr(param, "requires_dense", False):
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            yield name, module, attr, param


def default_selects(candidate: Candidate, dense: set[int]) -> bool:
    """The default filter: Cerebras' name rule plus module types (embeddings, norms, heads);
    ``dense``: ids of parameters left dense whatever their name (tied weights, heads, adapters)."""
    name, module, _, param = candidate
    if not default_sparse_param_filter(name, param):
        return False
    module_name = name.rsplit(".", 1)[0] if "." in name else ""
    return not is_dense_by_module(module, module_name, dense, param)


def default_dense_ids(root: nn.Module) -> set[int]:
    """Ids of the parameters of ``root`` the default filter never selects: tied weights, output
    heads and PEFT adapters."""
    return tied_parameter_ids(root) | dense_by_default_ids(root)


@dataclass
class Selection:
    """What `select` found: the chosen candidates, the frozen ones the default filter left dense,
    and every candidate name (for the messages about patterns that select nothing)."""

    chosen: list[Candidate] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def select(root: nn.Module, param_filter: ParamFilter | None) -> Selection:
    """The candidates of ``root`` that ``param_filter`` picks (default filter when None), in
    registration order; the default filter takes trainable parameters only."""
    dense = default_dense_ids(root) if param_filter is None else set()
    found = Selection()
    for candidate in candidates(root):
        found.names.append(candidate[0])
        if param_filter is not None:
            if param_filter(candidate[0], candidate[3]):
                found.chosen.append(candidate)
        elif default_selects(candidate, dense):
            if candidate[3].requires_grad:
                found.chosen.append(candidate)
            else:
                found.frozen.append(candidate[0])
    return found
