"""What ``validate`` / ``test`` / ``predict`` leave in their evaluation folder
(`lightning_sparse.app.run_dirs.evaluation_dir`, ``<run>/<subcommand>_K``).

- ``results.json`` (`write_results`): the metrics ``validate`` / ``test`` return (for the
  recipes ``val/loss`` and ``val/ppl``, or ``test/loss`` and ``test/ppl``) with the checkpoint
  they were computed from.
- ``predictions.jsonl`` (`PredictionWriter`): one JSON object per example: ``prompt`` and
  ``continuation`` as text where the data module can ``decode`` token ids (the recipes' data
  modules can), as ids otherwise. The recipes' prompts are the first ``seq_len // 2`` tokens of
  the test windows; `LitCausalLM.predict_step` continues each by ``max_new_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from lightning_sparse.app.common import PROG

__all__ = ["PREDICTIONS_FILE", "RESULTS_FILE", "PredictionWriter", "write_results"]

RESULTS_FILE = "results.json"
PREDICTIONS_FILE = "predictions.jsonl"


def write_results(
    folder: Path, subcommand: str, ckpt_path: str | None, metrics: Sequence[dict[str, float]]
) -> Path:
    """Write ``folder/results.json``: ``metrics`` (one dict per dataloader, as Lightning returns
    them; a single dict for one) and the checkpoint; return its path."""
    path = folder / RESULTS_FILE
    values: Any = [dict(m) for m in metrics]
    document = {
        "subcommand": subcommand,
        "ckpt_path": ckpt_path,
        "metrics": values[0] if len(values) == 1 else values,
    }
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


class PredictionWriter(BasePredictionWriter):
    """Writes each predicted batch to ``folder/predictions.jsonl`` as it is produced (rank
    ``r`` of several: ``predictions.rank<r>.jsonl``).

    Args:
        folder: the evaluation folder.
    """

    def __init__(self, folder: Path) -> None:
        super().__init__(write_interval="batch")
        self.folder = folder
        self.path: Path | None = None
        self.count = 0

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = PREDICTIONS_FILE
        if trainer.world_size > 1:
            name = f"predictions.rank{trainer.global_rank}.jsonl"
        self.path = self.folder / name
        self.path.write_text("")
        self.count = 0

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        decode = getattr(trainer.datamodule, "decode", None)  # type: ignore[attr-defined]
        prompts = batch[0] if isinstance(batch, tuple | list) else batch
        with open(self.path or self.folder / PREDICTIONS_FILE, "a") as f:
            for row in _rows(prediction, prompts, decode):
                f.write(json.dumps(row) + "\n")
                self.count += 1

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.path is not None:
            print(f"{PROG}: {self.count} predictions saved to {self.path}", flush=True)


def _rows(prediction: Any, prompts: Any, decode: Any) -> list[dict[str, Any]]:
    """One JSON object per example: prompt and continuation (text with ``decode``)."""
    if not isinstance(prediction, Tensor) or prediction.ndim != 2:
        return [
            {
                "prediction": prediction.tolist()
                if isinstance(prediction, Tensor)
                else repr(prediction)
            }
        ]
    cut = prompts.shape[1] if isinstance(prompts, Tensor) and prompts.ndim == 2 else 0
    rows = []
    for ids in prediction.tolist():
        prompt, continuation = ids[:cut], ids[cut:]
        if callable(decode):
            rows.append({"prompt": decode(prompt), "continuation": decode(continuation)})
        else:
            rows.append({"prompt": prompt, "continuation": continuation})
    return rows
