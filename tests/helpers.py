"""Small models, LightningModules and the distributed-script runner shared by the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread inside the block: tiny tensors gain nothing from two, and on a busy
    shared CPU a parallel region waits for a descheduled thread (often 10-100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Autouse in every test module that imports it: the module's tests run on one thread."""
    with one_torch_thread():
        yield


class TinyNet(nn.Module):
    """Embedding -> two Linear layers -> norm -> head; the head and embedding stay dense."""

    def __init__(self, vocab: int = 16, dim: int = 24, hidden: int = 40) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.lm_head(self.norm(h))


class TinyLM(pl.LightningModule):
    """Next-token prediction on random tokens with a ``TinyNet``."""

    def __init__(self, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = TinyNet()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


def token_loader(n: int = 64, seq: int = 9, batch: int = 8, seed: int = 0) -> DataLoader:
    """Deterministic data: the same batches in the same order on every call."""
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, 16, (n, seq), generator=g)), batch_size=batch)


def repeated_batch_loader(n_batches: int = 64, seq: int = 9, batch: int = 8) -> DataLoader:
    """Every batch is the same: a resumed run sees the same data whatever Lightning's data-resume
    semantics (a plain DataLoader restarts its epoch on resume), so resume tests isolate the
    model, optimizer and sparsity state."""
    g = torch.Generator().manual_seed(0)
    one = torch.randint(0, 16, (batch, seq), generator=g)
    return DataLoader(TensorDataset(one.repeat(n_batches, 1)), batch_size=batch)


def trainer(tmp_path: object = None, **kwargs: object) -> pl.Trainer:
    """A quiet CPU trainer."""
    defaults: dict = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    if tmp_path is not None:
        defaults["default_root_dir"] = str(tmp_path)
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter and buffer of ``model``, the non-persistent mask buffers
    included (``state_dict()`` leaves those out): what "the model is unchanged" compares."""
    return {
        name: tensor.detach().clone()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }


def mask_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{buffer name: mask}`` of every ``*_mask`` buffer of ``model`` (copies)."""
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("_mask")}


REPO = Path(__file__).resolve().parents[1]
# ModelZoo-format params files written for the tests (tests/fixtures/modelzoo/README.md).
MODELZOO_FIXTURES = REPO / "tests" / "fixtures" / "modelzoo"
# The published ModelZoo files, where the checkout has a `shared/compat` folder beside it (or where
# $MODELZOO_PUBLISHED points). Optional: only the test that compares the fixtures with them reads
# it, and it is skipped when the folder is absent.
MODELZOO_PUBLISHED = Path(
    os.environ.get("MODELZOO_PUBLISHED") or REPO.parent / "shared" / "compat" / "cerebras_modelzoo"
)


def hf_llama_fields(**overrides: Any) -> dict[str, Any]:
    """Fields of a tiny random-init ``transformers.LlamaConfig`` (the HF tests' model)."""
    return {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 32,
        "pad_token_id": 0,
        **overrides,
    }


# Multi-process tests run gloo on the CPU; their workers see no GPU. On a GPU machine a worker
# that sees one picks CUDA wherever a choice is left to torch (FSDP2's default device mesh follows
# torch's current accelerator; Lightning's "auto"), and gloo then meets CUDA tensors: on the H200
# of issue 26 a spawned FSDP2 worker died with SIGSEGV.
CPU_WORKER_ENV = {"CUDA_VISIBLE_DEVICES": ""}


@contextmanager
def gpus_hidden_from_workers() -> Iterator[None]:
    """Processes started inside (``mp.spawn``, ``subprocess``) inherit `CPU_WORKER_ENV`; this
    process's environment is restored on exit (module-scoped fixtures cannot use monkeypatch)."""
    saved = {name: os.environ.get(name) for name in CPU_WORKER_ENV}
    os.environ.update(CPU_WORKER_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def broadcast_bytes() -> Iterator[list[int]]:
    """Inside the block, count the bytes this process hands to
    ``torch.distributed._broadcast_coalesced``, the collective through which DDP broadcasts
    (torch 2.13: its sync at construction, and the buffers before each forward, ``_sync_buffers``).
    Yields a one-element list: the running total."""
    original = torch.distributed._broadcast_coalesced
    sent = [0]

    def counting(
        process_group: torch.distributed.ProcessGroup,
        tensors: list[torch.Tensor],
        buffer_size: int,
        src: int,
    ) -> Any:
        sent[0] += sum(t.numel() * t.element_size() for t in tensors)
        return original(process_group, tensors, buffer_size, src)

    torch.distributed._broadcast_coalesced = counting
    try:
        yield sent
    finally:
        torch.distributed._broadcast_coalesced = original


def repo_pythonpath() -> str:
    """``PYTHONPATH`` for a subprocess that imports ``tests.*``: the repository root, then what
    the environment already holds (``LIGHTNING_SPARSE_PRETEND_CUDA`` puts its folder there)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def nested_pytest_env(**extra: str) -> dict[str, str]:
    """The environment for a pytest a test starts: this one's, less ``PYTEST_ADDOPTS``. CI puts
    ``--cov`` there, and a nested pytest-cov erases the coverage data the outer run's
    subprocesses have written so far (``.ci/run`` then counts none of them). Coverage still
    measures the nested processes through its subprocess patch."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return {**env, **extra}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp_script(
    script: Path,
    outdir: Path,
    name: str,
    timeout: float,
    world: int = 2,
    env: dict[str, str] | None = None,
    weights_only: bool = True,
) -> list[Any]:
    """Run ``python SCRIPT OUTDIR`` (a ``tests/scripts`` file whose Lightning ddp launcher starts
    the other ranks) and return each rank's ``OUTDIR/rank{r}.pt``.

    The script runs from the repository root with it on ``PYTHONPATH`` (so it can import
    ``tests.scripts.*``), a free ``MASTER_PORT``, one OpenMP thread, no GPU (`CPU_WORKER_ENV`),
    no inherited rank variables, and ``env`` on top. It gets a new session so a hang can be ended
    with the rank-1 process Lightning started from it; reading the pipe to EOF also waits for
    rank 1, which inherits it.
    Fails the test after ``timeout`` seconds or on a nonzero exit status (``name`` says which run).
    """
    run_env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    run_env.update(
        PYTHONPATH=repo_pythonpath(),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        **CPU_WORKER_ENV,
        **(env or {}),
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), str(outdir)],
        env=run_env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{name} run did not finish within {timeout} s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"{name} run failed:\n{output[-6000:]}"
    return [torch.load(outdir / f"rank{r}.pt", weights_only=weights_only) for r in range(world)]


def assert_same_state(a: Any, b: Any, where: str = "state") -> None:
    """Nested dicts/lists of tensors and plain values are equal (tensors exactly)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and torch.equal(a, b), f"{where}: tensors differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def sparse_hf_lit(base: Path) -> Any:
    """A tiny random Hugging Face Llama saved to ``base`` (built from a config, nothing
    downloaded), wrapped as ``LitCausalLM(HFCausalLM(base))`` with `Static(0.8)` applied, in eval
    mode. Needs the ``[hf]`` extra."""
    import transformers

    from lightning_sparse import Static
    from lightning_sparse.models import LitCausalLM
    from lightning_sparse.models.hf import HFCausalLM

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    lit = LitCausalLM(model=HFCausalLM(str(base)), max_seq_len=64)
    lit.apply(Static(0.8))
    lit.eval()
    return lit


assert_state_equal = assert_same_state  # the name some tests (tests/app) use
