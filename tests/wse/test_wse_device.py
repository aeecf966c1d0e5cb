"""The emulated wafer-scale device (``accelerator="wse"``) against the CPU accelerator.

The device must train exactly like masked dense training: bit-identical without a sparsity
callback; with one, losses, gradients (the dense gradient on RigL/GraNet update steps included),
weights and masks equal to ``accelerator="cpu"`` to float64 rounding, for every algorithm, AdamW
and SGD, with gradient accumulation; checkpoints move between the two; two systems under
``"wse_ddp"`` equal one CPU process; FLOP statistics follow the nonzeros (hand counts).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import Logger
from torch import nn

from lightning_sparse import GMP, SET, GraNet, RigL, SparsityAlgorithm, Static
from lightning_sparse.models import LitCausalLM
from lightning_sparse.models.llama import Llama, LlamaConfig, generate
from lightning_sparse.wse import (
    WSEAccelerator,
    WSELinear,
    WSEStrategy,
    compiled_available,
    install_executor,
    on_wse,
    register_masks,
)
from tests.helpers import (  # one_thread: autouse fixture
    REPO,
    TinyLM,
    full_state,
    one_thread,  # noqa: F401
    repeated_batch_loader,
    run_ddp_script,
    token_loader,
    trainer,
)
from tests.scripts import lightning_ddp

# Tests run the CSR kernels themselves: "auto" could pick the dense path for these tiny layers.
PATH = "compiled" if compiled_available() else "torch"
STEPS = 10
pytestmark = pytest.mark.filterwarnings("ignore:.*[Ss]parse.*:UserWarning")


class TinyLlamaLM(pl.LightningModule):
    """Next-token loss of a two-block float64 Llama on 16 token ids."""

    def __init__(self, optimizer: str = "adamw", dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = LlamaConfig.from_preset("tiny", vocab_size=16, max_seq_len=16)
        self.model = Llama(cfg).to(dtype)
        self.optimizer = optimizer

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class Recorder(pl.Callback):
    """Losses per batch and sparse-weight gradients per optimizer step, seen before the sparsity
    callback's ``on_before_optimizer_step`` (list it first), so RigL's dense gradient shows."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.masks: list[dict[str, torch.Tensor]] = []  # before each step's mask update

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *a: Any):
        self.losses.append(outputs["loss"].detach().clone())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any):
        grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        executor = getattr(trainer.accelerator, "executor", None)
        if executor is not None:  # compact layers: their value gradients, as dense tensors
            grads.update(executor.dense_grads())
        self.grads.append(grads)
        masks = pl_module.named_buffers()
        self.masks.append({n[: -len("_mask")]: m.clone() for n, m in masks if n.endswith("_mask")})


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    name = "memory"
    version = 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def _trainer(accelerator: Any, callbacks: list, **kwargs: Any) -> pl.Trainer:
    # Not deterministic=True: torch's CSR ops have no deterministic implementation.
    return trainer(
        accelerator=accelerator, callbacks=callbacks, deterministic=False,
        **{"max_steps": STEPS, **kwargs},
    )  # fmt: skip


def _fit(
    accelerator: Any,
    make_algorithm: Any = None,
    optimizer: str = "adamw",
    accumulate: int = 1,
    dtype: torch.dtype = torch.float64,
    loader: Any = None,
) -> dict[str, Any]:
    module = TinyLlamaLM(optimizer, dtype)
    recorder = Recorder()
    algorithm = make_algorithm() if make_algorithm else None
    callbacks = [recorder] + ([algorithm] if algorithm else [])
    trainer = _trainer(accelerator, callbacks, accumulate_grad_batches=accumulate)
    trainer.fit(module, loader if loader is not None else token_loader(n=64 * accumulate))
    return {
        "losses": torch.stack(recorder.losses),
        "grads": recorder.grads,
        "masks": recorder.masks,
        "state": full_state(module),
        "algorithm": algorithm,
        "trainer": trainer,
        "module": module,
    }


def _wse() -> WSEAccelerator:
    return WSEAccelerator(kernel_path=PATH)


# ------------------------------------------------------------------ registration, no sparsity
def test_names_registered_for_python_and_yaml() -> None:
    from lightning.pytorch.cli import LightningCLI

    trainer = pl.Trainer(accelerator="wse", logger=False)
    assert isinstance(trainer.accelerator, WSEAccelerator)
    trainer = pl.Trainer(accelerator="cpu", strategy="wse", logger=False)  # the strategy upgrades
    assert isinstance(trainer.strategy, WSEStrategy)
    assert isinstance(trainer.accelerator, WSEAccelerator)
    trainer = pl.Trainer(accelerator="cpu", strategy="wse_ddp", devices=2, logger=False)
    assert isinstance(trainer.accelerator, WSEAccelerator)
    assert trainer.strategy.process_group_backend == "gloo"
    pytest.importorskip("jsonargparse")  # LightningCLI's (an optional package)
    cli = LightningCLI(
        TinyLM,
        run=False,
        args=["--trainer.accelerator=wse", "--trainer.logger=false"],
    )
    assert isinstance(cli.trainer.accelerator, WSEAccelerator)


def test_without_sparsity_bit_identical_to_cpu_and_layers_restored() -> None:
    cpu = _fit("cpu", dtype=torch.float32)
    wse = _fit(_wse(), dtype=torch.float32)
    assert torch.equal(cpu["losses"], wse["losses"])
    assert cpu["state"].keys() == wse["state"].keys()
    for key, value in cpu["state"].items():
        assert torch.equal(value, wse["state"][key]), key
    # Teardown gave every layer its class back; the device counted dense work only.
    assert not any(isinstance(m, WSELinear) for m in wse["module"].modules())
    stats = wse["trainer"].accelerator.stats.as_dict()
    assert stats["total_flops_executed"] == stats["total_flops_dense"] > 0


# ------------------------------------------------------------------ equality with the CPU
ALGORITHMS = {
    "static": lambda: Static(0.75, seed=1),
    "gmp": lambda: GMP(
        {"type": "cubic", "init": 0.0, "final": 0.7, "begin": 0, "end": 8}, update={"freq": 2}
    ),
    "set": lambda: SET(0.75, update={"freq": 3}, drop_fraction=0.3, seed=1),
    "rigl": lambda: RigL(0.75, update={"freq": 3}, drop_fraction=0.3, seed=1),
    "granet": lambda: GraNet(
        {"type": "cubic", "init": 0.3, "final": 0.8, "begin": 0, "end": 8},
        update={"freq": 2},
        drop_fraction=0.3,
    ),
}
CASES = [
    ("static", "sgd", 1),
    ("static", "adamw", 2),
    ("gmp", "adamw", 1),
    ("gmp", "sgd", 2),
    ("set", "sgd", 1),
    ("set", "adamw", 2),
    ("rigl", "adamw", 1),
    ("rigl", "sgd", 2),
    ("granet", "adamw", 2),
    ("granet", "sgd", 1),
]


def _assert_same_training(cpu: dict[str, Any], wse: dict[str, Any]) -> None:
    tol = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(wse["losses"], cpu["losses"], **tol)
    assert len(wse["grads"]) == len(cpu["grads"]) == STEPS
    for step, (g_cpu, g_wse) in enumerate(zip(cpu["grads"], wse["grads"], strict=True)):
        masks = cpu["masks"][step]
        for name, grad in g_cpu.items():
            got, what = g_wse[name], f"grad {name} @ {step}"
            if name in masks and candidates_only(got, grad, masks[name]):
                continue
            torch.testing.assert_close(got, grad, **tol, msg=what)
    for key, value in cpu["state"].items():
        if key.endswith("_mask"):
            assert torch.equal(wse["state"][key], value), key
        else:
            torch.testing.assert_close(wse["state"][key], value, **tol, msg=key)


def candidates_only(got: torch.Tensor, grad: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``got`` is the gradient a compact layer keeps on a RigL/GraNet update step
    without accumulation: ``grad`` at the kept positions, and outside the mask at its top
    positions by ``|grad|`` only (the grow candidates), zero elsewhere; asserts it is exactly
    that when it differs from ``grad``."""
    outside = ~mask
    close = dict(rtol=1e-9, atol=1e-12)
    if torch.allclose(got, grad, **close) or not torch.allclose(got[mask], grad[mask], **close):
        return False
    support = outside & (got != 0)
    assert support.any()
    torch.testing.assert_close(got[support], grad[support], **close)
    assert not got[outside & ~support].any()
    # Every position outside the mask whose |grad| beats the weakest candidate is a candidate.
    weakest = grad[support].abs().min()
    assert not (outside & ~support & (grad.abs() > weakest)).any()
    return True


DENSE_STATE_CASES = [("static", "adamw", 2), ("rigl", "sgd", 2), ("granet", "adamw", 2)]


@pytest.mark.parametrize(
    ("kind", "optimizer", "accumulate", "compact"),
    [(*case, True) for case in CASES] + [(*case, False) for case in DENSE_STATE_CASES],
)
def test_training_matches_cpu(kind: str, optimizer: str, accumulate: int, compact: bool) -> None:
    """Compact training (the default) and the dense training state both equal the cpu path."""
    cpu = _fit("cpu", ALGORITHMS[kind], optimizer, accumulate)
    wse = _fit(WSEAccelerator(kernel_path=PATH, compact=compact), ALGORITHMS[kind], optimizer,
               accumulate)  # fmt: skip
    _assert_same_training(cpu, wse)
    algorithm: SparsityAlgorithm = wse["algorithm"]
    assert algorithm.step == STEPS
    stats = wse["trainer"].accelerator.stats
    updates = [s for s in range(STEPS) if kind != "static" and algorithm.is_update_step(s)]
    # Dense weight gradients exactly on RigL/GraNet update steps, and nowhere else.
    assert stats.dense_grad_steps == (len(updates) if kind in ("rigl", "granet") else 0)
    # Sparse layers executed fewer FLOPs than dense; every mask change rebuilt the structures.
    assert stats.total_flops["forward"][0] < stats.total_flops["forward"][1]
    assert stats.total_rebuilds >= 14  # 14 masked layers, built at least once
    if kind in ("set", "rigl") and compact:  # each update's new structure, built at its step
        assert stats.total_rebuilds == 14 * (1 + len(updates))
    elif kind in ("set", "rigl"):  # an update inside the last step has no forward after it
        assert stats.total_rebuilds == 14 * (1 + len([s for s in updates if s < STEPS - 1]))


def test_rebuilds_follow_mask_updates_and_stats_are_logged() -> None:
    logger = MemoryLogger()
    module = TinyLlamaLM("sgd")
    callbacks = [ALGORITHMS["rigl"](), DeviceStatsMonitor()]
    trainer = _trainer(_wse(), callbacks, logger=logger, log_every_n_steps=1, max_steps=7)
    trainer.fit(module, token_loader())
    rows = [m for _, m in logger.rows if "wse/rebuilds" in m]
    assert len(rows) == 7
    # Each figure once: DeviceStatsMonitor logs the CPU's figures, not the wse/ ones again.
    keys = {k for _, m in logger.rows for k in m}
    wse_keys = {k.removeprefix("wse/") for k in keys if k.startswith("wse/")}
    device_keys = {k.rsplit("/", 1)[1] for k in keys if k.startswith("DeviceStatsMonitor.")}
    assert wse_keys and device_keys and not wse_keys & device_keys
    # Built at the first step; rebuilt in each update step (updates at steps 3, 6), where the
    # compact layers take their new structure right after the optimizer step.
    assert [r["wse/rebuilds"] for r in rows] == [14, 0, 0, 14, 0, 0, 14]
    dense_grad_steps = [i for i, r in enumerate(rows) if r["wse/flops_dense_weight_grad"] > 0]
    assert dense_grad_steps == [3, 6]
    for r in rows:
        assert 0 < r["wse/weight_bytes_ratio_csr"] < 1
        assert 0 < r["wse/flops_ratio"] < 1


def test_device_line_at_setup_and_statistics_in_the_run_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_sparse.lightning.summary import SparseRunSummary

    summary = SparseRunSummary(path=str(tmp_path / "summary.json"), print_layers=False)
    trainer = _trainer(_wse(), [ALGORITHMS["rigl"](), summary], max_steps=4)
    with caplog.at_level("INFO"):
        trainer.fit(TinyLlamaLM("sgd"), token_loader())
    assert f"lightning-sparse: WSE device: 14 masked layers in CSR, 1 unmasked layers dense, " \
        f"kernels {PATH}" in caplog.text  # fmt: skip
    device = summary.summary["device"]  # type: ignore[index]
    stats = trainer.accelerator.stats
    assert device["steps"] == 4 and device["rebuilds"] == stats.total_rebuilds > 0
    assert 0 < device["flops_executed"] < device["flops_dense"]
    assert 0 < device["weight_bytes_csr"] < device["weight_bytes_dense"]
    out = capsys.readouterr().out
    assert "WSE device (4 steps; Linear-layer matmuls, training and validation):" in out
    assert f"  CSR rebuilds {device['rebuilds']} (" in out
    assert f"  FLOPs executed {device['flops_executed']:.3e} vs " in out


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize(("first", "second"), [("wse", "cpu"), ("cpu", "wse")])
def test_checkpoint_moves_between_cpu_and_wse(first: str, second: str, tmp_path: Path) -> None:
    def accelerator(name: str) -> Any:
        return _wse() if name == "wse" else "cpu"

    module = TinyLlamaLM()
    algorithm = ALGORITHMS["rigl"]()
    trainer = _trainer(accelerator(first), [algorithm], max_steps=5)
    trainer.fit(module, repeated_batch_loader())
    path = tmp_path / "half.ckpt"
    trainer.save_checkpoint(path)
    saved = full_state(module)
    assert not any(isinstance(m, WSELinear) for m in module.modules())
    assert set(torch.load(path, weights_only=True)["state_dict"]) == set(module.state_dict())

    class Restored(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            self.state = full_state(pl_module)

    resumed, restored = TinyLlamaLM(), Restored()
    trainer = _trainer(accelerator(second), [ALGORITHMS["rigl"](), restored], max_steps=STEPS)
    trainer.fit(resumed, repeated_batch_loader(), ckpt_path=path)
    for key, value in saved.items():  # restored bit-exactly on the other accelerator
        assert torch.equal(restored.state[key], value), key
    straight = _fit("cpu", ALGORITHMS["rigl"], loader=repeated_batch_loader())["state"]
    now = full_state(resumed)
    assert now.keys() == straight.keys()
    for key, value in straight.items():  # and the rest of the run as if uninterrupted
        if key.endswith("_mask"):
            assert torch.equal(now[key], value), key
        else:
            torch.testing.assert_close(now[key], value, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ a cluster of two systems
def test_two_systems_equal_one_cpu_process(tmp_path: Path) -> None:
    script = REPO / "tests" / "scripts" / "wse_ddp.py"
    env = {"WSE_TEST_KERNEL_PATH": PATH}
    ranks = run_ddp_script(script, tmp_path, "wse_ddp", 150, env=env, weights_only=False)
    for kind in lightning_ddp.KINDS:
        single = lightning_ddp.fit(kind, devices=1)  # one CPU process, the global batch
        runs = [rank[kind] for rank in ranks]
        assert [r["rank"] for r in runs] == [0, 1]
        for r, run in enumerate(runs):
            assert (run["world_size"], run["backend"]) == (2, "gloo")
            assert run["accelerator"] == "WSEAccelerator"
            assert run["linear_classes"] == ["Linear"]  # restored after fit
            assert run["stats"]["total_flops_executed"] < run["stats"]["total_flops_dense"]
            assert sorted(run["history"]) == sorted(single["history"]), f"rank {r}"
            for step, masks in single["history"].items():
                for name, mask in masks.items():
                    assert torch.equal(run["history"][step][name], mask), (r, kind, name, step)
            for name, mask in single["masks"].items():
                assert torch.equal(run["masks"][name], mask), (r, kind, name)
            for name, w in single["weights"].items():
                torch.testing.assert_close(run["weights"][name], w, atol=1e-10, rtol=0)
                assert torch.equal(run["weights"][name], runs[0]["weights"][name]), (r, name)


# ------------------------------------------------------------------ statistics by hand
def test_flops_hand_count_and_masks_appearing_later() -> None:
    """Linear 4x6 with 7 kept weights, 3 tokens: forward, input grad and weight grad each
    2 * 3 * 7 = 42 FLOPs (dense: 2 * 3 * 24 = 144); a RigL update step's weight grad is dense."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4, bias=False).double()
    executor = install_executor(layer, path=PATH)
    assert type(layer) is WSELinear
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()  # no mask yet: dense
    assert executor.stats.end_step()["flops_executed"] == 3 * 144

    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask.view(-1)[[0, 3, 5, 8, 13, 17, 23]] = True
    layer.register_buffer("weight_mask", mask)  # appears after installation
    with torch.no_grad():
        layer.weight.mul_(mask)
    layer.weight.grad = None
    y = layer(x)
    y.sum().backward()
    figures = executor.stats.end_step()
    assert (figures["flops_forward"], figures["flops_forward_dense"]) == (42, 144)
    assert (figures["flops_input_grad"], figures["flops_input_grad_dense"]) == (42, 144)
    assert (figures["flops_weight_grad"], figures["flops_weight_grad_dense"]) == (42, 144)
    assert figures["flops_dense_weight_grad"] == 0 and figures["rebuilds"] == 1
    torch.testing.assert_close(y, F.linear(x, layer.weight * mask))
    assert torch.all(layer.weight.grad[~mask] == 0)
    memory = executor.stats.memory_dict()  # 7 * (8 + 2) + 5 * 4: values, 16-bit cols, rows
    assert (memory["weight_bytes_dense"], memory["weight_bytes_csr"]) == (192, 90)
    assert memory["weight_bytes_ratio_csr"] == 90 / 192
    executor.remove()
    assert type(layer) is nn.Linear and "weight_mask" in dict(layer.named_buffers())

    # RigL (keep int(0.3 * 24) = 7): step 1 is an update step, its backward's weight grad dense.
    layer = nn.Linear(6, 4, bias=False).double()
    rigl = RigL(0.7, update={"freq": 1}, drop_fraction=0.5)
    layer.apply(rigl)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    rigl.apply(optimizer)
    with on_wse(layer, path=PATH) as executor:
        for step in range(2):
            x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
            optimizer.zero_grad()
            layer(x).sum().backward()
            if step == 1:  # the dense gradient reached the update, equal to grad_Y^T X
                torch.testing.assert_close(layer.weight.grad, torch.ones(4, 3).double() @ x)
            optimizer.step()
            figures = executor.stats.end_step()
            assert (figures["flops_forward"], figures["flops_input_grad"]) == (42, 42)
            expected = (0, 144) if step == 1 else (42, 0)
            assert (figures["flops_weight_grad"], figures["flops_dense_weight_grad"]) == expected
    assert type(layer) is nn.Linear


# ------------------------------------------------------------------ bad input, fallbacks
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true"])
def test_unsupported_precision_is_a_clear_error(precision: str) -> None:
    with pytest.raises(ValueError, match="does not support precision"):
        pl.Trainer(accelerator="cpu", strategy="wse", precision=precision, logger=False)
    trainer = _trainer("wse", [Static(0.5)], precision=precision, max_steps=1)
    with pytest.raises(ValueError, match="does not support precision"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyLlamaLM(dtype=torch.float32), token_loader())


def test_wrong_accelerator_or_backend_for_wse_strategies() -> None:
    from lightning.pytorch.accelerators import CUDAAccelerator

    from lightning_sparse.wse import WSEDDPStrategy

    with pytest.raises(ValueError, match="accelerator='wse'"):
        WSEStrategy(accelerator=CUDAAccelerator())
    with pytest.raises(ValueError, match="gloo"):
        WSEDDPStrategy(process_group_backend="nccl")
    with pytest.raises(ValueError, match="kernel_path"):
        WSEAccelerator(kernel_path="fast")


def test_auto_on_a_gpu_machine_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Lightning counts a GPU, ``accelerator="auto"`` becomes CUDA before the strategy
    sees it: the error says to pass 'cpu' or 'wse', which work there."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pytorch_cuda

    for module in (fabric_cuda, pytorch_cuda):
        monkeypatch.setattr(module, "num_cuda_devices", lambda: 1)
    with pytest.raises(ValueError, match=r"accelerator='wse' or 'cpu' \(accelerator='auto' picks"):
        pl.Trainer(strategy="wse", logger=False)
    for accelerator in ("cpu", "wse"):
        trainer = pl.Trainer(accelerator=accelerator, strategy="wse", logger=False)
        assert isinstance(trainer.accelerator, WSEAccelerator)


class ConvEmbedNet(pl.LightningModule):
    """A masked Conv2d and a masked Embedding (the device cannot run them in CSR) beside a
    masked Linear (it can)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8).double()
        self.conv = nn.Conv2d(1, 4, 3, padding=1).double()
        self.fc = nn.Linear(8 * 4 * 8, 16).double()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        h = self.conv(self.embed(tokens[:, :8]).unsqueeze(1))  # [B, 4, 8, 8]
        return F.cross_entropy(self.fc(h.flatten(1)), tokens[:, 8])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_masked_conv_and_embedding_fall_back_to_dense_with_one_warning() -> None:
    def fit(accelerator: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
        module = ConvEmbedNet()
        algorithm = RigL(
            0.6, update={"freq": 2}, param_filter=["embed.weight", "conv.weight", "fc.weight"]
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer(accelerator, [algorithm], max_steps=6).fit(module, token_loader())
        ours = [str(w.message) for w in caught if "lightning_sparse.wse" in str(w.message)]
        return full_state(module), ours

    cpu, none = fit("cpu")
    wse, warned = fit(_wse())
    assert none == []
    assert len(warned) == 2, warned  # once per module, not once per step
    assert any("'embed'" in w for w in warned) and any("'conv'" in w for w in warned)
    for key, value in cpu.items():
        if key.endswith("_mask"):
            assert torch.equal(wse[key], value), key
        else:
            torch.testing.assert_close(wse[key], value, rtol=1e-9, atol=1e-12, msg=key)


# ------------------------------------------------------------------ inference
def test_predict_and_generate_from_a_sparse_checkpoint_run_in_csr(tmp_path: Path) -> None:
    def lit() -> LitCausalLM:
        torch.manual_seed(0)
        tiny = dict(vocab_size=16, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
        return LitCausalLM(**tiny, max_new_tokens=6, temperature=0.0).double()

    module, sparsity = lit(), Static(0.8, param_filter="*layers.*_proj.weight")
    module.apply(sparsity)
    path = tmp_path / "sparse.ckpt"
    checkpoint = {
        "state_dict": module.state_dict(),
        "sparsity": {"Static": sparsity.state_dict()},
        "pytorch-lightning_version": pl.__version__,
    }
    torch.save(checkpoint, path)  # what a sparse run's checkpoint holds for inference
    prompts = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(prompts), batch_size=1)

    def predict(accelerator: Any) -> tuple[torch.Tensor, Any]:
        trainer = _trainer(accelerator, [Static(0.8, param_filter="*layers.*_proj.weight")])
        out = trainer.predict(lit(), loader, ckpt_path=path)
        return torch.cat(out), trainer

    cpu, _ = predict("cpu")
    wse, trainer = predict(_wse())
    assert torch.equal(cpu, wse)
    stats = trainer.accelerator.stats
    assert stats.total_flops["forward"][0] < 0.5 * stats.total_flops["forward"][1]
    assert stats.total_rebuilds == 14

    # Without the algorithm: register the checkpoint's masks, load, generate batch-1 on the device.
    saved = torch.load(path, weights_only=True)
    plain = lit()
    assert len(register_masks(plain, saved)) == 14
    plain.load_state_dict(saved["state_dict"])
    reference = generate(plain.model, prompts[:1], 6, 16, temperature=0.0)
    with on_wse(plain, path=PATH) as executor:
        tokens = plain.model.generate(prompts[:1], max_new_tokens=6, temperature=0.0)
    assert torch.equal(tokens, reference) and torch.equal(tokens, cpu[:1])
    forward = executor.stats.total_flops["forward"]
    assert executor.stats.total_rebuilds == 14 and forward[0] < 0.5 * forward[1]


# ------------------------------------------------------------------ inference fast path
@pytest.mark.parametrize("path", sorted({PATH, "torch", "dense"}))
def test_inference_follows_every_change_of_weight_mask_and_bias(path: str) -> None:
    """Without autograd the device reuses gathered values and a resolved runner; every write
    to the weight (optimizer step, load_state_dict), a mask update and a new bias must show."""
    torch.manual_seed(0)
    layer = nn.Linear(12, 10)
    layer.apply(Static(0.7, param_filter="weight"))
    mask = layer.weight_mask

    def expected(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight * layer.weight_mask, layer.bias)

    with on_wse(layer, path=path) as executor:
        x = torch.randn(3, 12)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), expected(x))
            torch.testing.assert_close(layer(x[:1]), expected(x[:1]))  # another token count
            layer.weight.mul_(2.0)  # an optimizer-like in-place write
            torch.testing.assert_close(layer(x), expected(x))
            # A write at pruned positions (outside any algorithm): the result stays masked.
            layer.weight.add_(1.0)
            torch.testing.assert_close(layer(x), expected(x))
            layer.load_state_dict({**layer.state_dict(), "weight": torch.randn(10, 12)})
            torch.testing.assert_close(layer(x), expected(x))
            mask.copy_(torch.rand(10, 12) < 0.5)  # a mask update
            torch.testing.assert_close(layer(x), expected(x))
            layer.bias = nn.Parameter(torch.randn(10))
            torch.testing.assert_close(layer(x), expected(x))
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), expected(x))
            fresh = torch.randn(2, 12)  # an inference tensor input
            torch.testing.assert_close(layer(fresh), expected(fresh))
        # Grad mode again: the training path, a graph to the weight.
        y = layer(x)
        assert y.requires_grad
        y.sum().backward()
        assert torch.all(layer.weight.grad[~mask] == 0)
        nnz = int(mask.sum())
        executor.stats.end_step()
        with torch.no_grad():
            layer(x)
            layer(x)
        # Executed FLOPs: the kept weights on a sparse path, every weight on the dense one.
        executed = layer.weight.numel() if path == "dense" else nnz
        assert executor.stats.end_step()["flops_forward"] == 2 * 2 * 3 * executed


def test_inference_of_a_model_built_under_inference_mode() -> None:
    with torch.inference_mode():  # weights and masks are inference tensors: no version counter
        torch.manual_seed(1)
        layer = nn.Linear(8, 6, bias=False)
        layer.apply(Static(0.5))
        x = torch.randn(4, 8)
        with on_wse(layer, path=PATH):
            y = layer(x)
            layer.weight.mul_(3.0)
            z = layer(x)
        torch.testing.assert_close(y, F.linear(x, layer.weight / 3.0 * layer.weight_mask))
        torch.testing.assert_close(z, F.linear(x, layer.weight * layer.weight_mask))


def test_cached_generate_on_the_device_equals_masked_dense() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny")).eval()
    model.apply(Static(0.8, param_filter="*layers.*_proj.weight"))
    prompt = torch.randint(0, 256, (2, 6))
    reference = model.generate(prompt, 20, temperature=0)
    with on_wse(model, path=PATH) as executor:
        tokens = model.generate(prompt, 20, temperature=0)
        logits = model(prompt)
    assert torch.equal(tokens, reference)
    torch.testing.assert_close(logits, model(prompt))
    assert executor.stats.end_step()["flops_forward"] > 0


def test_inference_input_on_another_device_is_a_clear_error() -> None:
    layer = nn.Linear(8, 4)
    layer.apply(Static(0.5, param_filter="weight"))
    with on_wse(layer, path=PATH), torch.no_grad():
        with pytest.raises(ValueError, match="input on meta but the layer's weight is on cpu"):
            layer(torch.empty(2, 8, device="meta"))
        torch.testing.assert_close(  # and the layer still works afterwards
            layer(torch.ones(2, 8)),
            F.linear(torch.ones(2, 8), layer.weight * layer.weight_mask, layer.bias),
        )


# ------------------------------------------------------------------ the dense fallback
def _masked_weight_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the dense path's masking (`ops._MaskedWeight`) calls."""
    from lightning_sparse.wse import ops

    calls: list[int] = []
    original = ops._MaskedWeight.apply

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(ops._MaskedWeight, "apply", counted)
    return calls


@pytest.mark.parametrize("kind", ["static", "rigl"])
def test_dense_path_under_an_algorithm_is_plain_linear_and_trains_identically(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where "dense" runs a layer whose algorithm keeps pruned weights and gradients at 0, the
    executor calls plain F.linear (no masking pass); the optimizer sees the same gradients
    (exact zeros at pruned positions, RigL's dense gradient on its update step) and the weights
    stay bit-identical to masked dense training on the CPU."""
    calls = _masked_weight_calls(monkeypatch)
    runs = []
    for on_device in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 6)).double()
        sparsity = (
            Static(0.7) if kind == "static" else RigL(0.7, update={"freq": 2}, drop_fraction=0.5)
        )
        model.apply(sparsity)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sparsity.apply(optimizer)
        executor = install_executor(model, path="dense") if on_device else None
        grads = []
        for step in range(4):
            x = torch.randn(
                5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(step)
            )
            optimizer.zero_grad()
            model(x).square().mean().backward()
            grads.append([m.weight.grad.clone() for m in (model[0], model[2])])
            optimizer.step()
        runs.append((grads, [p.detach().clone() for p in model.parameters()]))
        if executor is not None:
            executor.remove()
    assert calls == []  # never masked: the algorithm's hooks keep the zeros
    (cpu_grads, cpu_params), (wse_grads, wse_params) = runs
    for cpu_step, wse_step in zip(cpu_grads, wse_grads, strict=True):
        for cpu_grad, wse_grad in zip(cpu_step, wse_step, strict=True):
            assert torch.equal(cpu_grad, wse_grad)
    for cpu_param, wse_param in zip(cpu_params, wse_params, strict=True):
        assert torch.equal(cpu_param, wse_param)
    for layer in (model[0], model[2]):
        assert torch.equal(
            layer.weight[~layer.weight_mask], torch.zeros_like(layer.weight[~layer.weight_mask])
        )


def test_dense_path_without_an_algorithm_still_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masks registered without an algorithm (`restore_masks`): nothing keeps the pruned
    weights at 0, so the dense path masks weight and gradient itself."""
    calls = _masked_weight_calls(monkeypatch)
    torch.manual_seed(0)
    layer = nn.Linear(8, 5).double()
    mask = torch.rand(5, 8) > 0.6
    layer.register_buffer("weight_mask", mask)  # pruned weights left nonzero on purpose
    x = torch.randn(3, 8, dtype=torch.float64)
    with on_wse(layer, path="dense"):
        y = layer(x)
        y.sum().backward()
    assert calls == [1]
    torch.testing.assert_close(y, F.linear(x, layer.weight * mask, layer.bias), rtol=0, atol=0)
    assert torch.equal(
        layer.weight.grad[~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64)
    )


def test_bf16_inference_storage_is_opt_in_and_training_stays_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    layer.apply(Static(0.8, param_filter="weight"))
    x = torch.randn(1, 64)
    exact = F.linear(x, layer.weight * layer.weight_mask, layer.bias)
    rounded = F.linear(
        x.double(),
        layer.weight.to(torch.bfloat16).double() * layer.weight_mask,
        layer.bias.double(),
    ).float()
    with on_wse(layer, path=PATH, inference_dtype="bfloat16"):
        with torch.no_grad():
            torch.testing.assert_close(layer(x), rounded, atol=1e-5, rtol=1e-5)
            assert not torch.allclose(layer(x), exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer(x), exact)  # training: fp32, unchanged
    monkeypatch.setenv("LIGHTNING_SPARSE_WSE_INFERENCE_DTYPE", "bfloat16")
    with on_wse(layer, path=PATH), torch.no_grad():
        torch.testing.assert_close(layer(x), rounded, atol=1e-5, rtol=1e-5)
    monkeypatch.delenv("LIGHTNING_SPARSE_WSE_INFERENCE_DTYPE")
    with on_wse(layer, path=PATH), torch.no_grad():  # default: fp32
        torch.testing.assert_close(layer(x), exact)
    with pytest.raises(ValueError, match="inference_dtype must be one of .*'float16'"):
        install_executor(layer, inference_dtype="float16")
    assert type(layer) is nn.Linear  # nothing installed by the failed call
