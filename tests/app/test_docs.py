"""Python examples in docs/*.md run as written (each file in its own namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

DOCS = sorted((Path(__file__).resolve().parents[2] / "docs").glob("*.md"))


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_doc_examples_run(page: Path) -> None:
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
        exec(compile(block, str(page), "exec"), namespace)  # noqa: S102


def test_custom_algorithm_from_algorithms_page_trains() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"
    namespace: dict = {}
    exec(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)[0], namespace)  # noqa: S102
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    algorithm = namespace["KeepLargestGradient"](0.5, update={"freq": 1})
    model.apply(algorithm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm.apply(optimizer)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert algorithm.step == 3
    assert {n: int(sp.mask.sum()) for n, sp in algorithm.sparse_params.items()} == {
        "0.weight": 64,
        "2.weight": 32,
    }
