"""The algorithms as Lightning callbacks: each core class with `SparsityCallback` mixed in.

``lightning_sparse.RigL`` is ``lightning_sparse.core.RigL`` plus the callback hooks, so the same
object works in ``Trainer(callbacks=[...])``, in LightningCLI YAML (``class_path:
lightning_sparse.RigL``) and in a plain PyTorch loop. A user algorithm subclassing
``lightning_sparse.SparsityAlgorithm`` is both too. Each class keeps its core class's docstring
(the paper and the arguments: `SparsityCallback.__init_subclass__`).
"""

from __future__ import annotations

from typing import Any

from lightning_sparse import core
from lightning_sparse.core.configure import ConfigType
from lightning_sparse.lightning.callback import SparsityCallback

__all__ = [
    "GMP",
    "SET",
    "DropAndGrow",
    "GraNet",
    "Group",
    "ModelZooSparsity",
    "RigL",
    "SparsityAlgorithm",
    "Static",
    "configure",
]


class SparsityAlgorithm(core.SparsityAlgorithm, SparsityCallback, register=False): ...


class DropAndGrow(core.DropAndGrow, SparsityCallback, register=False): ...


class Static(core.Static, SparsityCallback, register=False): ...


class GMP(core.GMP, SparsityCallback, register=False): ...


class SET(core.SET, SparsityCallback, register=False): ...


class RigL(core.RigL, SparsityCallback, register=False): ...


class GraNet(core.GraNet, SparsityCallback, register=False): ...


class Group(core.Group, SparsityCallback): ...


_CALLBACKS: dict[type, type] = {
    core.Static: Static,
    core.GMP: GMP,
    core.SET: SET,
    core.RigL: RigL,
    core.GraNet: GraNet,
}


def configure(config: ConfigType) -> Group | None:
    """`lightning_sparse.core.configure`, building Lightning callbacks (plain loops work too)."""
    group = core.configure(config, group_class=Group, resolve=lambda cls: _CALLBACKS.get(cls, cls))
    if group is not None and not isinstance(group, Group):  # core.configure built group_class
        raise TypeError(f"configure built a {type(group).__name__}, not the callback Group")
    return group


class ModelZooSparsity(Group):
    """A Cerebras ModelZoo ``sparsity:`` block as a callback, unchanged: `configure` in a Group.

    In a recipe::

        trainer:
          callbacks:
            - class_path: lightning_sparse.ModelZooSparsity
              init_args:
                sparsity:            # the ModelZoo block, pasted as is
                  algorithm: rigl
                  sparsity: 0.8
            # or: init_args: {sparsity: path/to/params_gpt3_125m_rigl75.yaml}

    Args:
        sparsity: a float, a dict, a list of dicts, or the path of a ModelZoo params file or of
            a bare sparsity YAML (see `lightning_sparse.configure`).

    Raises:
        ValueError: the block asks for no sparsity (remove the callback to train dense), or
            any error `configure` raises for a bad key or value.
    """

    def __init__(self, sparsity: float | dict[str, Any] | list[dict[str, Any]] | str) -> None:
        super().__init__()
        group = configure(sparsity)
        if group is None:
            raise ValueError(
                f"ModelZooSparsity(sparsity={sparsity!r}) configures no sparsity (dense "
                "training); remove this callback from trainer.callbacks to train dense"
            )
        self.extend(group)
