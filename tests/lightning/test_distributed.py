"""DDP on gloo: every rank picks the same masks, equal to one process on the global batch.

Randomness comes from ``(seed, step, name)``, and RigL grows by the all-reduced dense gradient, so
two ranks that each see half of a global batch must make exactly the masks (and, in float64, the
weights) of one process that sees all of it. The gradient hooks must also act before DDP's reducer
reads the gradients: zeroing pruned positions on ordinary steps, leaving them dense on RigL's
update steps.

Plain PyTorch: two processes from ``torch.multiprocessing.spawn``. Lightning: ``strategy="ddp"``
re-executes its script, so ``tests/scripts/lightning_ddp.py`` runs as a subprocess.
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

from lightning_sparse import SET, RigL
from tests.helpers import free_port, gpus_hidden_from_workers, run_ddp_script
from tests.scripts import lightning_ddp

WORLD = 2
GLOBAL_BATCH = 16
STEPS = 9  # updates at steps 2, 4, 6, 8; the last inside the last optimizer step
KINDS = ("set", "rigl")
TIMEOUT_S = 120
SUFFIXES = ("_mask", "_ever_active")  # a weight's buffers, beside its name


# ---------------------------------------------------------------------- shared by both sides
def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    ).double()


def _global_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [STEPS, GLOBAL_BATCH, 8]``, ``y: [STEPS, GLOBAL_BATCH, 4]``, float64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, GLOBAL_BATCH, 8, generator=g, dtype=torch.float64)
    y = torch.sin(x @ torch.randn(8, 4, generator=g, dtype=torch.float64))
    return x, y


def _shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    share = t.shape[0] // world
    return t[rank * share : (rank + 1) * share]


def _make(kind: str, seed: int = 7) -> SET:
    cls = {"set": SET, "rigl": RigL}[kind]
    return cls(sparsity=0.75, update={"freq": 2}, drop_fraction=0.3, seed=seed)


def _masks(algorithm: SET) -> dict[str, torch.Tensor]:
    return {name: sp.mask.clone() for name, sp in algorithm.sparse_params.items()}


def _train(kind: str, rank: int, world: int) -> dict[str, Any]:
    """AdamW for STEPS steps on rank ``rank``'s share (DDP when ``world > 1``)."""
    model = _mlp()
    algorithm = _make(kind)
    model.apply(algorithm)  # before wrapping: parameter names without "module."
    history: dict[int, dict[str, torch.Tensor]] = {}
    algorithm.register_update_hook(lambda a, step, stats: history.__setitem__(step, _masks(a)))
    initial = _masks(algorithm)
    net = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    algorithm.apply(optimizer)
    xs, ys = _global_batches()
    for x, y in zip(xs, ys, strict=True):
        loss = nn.functional.mse_loss(net(_shard(x, rank, world)), _shard(y, rank, world))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {
        "step": algorithm.step,
        "initial": initial,
        "history": history,
        "masks": _masks(algorithm),
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Dense gradient of the mean loss over ``x``, computed on detached copies (no hooks run)."""
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    loss = nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def _grad_order_check(rank: int, world: int, bucket_view: bool) -> list[dict[str, Any]]:
    """Three backward passes under DDP with RigL (update every 2 steps): record, per step, the
    gradients DDP left in ``p.grad``, the masks, and the dense global and local references.

    Steps 0 and 1 are ordinary (the hook must zero pruned positions before DDP reduces); step 2 is
    an update step (gradients must stay dense and be all-reduced for RigL's grow score).
    """
    model = _mlp()
    algorithm = RigL(sparsity=0.75, update={"freq": 2}, seed=3)
    model.apply(algorithm)
    net = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    algorithm.apply(optimizer)
    xs, ys = _global_batches()
    records = []
    for step in range(3):
        x, y = _shard(xs[step], rank, world), _shard(ys[step], rank, world)
        optimizer.zero_grad()
        update_step = algorithm.is_update_step()
        nn.functional.mse_loss(net(x), y).backward()
        records.append(
            {
                "update_step": update_step,
                "masks": _masks(algorithm),
                "grads": {n: sp.param.grad.clone() for n, sp in algorithm.sparse_params.items()},
                "global": _reference_grads(model, xs[step], ys[step]),
                "local": _reference_grads(model, x, y),
            }
        )
        optimizer.step()
    return records


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {
            "train": {kind: _train(kind, rank, world) for kind in KINDS},
            "order": {view: _grad_order_check(rank, world, view) for view in (False, True)},
        }
        torch.save(result, Path(outdir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run ``_worker`` on two spawned gloo processes once; each rank's results."""
    outdir = tmp_path_factory.mktemp("plain_ddp")
    with gpus_hidden_from_workers():  # gloo on the CPU, on a GPU machine too
        context = mp.spawn(
            _worker, args=(WORLD, free_port(), str(outdir)), nprocs=WORLD, join=False
        )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"plain DDP workers did not finish within {TIMEOUT_S} s (hang?)")
    return [torch.load(outdir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def single_process() -> dict[str, dict[str, Any]]:
    return {kind: _train(kind, rank=0, world=1) for kind in KINDS}


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run ``tests/scripts/lightning_ddp.py`` (2 ranks, ``strategy="ddp"``); each rank's results."""
    outdir = tmp_path_factory.mktemp("lightning_ddp")
    script = Path(lightning_ddp.__file__)
    return run_ddp_script(script, outdir, "Lightning DDP", TIMEOUT_S, world=WORLD)


# ---------------------------------------------------------------------- checks
def _assert_runs_agree(ranks: list[dict[str, Any]], single: dict[str, Any]) -> None:
    """Masks after every update and at the end exactly equal on all ranks and to the single
    process; weights equal to float64 rounding."""
    assert sorted(single["history"]) == [2, 4, 6, 8][: len(single["history"])]
    assert len(single["history"]) >= 3
    for r, run in enumerate(ranks):
        assert run["step"] == single["step"]
        assert sorted(run["history"]) == sorted(single["history"]), f"rank {r}"
        for step, masks in single["history"].items():
            for name, mask in masks.items():
                assert torch.equal(run["history"][step][name], mask), f"rank {r} {name} @ {step}"
        for name, mask in single["masks"].items():
            assert torch.equal(run["masks"][name], mask), f"rank {r} final mask {name}"
        for name, w in single["weights"].items():
            torch.testing.assert_close(run["weights"][name], w, atol=1e-10, rtol=0)
            assert torch.equal(run["weights"][name], ranks[0]["weights"][name]), f"rank {r} {name}"


@pytest.mark.parametrize("kind", KINDS)
def test_plain_ddp_masks_equal_across_ranks_and_single_process(
    plain_ddp: list[dict[str, Any]], single_process: dict[str, dict[str, Any]], kind: str
) -> None:
    single = single_process[kind]
    assert single["step"] == STEPS
    _assert_runs_agree([rank["train"][kind] for rank in plain_ddp], single)
    # The masks really moved (otherwise equality would prove nothing), at the target sparsity.
    for name, mask in single["masks"].items():
        assert not torch.equal(mask, single["initial"][name]), name
        assert int(mask.sum()) == int(0.25 * mask.numel()), name


@pytest.mark.parametrize("bucket_view", [False, True], ids=["copy", "bucket_view"])
def test_ddp_reduces_masked_grads_on_ordinary_steps_dense_on_rigl_updates(
    plain_ddp: list[dict[str, Any]], bucket_view: bool
) -> None:
    """The post-accumulate-grad hook runs before DDP's reducer reads the gradient: after backward,
    ``p.grad`` is 0 at pruned positions on every rank although the true gradient there is not,
    and equals the all-reduced (global-mean) gradient elsewhere. On RigL's update step it is the
    all-reduced dense gradient everywhere."""
    ranks = [rank["order"][bucket_view] for rank in plain_ddp]
    assert [rec["update_step"] for rec in ranks[0]] == [False, False, True]
    for r, records in enumerate(ranks):
        for step, rec in enumerate(records):
            for name, grad in rec["grads"].items():
                mask, dense = rec["masks"][name], rec["global"][name]
                where = f"rank {r} step {step} {name}"
                # Meaningful: the true gradient at pruned positions is nonzero (except where a
                # unit's every outgoing weight is pruned), and the all-reduce changes gradients.
                assert (dense[~mask] != 0).float().mean() > 0.5, where
                assert not torch.allclose(rec["local"][name], dense), where
                assert torch.equal(grad, ranks[0][step]["grads"][name]), f"{where}: ranks differ"
                if rec["update_step"]:
                    torch.testing.assert_close(grad, dense, atol=1e-12, rtol=0, msg=where)
                else:
                    assert torch.all(grad[~mask] == 0), f"{where}: pruned grad not zeroed"
                    torch.testing.assert_close(
                        grad[mask], dense[mask], atol=1e-12, rtol=0, msg=where
                    )


@pytest.mark.parametrize("kind", lightning_ddp.KINDS)
def test_lightning_ddp_masks_equal_across_ranks_and_single_process(
    lightning_runs: list[dict[str, Any]], kind: str
) -> None:
    ranks = [rank[kind] for rank in lightning_runs]
    assert [run["rank"] for run in ranks] == [0, 1]
    assert all(run["world_size"] == WORLD for run in ranks)
    single = lightning_ddp.fit(kind, devices=1)
    assert single["world_size"] == 1
    assert single["step"] == single["global_step"] == lightning_ddp.STEPS
    assert all(run["global_step"] == lightning_ddp.STEPS for run in ranks)
    _assert_runs_agree(ranks, single)
    for name, mask in single["masks"].items():
        # Some weight that was active at some point is pruned now: the masks moved.
        assert int(single["ever_active"][name].sum()) > int(mask.sum()), name
        assert int(mask.sum()) == int(0.25 * mask.numel()), name


def test_lightning_ddp_broadcasts_no_mask(lightning_runs: list[dict[str, Any]]) -> None:
    """The callback applied sparsity in ``setup``, before ``strategy="ddp"`` wrapped the
    LightningModule, so DDP ignores every mask and ever-active buffer and, the Regressor having
    no other buffer, broadcasts nothing per forward (before: 1 byte per mask and per ever-active
    element, 2816 B per step here)."""
    for rank in lightning_runs:
        for kind in lightning_ddp.KINDS:
            run = rank[kind]
            expected = sorted(f"{name}{end}" for name in run["masks"] for end in SUFFIXES)
            assert run["broadcast_per_step"] == 0, f"rank {rank[kind]['rank']} {kind}"
            assert run["ddp_ignored"] == expected
