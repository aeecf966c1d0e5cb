"""ResumableSampler / ResumableDataLoader: ranks, epochs and mid-epoch resume, by hand."""

from __future__ import annotations

import pytest
import torch

from lightning_sparse.data.sampler import ResumableDataLoader, ResumableSampler

ORDER = torch.tensor([4, 0, 6, 2, 1, 5, 3])  # a permutation of range(7)


def sampler(batch_size: int = 2, world: int = 1, rank: int = 0) -> ResumableSampler:
    return ResumableSampler(list(range(7)), ORDER, batch_size, num_replicas=world, rank=rank)  # type: ignore[arg-type]


def test_one_rank_yields_the_order_every_epoch() -> None:
    s = sampler()
    assert len(s) == 7 and s.batches_per_epoch == 4
    assert list(s) == ORDER.tolist() and list(s) == ORDER.tolist()


def test_ranks_split_the_padded_order_disjointly() -> None:
    # 7 indices over 2 ranks: padded with the first index to 8, then every second one.
    assert list(sampler(world=2, rank=0)) == [4, 6, 1, 3]
    assert list(sampler(world=2, rank=1)) == [0, 2, 5, 4]


@pytest.mark.parametrize(
    "seen, expected",
    [
        (0, [4, 0, 6, 2, 1, 5, 3]),
        (1, [6, 2, 1, 5, 3]),
        (3, [3]),
        (4, [4, 0, 6, 2, 1, 5, 3]),
        (9, [6, 2, 1, 5, 3]),
    ],
)
def test_iteration_starts_after_the_batches_seen(seen: int, expected: list[int]) -> None:
    s = sampler()
    s.load_state_dict({"batches_seen": seen})  # 4 batches per epoch: 9 = 2 epochs + 1 batch
    assert list(s) == expected and s.state_dict() == {"batches_seen": seen}


def test_loader_state_round_trips_through_the_sampler() -> None:
    data = torch.arange(7)
    loader = ResumableDataLoader(data, batch_size=2, sampler=sampler())  # type: ignore[arg-type]
    loader.load_state_dict({"batches_seen": 2})
    assert [b.tolist() for b in loader] == [[1, 5], [3]]
    assert len(loader) == 4  # the full epoch, as Lightning's progress tracking expects
    assert loader.state_dict() == {"batches_seen": 2}  # the owner, not iteration, advances it


def test_order_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match="permutation"):
        ResumableSampler(list(range(3)), torch.tensor([0, 0, 1]), 1)  # type: ignore[arg-type]
