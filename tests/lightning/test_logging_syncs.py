"""The callback's logging at GPU cost: a mask update's figures reach the host in one transfer.

Lightning turns every tensor given to ``log_dict`` into a ``.item()`` (a host sync on a GPU) and
every float into a host-to-device copy, so logging one value per masked weight cost a sync per
weight after each update (issue 26). Per-parameter figures go to the loggers as host floats.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

import lightning_sparse
from benchmarks.step_ops import count
from lightning_sparse.lightning.callback import update_metrics
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.lightning.test_amp import TinyModule, loader


def stats(n: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        f"w{i}": {
            "dropped": torch.tensor(i),
            "grown": torch.tensor(2 * i),
            "sparsity": torch.tensor(0.5 + i / 100),
        }
        for i in range(n)
    }


def test_update_metrics_reads_every_figure_in_one_transfer() -> None:
    for n in (3, 12):
        given, itop = stats(n), torch.tensor(0.25)
        out: dict[str, float] = {}
        counts = count(lambda g=given, o=out, i=itop: o.update(update_metrics(g, i)))
        assert counts.n_syncs == 1, (n, dict(counts.syncs))
        assert all(type(v) is float for v in out.values())
        assert out["dropped"] == sum(range(n)) and out["grown"] == 2 * sum(range(n))
        assert out["itop"] == 0.25 and out[f"layer/w{n - 1}"] == float(
            torch.tensor(0.5 + (n - 1) / 100)
        )


def test_per_layer_sparsity_reaches_the_logger_at_the_update_step(tmp_path: Path) -> None:
    sparsity = lightning_sparse.RigL(0.75, update={"freq": 2}, seed=0)
    module = TinyModule()
    module.sparsity = sparsity
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[sparsity],
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader())
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    keys = {f"sparsity/layer/{n}" for n in sparsity.sparse_params}
    logged = [r for r in rows if any(r.get(k) for k in keys)]
    assert [int(r["step"]) for r in logged] == [2], logged
    totals = [r for r in rows if r.get("sparsity/dropped")]
    assert [int(r["step"]) for r in totals] == [2]
    for name, sp in sparsity.sparse_params.items():
        actual = 1.0 - int(sp.mask.sum()) / sp.mask.numel()
        assert float(logged[0][f"sparsity/layer/{name}"]) == actual
