"""A training sampler and DataLoader that resume mid-epoch from a Lightning checkpoint.

Lightning restarts a plain DataLoader's epoch from its first batch when a run resumes mid-epoch,
so a resumed run would see different batches than an uninterrupted one. Lightning saves and
restores the state of any training DataLoader that has ``state_dict`` / ``load_state_dict``
(its ``_Stateful`` protocol): `ResumableDataLoader` forwards both to `ResumableSampler`, whose
state is the number of batches training has consumed. That count is kept by the owner (the data
module increments `ResumableSampler.batches_seen` when a training batch reaches the model),
not by the sampler itself, because Lightning fetches one batch ahead of the step it trains.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["ResumableDataLoader", "ResumableSampler"]


class ResumableSampler(DistributedSampler):
    """A fixed index order, split over data-parallel ranks, that starts where training stopped.

    A ``DistributedSampler`` subclass, so Lightning keeps it under DDP instead of wrapping it.
    Every epoch repeats ``order``; it is padded by wrapping around to a multiple of
    ``num_replicas`` and rank ``r`` takes every ``num_replicas``-th index from position ``r``.

    Args:
        dataset: The dataset the indices address (only its length is used).
        order: LongTensor [len(dataset)], the epoch's index order.
        batch_size: Samples per batch on each rank; a batch is the unit of `batches_seen`.
        num_replicas: Data-parallel world size.
        rank: This process's data-parallel rank.

    Attributes:
        batches_seen: Training batches consumed on this rank, over all epochs. An iterator
            created when it is ``b`` starts at batch ``b mod batches_per_epoch`` of the epoch.
    """

    def __init__(
        self, dataset: Dataset, order: Tensor, batch_size: int, num_replicas: int = 1, rank: int = 0
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        # torch's Dataset declares no __len__; the map-style datasets sampled here have one.
        if sorted(order.tolist()) != list(range(len(dataset))):  # type: ignore[arg-type]
            raise ValueError(f"order must be a permutation of range({len(dataset)})")  # type: ignore[arg-type]
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.order = order.tolist()
        self.batch_size = batch_size
        self.batches_seen = 0

    @property
    def batches_per_epoch(self) -> int:
        """Batches per epoch on this rank (the last one may be short)."""
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self) -> Iterator[int]:
        padded = self.order + self.order[: self.total_size - len(self.order)]
        shard = padded[self.rank : self.total_size : self.num_replicas]
        start = (self.batches_seen % self.batches_per_epoch) * self.batch_size
        return iter(shard[start:])

    def state_dict(self) -> dict[str, Any]:
        """``{"batches_seen": int}``."""
        return {"batches_seen": self.batches_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.batches_seen = int(state_dict["batches_seen"])


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `ResumableSampler`; Lightning checkpoints hold the sampler's state.

    ``len()`` stays the full epoch after a mid-epoch resume, while iteration yields only the rest
    of the epoch, which is what Lightning's progress tracking expects of a resumable loader.
    """

    sampler: ResumableSampler

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (called by Lightning when it saves a checkpoint)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the sampler's state (called by Lightning before the loader is iterated)."""
        self.sampler.load_state_dict(state_dict)
