"""The per-step path on CUDA: invariants, RigL's dense gradient, SET's CUDA generators, AMP with a
real GradScaler, bit-exact resume, DDP over NCCL and no host sync on ordinary steps.

Every test that needs a GPU is marked ``cuda`` (``tests/conftest.py`` skips it without CUDA).
Where it is cheap a test is parametrized over ``DEVICES``: its CPU variant runs everywhere and
proves the test's own logic, its CUDA variant runs where a GPU is.

Models are Linear stacks on float inputs with a mean-squared error: no ``nn.Embedding`` (its
CUDA backward may sync the host and may use atomics, which would blur both the no-sync and the
bit-exact checks with effects that are not the library's).

Host syncs of an *update* step on CUDA, counted by reading the code (torch 2.x):

- ``drop_grow.shaped_drop_and_grow``: one ``counts.aminmax()`` read by ``int(...)`` per
  parameter (SET, RigL, GraNet); ``mask_ops.drop_and_grow`` / ``topk_mask`` with int counts do
  none (the sampled host-side selection is for CPU rows only);
- ``GMP.update_mask`` / ``topk_mask``: none per parameter;
- ``SparsityAlgorithm.grads_finite``: one per update step, only with ``check_finite`` (set by
  the Lightning callback under a GradScaler);
- ``set_masks_`` and the observers keep statistics as 0-d device tensors: no sync.

So an update step of SET/RigL/GraNet syncs once per sparse parameter (+1 under Lightning AMP);
ordinary steps must not sync at all (``test_ordinary_steps_do_not_sync_the_host``).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_sparse import GMP, SET, GraNet, RigL, SparsityAlgorithm, Static
from tests.core.test_invariants import assert_pruned_state_is_zero
from tests.helpers import assert_state_equal, free_port, one_thread  # noqa: F401  (autouse fixture)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
INF = float("inf")
SPARSITY = 0.8
STEPS = 6

ALGORITHMS: dict[str, Callable[[], SparsityAlgorithm]] = {
    "static": lambda: Static(SPARSITY, seed=1),
    "set": lambda: SET(SPARSITY, update={"freq": 2}, drop_fraction=0.3, seed=2),
    "rigl": lambda: RigL(SPARSITY, update={"freq": 2}, drop_fraction=0.3, seed=3),
    "gmp": lambda: GMP(
        {"type": "cubic", "init": 0.0, "final": SPARSITY, "begin": 0, "end": 4},
        update={"freq": 2},
        seed=4,
    ),
    "granet": lambda: GraNet(
        {"type": "cubic", "init": 0.5, "final": SPARSITY, "begin": 0, "end": 4},
        update={"freq": 2},
        drop_fraction=0.3,
        seed=5,
    ),
}
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def mlp(device: str, seed: int = 0) -> nn.Sequential:
    """Three Linear layers; the default filter sparsifies all three weights."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)
    ).to(device)


def batches(device: str, n: int = STEPS, size: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` deterministic ``(x, y)`` batches, made on the CPU and moved once (no copy later)."""
    g = torch.Generator().manual_seed(123)
    return [
        (
            torch.randn(size, 16, generator=g).to(device),
            torch.randn(size, 8, generator=g).to(device),
        )
        for _ in range(n)
    ]


def setup(
    device: str, make: Callable[[], SparsityAlgorithm], optimizer: str = "adamw"
) -> tuple[nn.Module, SparsityAlgorithm, torch.optim.Optimizer]:
    model = mlp(device)
    sparsity = make()
    model.apply(sparsity)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    sparsity.apply(opt)
    return model, sparsity, opt


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def masks_of(sparsity: SparsityAlgorithm) -> dict[str, torch.Tensor]:
    return {n: sp.mask.detach().clone() for n, sp in sparsity.sparse_params.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs"


# ---------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_invariants_after_every_step_on_the_device(
    device: str, optimizer_name: str, name: str
) -> None:
    model, sparsity, optimizer = setup(device, ALGORITHMS[name], optimizer_name)
    assert len(sparsity.sparse_params) == 3
    initial = masks_of(sparsity)
    for sp in sparsity.sparse_params.values():
        assert sp.mask.device.type == device and sp.mask.dtype == torch.bool
    assert_pruned_state_is_zero(sparsity, optimizer, "after apply")
    for t, (x, y) in enumerate(batches(device)):
        train_step(model, optimizer, x, y)
        assert sparsity.step == t + 1
        assert_pruned_state_is_zero(sparsity, optimizer, f"{name} on {device}, step {t + 1}")
        for sp in sparsity.sparse_params.values():
            assert sp.mask.device.type == device
    # Updates at steps 2 and 4 reach the final target; Static keeps its 80% from the start.
    for n, sp in sparsity.sparse_params.items():
        assert int(sp.mask.sum()) == int((1 - SPARSITY) * sp.mask.numel()), n
    if name != "static":
        changed = [n for n, m in masks_of(sparsity).items() if not torch.equal(m, initial[n])]
        assert changed, f"{name} changed no mask in {STEPS} steps"


# ---------------------------------------------------------------------------- RigL's dense gradient


@pytest.mark.parametrize("device", DEVICES)
def test_rigl_grows_by_the_dense_gradient_on_update_steps(device: str) -> None:
    """Ordinary steps see masked gradients; on the update step (step 2) the gradient stays dense
    through backward and the new mask is: keep the top 70% of ``|w|`` among the active, then grow
    the top ``|dense grad|`` among the rest up to the target (recomputed here in float64 on the
    CPU)."""
    drop = 0.3
    model, sparsity, optimizer = setup(
        device, lambda: RigL(SPARSITY, update={"freq": 2}, drop_fraction=drop, seed=7), "sgd"
    )
    data = batches(device, n=3)
    for t, (x, y) in enumerate(data):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        update = t == 2
        assert sparsity.is_update_step() == update
        before = {}
        for n, sp in sparsity.sparse_params.items():
            pruned_grad = sp.param.grad[~sp.mask]
            if update:
                assert torch.count_nonzero(pruned_grad) > 0, f"{n}: gradient not dense on update"
                before[n] = (
                    sp.param.detach().double().cpu(),
                    sp.param.grad.double().cpu(),
                    sp.mask.cpu().clone(),
                )
            else:
                assert torch.count_nonzero(pruned_grad) == 0, f"{n}: pruned grad on ordinary step"
        optimizer.step()
        for n, (w, g, m) in before.items():
            flat_m = m.flatten()
            active = int(flat_m.sum())
            n_keep = int((1.0 - drop) * active)
            n_total = int((1 - SPARSITY) * m.numel())
            w_score = torch.where(
                flat_m, w.flatten().abs(), torch.tensor(-INF, dtype=torch.float64)
            )
            kept = torch.zeros_like(flat_m)
            kept[torch.topk(w_score, n_keep).indices] = True
            g_score = torch.where(kept, torch.tensor(-INF, dtype=torch.float64), g.flatten().abs())
            grown = torch.zeros_like(flat_m)
            grown[torch.topk(g_score, n_total - n_keep).indices] = True
            expected = (kept | grown).reshape(m.shape)
            new = sparsity.sparse_params[n].mask.cpu()
            assert torch.equal(new, expected), f"{n}: RigL mask differs from the reference"
            assert not torch.equal(new, m), f"{n}: the update changed nothing"
        assert_pruned_state_is_zero(sparsity, optimizer, f"rigl step {t + 1}")


# ---------------------------------------------------------------------------- SET's generators


def _set_run(device: str, seed: int) -> dict[str, torch.Tensor]:
    model, sparsity, optimizer = setup(
        device, lambda: SET(SPARSITY, update={"freq": 1}, drop_fraction=0.5, seed=seed)
    )
    drawn_on: list[str] = []
    make_generator = sparsity.generator

    def spy(name: str, device: torch.device) -> torch.Generator:
        generator = make_generator(name, device)
        drawn_on.append(generator.device.type)
        return generator

    sparsity.generator = spy  # type: ignore[method-assign]
    for x, y in batches(device, n=4):
        train_step(model, optimizer, x, y)
    assert sparsity.last_update_step == 3
    assert drawn_on == [device] * 9, drawn_on  # 3 updates x 3 parameters, generators on device
    return {n: m.cpu() for n, m in masks_of(sparsity).items()}


@pytest.mark.parametrize("device", DEVICES)
def test_set_random_growth_is_deterministic_with_device_generators(device: str) -> None:
    first, second = _set_run(device, seed=11), _set_run(device, seed=11)
    assert_same(first, second, "same seed, two runs")
    other = _set_run(device, seed=12)
    assert any(not torch.equal(first[n], other[n]) for n in first), "the seed changes nothing"


# ---------------------------------------------------------------------------- AMP


class AmpRun:
    """Model + sparsity + SGD(momentum) + a real ``torch.amp.GradScaler(device)`` under fp16."""

    def __init__(self, device: str, sparsity: SparsityAlgorithm) -> None:
        self.device = device
        self.model, self.sparsity, self.optimizer = setup(device, lambda: sparsity, "sgd")
        self.scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        self.optimizer_steps = 0
        self.optimizer.register_step_pre_hook(lambda *a: self._count())
        self.data = batches(device, n=4)

    def _count(self) -> None:
        self.optimizer_steps += 1

    def step(self, t: int, inf_at: tuple[int, int] | None = None) -> None:
        weight = self.model[0].weight
        handle = None
        if inf_at is not None:

            def hook(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad[inf_at] = INF
                return grad

            handle = weight.register_hook(hook)
        x, y = self.data[t]
        self.optimizer.zero_grad()
        with torch.autocast(self.device, dtype=torch.float16):
            out = self.model(x)
        self.scaler.scale(nn.functional.mse_loss(out.float(), y)).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if handle is not None:
            handle.remove()

    def index(self, kept: bool) -> tuple[int, int]:
        i, j = (self.model[0].weight_mask == kept).nonzero()[0].tolist()
        return i, j


AMP_ALGORITHMS = {
    "static": lambda: Static(0.5, seed=1),
    "set_every_step": lambda: SET(0.5, update=None, drop_fraction=0.5, seed=2),
    "rigl_every_step": lambda: RigL(0.5, update=None, drop_fraction=0.5, seed=3),  # dense grads
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(AMP_ALGORITHMS))
def test_fp16_scaler_inf_at_a_pruned_position_does_not_skip_the_step(
    device: str, name: str
) -> None:
    run = AmpRun(device, AMP_ALGORITHMS[name]())
    run.step(0)
    assert run.optimizer_steps == 1 and run.sparsity.step == 1
    scale = run.scaler.get_scale()
    run.step(1, inf_at=run.index(kept=False))
    assert run.optimizer_steps == 2, "the scaler skipped optimizer.step for a pruned inf"
    assert run.scaler.get_scale() == scale, "the scaler saw the inf at the pruned position"
    assert run.sparsity.step == 2
    assert bool(torch.isfinite(run.model[0].weight.grad).all())
    assert_pruned_state_is_zero(run.sparsity, run.optimizer, f"{name} after a pruned inf")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [SET, RigL], ids=["set", "rigl"])
def test_fp16_scaler_inf_at_a_kept_position_skips_step_and_mask_update(
    device: str, cls: type
) -> None:
    run = AmpRun(device, cls(0.5, update=None, drop_fraction=0.5, seed=4))  # updates every step
    run.step(0)
    scale, masks = run.scaler.get_scale(), masks_of(run.sparsity)
    weights = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    run.step(1, inf_at=run.index(kept=True))
    assert run.optimizer_steps == 1, "optimizer.step ran despite an inf at a kept position"
    assert run.scaler.get_scale() == scale * 0.5
    assert run.sparsity.step == 1, "a skipped step advanced sparsity.step"
    assert_same(masks_of(run.sparsity), masks, "a skipped step changed a mask")
    assert_same({n: p.detach() for n, p in run.model.named_parameters()}, weights, "weights moved")
    run.step(1)  # the same step, clean: now the update runs
    assert run.optimizer_steps == 2 and run.sparsity.step == 2
    assert any(not torch.equal(m, masks[n]) for n, m in masks_of(run.sparsity).items())
    assert_pruned_state_is_zero(run.sparsity, run.optimizer, "after the clean retry")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["static", "rigl", "granet"])
def test_bf16_autocast_keeps_the_invariants(device: str, name: str) -> None:
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    model, sparsity, optimizer = setup(device, ALGORITHMS[name])
    for t, (x, y) in enumerate(batches(device)):
        optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16
        nn.functional.mse_loss(out.float(), y).backward()
        optimizer.step()
        assert_pruned_state_is_zero(sparsity, optimizer, f"bf16 {name} step {t + 1}")
    for n, sp in sparsity.sparse_params.items():
        assert int(sp.mask.sum()) == int((1 - SPARSITY) * sp.mask.numel()), n


# ---------------------------------------------------------------------------- checkpoint / resume


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["static", "set", "rigl", "granet"])
def test_resume_from_a_saved_state_dict_is_bit_exact(device: str, name: str) -> None:
    """model + optimizer + algorithm state through ``torch.save`` and ``torch.load`` to the CPU
    (as a checkpoint file is usually read), loaded into new objects on the device: the resumed
    run equals the uninterrupted one bit for bit."""
    data = batches(device, n=8)
    model, sparsity, optimizer = setup(device, ALGORITHMS[name])
    for x, y in data:
        train_step(model, optimizer, x, y)

    model_a, sparsity_a, optimizer_a = setup(device, ALGORITHMS[name])
    for x, y in data[:3]:  # stop between updates (2, 4, 6)
        train_step(model_a, optimizer_a, x, y)
    buffer = io.BytesIO()
    torch.save(
        {"model": model_a.state_dict(), "optim": optimizer_a.state_dict(),
         "sparsity": sparsity_a.state_dict()},
        buffer,
    )  # fmt: skip
    buffer.seek(0)
    saved = torch.load(buffer, map_location="cpu", weights_only=True)
    model_b, sparsity_b, optimizer_b = setup(device, ALGORITHMS[name])
    model_b.load_state_dict(saved["model"])
    optimizer_b.load_state_dict(saved["optim"])
    sparsity_b.load_state_dict(saved["sparsity"])
    for x, y in data[3:]:
        train_step(model_b, optimizer_b, x, y)

    assert sparsity_b.step == sparsity.step == 8
    assert_same(model_b.state_dict(), model.state_dict(), "model state after resume")
    for p, q in zip(model.parameters(), model_b.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            if torch.is_tensor(value):
                assert torch.equal(value, optimizer_b.state[q][key]), f"optimizer state {key}"
    assert_state_equal(sparsity_b.state_dict(), sparsity.state_dict())
    assert_pruned_state_is_zero(sparsity_b, optimizer_b, "after resume")


# ---------------------------------------------------------------------------- DDP over NCCL


def _ddp_worker(rank: int, world: int, port: int, outdir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        device = f"cuda:{rank}"
        model = mlp(device)
        sparsity = RigL(SPARSITY, update={"freq": 2}, drop_fraction=0.3, seed=9)
        model.apply(sparsity)
        # No buffer broadcast: each rank keeps the masks it computed (rank 0's would otherwise
        # overwrite rank 1's at every forward and hide a divergence).
        net = DistributedDataParallel(model, device_ids=[rank], broadcast_buffers=False)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        sparsity.apply(optimizer)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for _ in range(STEPS):
            x, y = (
                torch.randn(8, 16, generator=g).to(device),
                torch.randn(8, 8, generator=g).to(device),
            )
            train_step(net, optimizer, x, y)
        assert_pruned_state_is_zero(sparsity, optimizer, f"rank {rank}")
        torch.save(
            {
                "step": sparsity.step,
                "masks": {n: m.cpu() for n, m in masks_of(sparsity).items()},
                "weights": {n: p.detach().cpu() for n, p in model.named_parameters()},
            },
            os.path.join(outdir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="DDP over NCCL needs two GPUs (torch.cuda.device_count() >= 2)",
)
def test_ddp_nccl_ranks_make_the_same_rigl_masks(tmp_path: object) -> None:
    """Two ranks on different data: RigL grows by the all-reduced dense gradient and SET-style
    randomness is keyed by (seed, step, name), so both ranks hold the same masks."""
    world = 2
    mp.spawn(_ddp_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(os.path.join(str(tmp_path), f"rank{r}.pt")) for r in range(world)]
    assert results[0]["step"] == results[1]["step"] == STEPS
    assert_same(results[0]["masks"], results[1]["masks"], "rank 0 vs rank 1 masks")
    for name, weight in results[0]["weights"].items():  # same all-reduced gradients, same steps
        torch.testing.assert_close(weight, results[1]["weights"][name], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- no host sync


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "make",
    [lambda: Static(SPARSITY, seed=1), lambda: RigL(SPARSITY, update={"freq": 4}, seed=2)],
    ids=["static", "rigl"],
)
def test_ordinary_steps_do_not_sync_the_host(
    make: Callable[[], SparsityAlgorithm], optimizer_name: str
) -> None:
    """Non-update steps run under ``torch.cuda.set_sync_debug_mode("error")``: any host sync in
    backward's gradient hooks, the step pre-hook or the post-step re-prune raises. Update steps
    (RigL at 4 and 8) run outside it: they sync once per parameter (module docstring)."""
    device = "cuda"
    data = batches(device, n=10)

    def guarded(step: Callable[[], None]) -> None:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()

    # The loop itself, dense: if this syncs, it is torch's doing, not the library's.
    dense = mlp(device)
    dense_opt = OPTIMIZERS[optimizer_name](list(dense.parameters()))
    train_step(dense, dense_opt, *data[0])  # first step outside: lazy optimizer state
    guarded(lambda: train_step(dense, dense_opt, *data[1]))

    model, sparsity, optimizer = setup(device, make, optimizer_name)
    train_step(model, optimizer, *data[0])  # first step outside: lazy optimizer state, first sync
    guarded_steps = 0
    for x, y in data[1:]:
        if sparsity.is_update_step():
            train_step(model, optimizer, x, y)
        else:
            guarded(lambda x=x, y=y: train_step(model, optimizer, x, y))
            guarded_steps += 1
        assert_pruned_state_is_zero(sparsity, optimizer, f"step {sparsity.step}")
    assert guarded_steps >= 7
    assert sparsity.step == 10


# ---------------------------------------------------------------------------- memory (issue 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["static", "rigl"])
def test_masks_cost_their_bool_bytes(device: str, name: str, dtype: torch.dtype) -> None:
    """What the algorithm adds per masked weight beyond weights and optimizer state: the bool
    mask, and the ever-active set where ITOP is tracked; the pruning product runs compiled
    (`fused_mask`), not per tensor (on the CPU through the GPU's path, `as_on_a_gpu`). The last
    update's figures, 0-d tensors, are a cost per masked tensor (the first GPU run, 2026-11-28,
    counted them per weight: 48 B over this model's 1792 masked weights read 2.027 B)."""
    from benchmarks.held import bytes_per_masked_weight
    from benchmarks.step_ops import as_on_a_gpu
    from lightning_sparse.core import fused_mask

    with as_on_a_gpu() if device == "cpu" else contextlib.nullcontext():
        model = mlp(device).to(dtype)
        sparsity = ALGORITHMS[name]()
        model.apply(sparsity)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        sparsity.apply(optimizer)
        for x, y in batches(device):
            train_step(model, optimizer, x.to(dtype), y.to(dtype))
        per_weight, kinds = bytes_per_masked_weight(model, sparsity, optimizer)
    limit = 2.0 if sparsity.ever_active else 1.0
    assert per_weight == limit, kinds
    figures = 4  # dropped, grown, sparsity, itop: 0-d tensors of 4 B each
    assert kinds["scalars"] <= figures * 4 * len(sparsity.sparse_params), kinds
    assert not fused_mask._broken, f"the fused pruning kernel did not compile on {device}"


@pytest.mark.cuda
def test_nothing_stays_on_the_gpu_after_the_model_leaves_it() -> None:
    """Trained on CUDA (a mask update included), moved to the CPU, the optimizer dropped (its
    state is the user's): no CUDA memory is left allocated by the algorithm."""
    import gc

    warm_model, _, warm_optimizer = setup("cuda", ALGORITHMS["static"])  # cuBLAS workspaces,
    train_step(warm_model, warm_optimizer, *batches("cuda", n=1)[0])  # kept by the handles
    del warm_model, warm_optimizer
    gc.collect()
    before = torch.cuda.memory_allocated()
    model, sparsity, optimizer = setup("cuda", ALGORITHMS["rigl"])
    for x, y in batches("cuda"):
        train_step(model, optimizer, x, y)
    assert sparsity.last_update
    del x, y, optimizer
    model.cpu()
    gc.collect()
    assert torch.cuda.memory_allocated() == before
    assert all(sp.mask.device.type == "cpu" for sp in sparsity.sparse_params.values())


@pytest.mark.cuda
def test_fused_adamw_under_a_grad_scaler_makes_no_host_sync_on_ordinary_steps() -> None:
    """The scaler's ``found_inf`` of a fused step is read asynchronously (`scaler_steps`):
    ordinary fp16 steps run under ``set_sync_debug_mode("error")``."""
    data = batches("cuda", n=8)
    model = mlp("cuda")
    sparsity = Static(SPARSITY, seed=1)
    model.apply(sparsity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    sparsity.apply(optimizer)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    step(*data[0])  # lazy state, the first compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in data[1:]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sparsity.step == 8
