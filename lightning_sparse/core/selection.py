"""Which parameters of a model are candidates for sparsity, each exactly once.

Pure model inspection: no masks, optimizers or algorithms. A tied parameter (one tensor under
several names, e.g. an embedding shared with the output head) is a single candidate under its
first name, so it is sparsified once.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = ["Candidate", "candidates", "tied_parameter_ids"]

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
