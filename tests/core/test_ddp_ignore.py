"""DDP broadcasts no masks (`core.ddp_ignore`): their names are on DDP's ignore list.

In one process: ``apply`` puts exactly the mask and ever-active buffer names on
``root._ddp_params_and_buffers_to_ignore`` (a `Group`'s members each theirs), after the names a
user set, and ``remove`` takes out only its own.

On two gloo processes: the bytes DDP broadcasts per forward (counted at
``torch.distributed._broadcast_coalesced``) are exactly what the model's own buffers need: 0 for an
MLP, the BatchNorm statistics beside them; before this change each forward also sent 1 byte per
mask element and 1 per ever-active element. The masks stay the same on every rank, a mask
registered again keeps its name, a model wrapped before ``apply`` behaves as documented, and
ranks whose initial masks differ (``init_method="topk"`` on weights each rank initialised
itself) leave their masks to DDP's broadcast, which makes them rank 0's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_sparse.core import SET, Group, SparsityAlgorithm, Static
from lightning_sparse.core.ddp_ignore import IGNORE_ATTR
from tests.helpers import TinyNet, broadcast_bytes, free_port, gpus_hidden_from_workers

SUFFIXES = ("_mask", "_ever_active")
WORLD = 2
STEPS = 5  # SET updates at steps 2 and 4
TIMEOUT_S = 120


def _sparse_buffers(model: nn.Module) -> list[str]:
    """The mask and ever-active buffer names of ``model``, found by their suffix."""
    return [name for name, _ in model.named_buffers() if name.endswith(SUFFIXES)]


def _set(**kwargs: Any) -> SET:
    return SET(sparsity=0.75, update={"freq": 2}, drop_fraction=0.3, seed=7, **kwargs)


# ---------------------------------------------------------------------- one process
def test_apply_lists_exactly_the_mask_and_ever_active_names_and_remove_unlists_them() -> None:
    model = TinyNet()
    sparsity = _set()
    sparsity.apply(model)
    expected = [
        "fc1.weight_mask",
        "fc1.weight_ever_active",
        "fc2.weight_mask",
        "fc2.weight_ever_active",
    ]
    assert _sparse_buffers(model) == expected  # the names below are DDP's: named_buffers'
    assert getattr(model, IGNORE_ATTR) == expected
    assert all(
        getattr(model.get_buffer(n), "_ddp_ignored", False) for n in expected
    )  # DDP's setter
    sparsity.remove()
    assert not hasattr(model, IGNORE_ATTR)


def test_group_members_list_theirs_after_the_users_and_remove_restores_the_users() -> None:
    model = TinyNet()
    user = ["embed.weight", "fc2.weight_mask"]  # a user's name, and one that will be ours too
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(user))
    group = Group({"fc1.weight": _set(), "fc2.weight": Static(0.5, seed=1)})
    group.apply(model)
    # Static keeps no ever-active set; fc2's mask was the user's already.
    assert getattr(model, IGNORE_ATTR) == [*user, "fc1.weight_mask", "fc1.weight_ever_active"]
    group.remove()
    assert getattr(model, IGNORE_ATTR) == user
    assert getattr(model.embed.weight, "_ddp_ignored", False)


def test_removing_one_algorithm_keeps_the_others_names() -> None:
    model = TinyNet()
    first, second = _set(param_filter="fc1.weight"), Static(0.5, param_filter="fc2.weight")
    first.apply(model)
    second.apply(model)
    assert getattr(model, IGNORE_ATTR) == [
        "fc1.weight_mask",
        "fc1.weight_ever_active",
        "fc2.weight_mask",
    ]
    first.remove()
    assert getattr(model, IGNORE_ATTR) == ["fc2.weight_mask"]
    first.remove()  # twice: nothing more to take out
    assert getattr(model, IGNORE_ATTR) == ["fc2.weight_mask"]


# ---------------------------------------------------------------------- two processes
def _mlp(batchnorm: bool = False, seed: int = 0) -> nn.Sequential:
    """8 -> 32 -> 32 -> 4, Tanh, float64; ``batchnorm``: a BatchNorm1d after the first Linear
    (the Linears are then ``0``, ``3``, ``5``)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh()]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(32))
    return nn.Sequential(*layers, nn.Linear(32, 4)).double()


def _nbytes(model: nn.Module, sparse: bool) -> int:
    """Bytes of ``model``'s mask and ever-active buffers (``sparse``) or of its other buffers."""
    return sum(
        b.numel() * b.element_size()
        for name, b in model.named_buffers()
        if name.endswith(SUFFIXES) == sparse
    )


def _train(
    model: nn.Module,
    sparsity: SparsityAlgorithm | Group,
    wrap_first: bool = False,
    rebind: bool = False,
) -> dict[str, Any]:
    """Apply ``sparsity`` and wrap ``model`` in DDP (in that order unless ``wrap_first``), train
    STEPS AdamW steps on this rank's own data; what DDP broadcast, and what the rank holds."""
    with broadcast_bytes() as at_wrap:
        if wrap_first:
            net = DistributedDataParallel(model)
            sparsity.apply(model)
        else:
            sparsity.apply(model)
            net = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sparsity.apply(optimizer)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    with broadcast_bytes() as sent:
        for step in range(STEPS):
            if rebind and step == 3:  # registered again, as `to_empty` then a state load do
                saved = sparsity.state_dict()
                for sp in sparsity.sparse_params.values():
                    sp.register_mask(torch.empty_like(sp.mask))
                sparsity.load_state_dict(saved)
            loss = net(torch.randn(8, 8, generator=g, dtype=torch.float64)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {
        "per_forward": sent[0] / STEPS,
        "at_wrap": at_wrap[0],
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "own_buffers": _nbytes(model, sparse=False),
        "sparse_buffers": _nbytes(model, sparse=True),
        "names": _sparse_buffers(model),
        "ignored": sorted(net.parameters_to_ignore),
        "masks": {n: b.clone() for n, b in model.named_buffers() if n.endswith(SUFFIXES)},
    }


def _cases() -> dict[str, dict[str, Any]]:
    rank = dist.get_rank()
    return {
        "set": _train(_mlp(), _set(), rebind=True),
        "group_batchnorm": _train(
            _mlp(batchnorm=True), Group({"0.weight": _set(), "3.weight": Static(0.5, seed=1)})
        ),
        "wrapped_first": _train(_mlp(), _set(), wrap_first=True),
        "wrapped_first_batchnorm": _train(_mlp(batchnorm=True), _set(), wrap_first=True),
        "topk_own_weights": _train(_mlp(seed=rank), Static(0.75, init_method="topk", seed=1)),
    }


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(_cases(), Path(outdir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    """`_cases` on two spawned gloo processes; each rank's results."""
    outdir = tmp_path_factory.mktemp("ddp_ignore")
    with gpus_hidden_from_workers():
        context = mp.spawn(
            _worker, args=(WORLD, free_port(), str(outdir)), nprocs=WORLD, join=False
        )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"DDP workers did not finish within {TIMEOUT_S} s (hang?)")
    return [torch.load(outdir / f"rank{r}.pt") for r in range(WORLD)]


def _assert_same_masks(runs: list[dict[str, Any]]) -> None:
    for r, run in enumerate(runs):
        assert run["masks"].keys() == runs[0]["masks"].keys()
        for name, mask in run["masks"].items():
            assert torch.equal(mask, runs[0]["masks"][name]), f"rank {r}: {name} differs"


@pytest.mark.parametrize("case", ["set", "group_batchnorm"])
def test_ddp_broadcasts_the_models_own_buffers_and_no_mask(
    ranks: list[dict[str, dict[str, Any]]], case: str
) -> None:
    """Per forward: exactly the non-mask buffers (0 for the MLP, BatchNorm's statistics: the
    counter sees broadcasts); at wrap: the parameters and those buffers. Before: + 1 byte per
    mask and ever-active element, at wrap and at every forward."""
    runs = [rank[case] for rank in ranks]
    for run in runs:
        sent, own, sparse = run["per_forward"], run["own_buffers"], run["sparse_buffers"]
        assert sent == own, f"{sent} B per forward: own buffers {own} B, masks and ITOP {sparse} B"
        assert run["at_wrap"] == run["params"] + own
        assert sparse > 0 and run["ignored"] == sorted(run["names"])  # DDP read every name
    assert (runs[0]["own_buffers"] > 0) == (case == "group_batchnorm")
    _assert_same_masks(runs)  # SET's updates at steps 2 and 4, and the rebind, included


def test_a_model_wrapped_before_apply_broadcasts_masks_only_if_it_had_buffers(
    ranks: list[dict[str, dict[str, Any]]],
) -> None:
    """As `core.ddp_ignore` says: DDP read its ignore list when it was built; it collects the
    buffers again at each forward only if the model had some then."""
    for rank in ranks:
        plain, batchnorm = rank["wrapped_first"], rank["wrapped_first_batchnorm"]
        assert plain["ignored"] == [] and plain["per_forward"] == 0
        assert batchnorm["ignored"] == []
        assert batchnorm["per_forward"] == batchnorm["own_buffers"] + batchnorm["sparse_buffers"]
    _assert_same_masks([rank["wrapped_first"] for rank in ranks])


def test_masks_that_differ_between_ranks_stay_in_the_broadcast(
    ranks: list[dict[str, dict[str, Any]]],
) -> None:
    """``topk`` on weights each rank initialised with its own seed: the ranks' initial masks
    differ, so they are not ignored; DDP hands every rank rank 0's at wrap and each forward."""
    runs = [rank["topk_own_weights"] for rank in ranks]
    _assert_same_masks(runs)  # ignored, they would stay each rank's own
    for run in runs:
        assert run["ignored"] == []
        assert run["per_forward"] == run["sparse_buffers"] > 0
