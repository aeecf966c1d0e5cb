"""``torch.compile(model)`` under sparsity, on the CPU: masks exact, nothing recompiled per step.

The masks are buffers updated in place (``copy_``) and the hooks run outside the compiled
forward, so a compiled model's graph is captured once; a mask update must not add a compile.
The backend (``CompileCounter``, eager) does not change what dynamo guards on, which decides
recompiles, and keeps the test fast.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from lightning_sparse import core
from lightning_sparse.models.llama import Llama, LlamaConfig
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)

STEPS = 7  # RigL updates at steps 2, 4 and 6


def run(compiled: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    sparsity = core.RigL(0.75, update={"freq": 2}, seed=0)
    model.apply(sparsity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sparsity.apply(optimizer)
    counter = CompileCounter()
    forward = torch.compile(model, backend=counter) if compiled else model
    frames = []
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        forward(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        frames.append(counter.frame_count)
    assert sparsity.last_update_step == 6
    for sp in sparsity.sparse_params.values():
        assert torch.count_nonzero(sp.param.detach()[~sp.mask]) == 0
    masks = {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}
    return masks, frames


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_compiled_model_keeps_the_masks_of_the_eager_one_and_compiles_once() -> None:
    eager, _ = run(compiled=False)
    compiled, frames = run(compiled=True)
    assert frames[0] >= 1
    assert frames == [frames[0]] * STEPS, f"recompiled during training: {frames}"
    for name in eager:
        assert torch.equal(eager[name], compiled[name]), name


def run_llama(compiled: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    sparsity = core.RigL(0.75, update={"freq": 2}, seed=0)
    model.apply(sparsity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sparsity.apply(optimizer)
    counter = CompileCounter()
    forward = torch.compile(model, backend=counter, fullgraph=True) if compiled else model
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    frames = []
    for _ in range(STEPS):
        logits = forward(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        frames.append(counter.frame_count)
    assert sparsity.last_update_step == 6
    return {n: sp.mask.clone() for n, sp in sparsity.sparse_params.items()}, frames


def test_compiled_llama_is_one_graph_and_keeps_the_eager_masks() -> None:
    """The package's Llama, ``fullgraph=True``: one graph for the whole forward, captured once
    through three mask updates."""
    eager, _ = run_llama(compiled=False)
    compiled, frames = run_llama(compiled=True)
    assert frames == [1] * STEPS, f"recompiled during training: {frames}"
    for name in eager:
        assert torch.equal(eager[name], compiled[name]), name
