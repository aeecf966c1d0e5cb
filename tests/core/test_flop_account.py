"""The one FLOP accountant (`core/flop_account.py`): formulas, a run's ledger, its segments and
its checkpoints, against hand counts."""

from __future__ import annotations

import pytest

from lightning_sparse.core.flop_account import (
    BatchCost,
    FlopLedger,
    FlopSegment,
    matmul_flops,
    training_flops,
)
from lightning_sparse.core.flops import transformer_flops

SPARSE = BatchCost(forward_flops_per_token=100, dense_forward_flops_per_token=400,
                   dense_grad_flops_per_token=300, sparsity=0.75)  # fmt: skip
DENSE = BatchCost(400, 400, 0, 0.0)


def test_formulas() -> None:
    assert matmul_flops(tokens=5, kept=7) == 70
    assert training_flops(forward_flops_per_token=100, tokens=8) == 2400
    report = transformer_flops(2, 8, 2, 4, 16, sparsity=0.5)
    assert report.training_flops == training_flops(report.forward_flops_per_token, 4)
    assert BatchCost.of(report).forward_flops_per_token == report.forward_flops_per_token


def test_ledger_charges_batches_into_segments_of_equal_cost() -> None:
    ledger = FlopLedger()
    ledger.charge(0, 64, SPARSE)
    ledger.charge(1, 64, SPARSE, dense_grad_tokens=64)  # a RigL update step
    ledger.charge(2, 64, DENSE)  # densified (SPDF)
    sparse, dense = ledger.segments
    assert (sparse.first_step, sparse.last_step, sparse.batches, sparse.tokens) == (0, 1, 2, 128)
    assert sparse.dense_grad_flops == 300 * 64
    assert sparse.flops == 3 * 100 * 128 + 300 * 64 and dense.flops == 3 * 400 * 64
    assert ledger.counters == {
        "tokens": 192, "train_flops": 3 * 100 * 128 + 3 * 400 * 64,
        "dense_train_flops": 3 * 400 * 192, "dense_grad_flops": 300 * 64, "dense_grad_steps": 1,
    }  # fmt: skip
    assert ledger.train_flops == sparse.flops + dense.flops
    totals = ledger.totals()
    assert totals["flops"] == ledger.train_flops and totals["dense_flops"] == 3 * 400 * 192
    assert totals["effective_sparsity"] == pytest.approx(0.75 * 128 / 192)
    assert totals["saved"] == pytest.approx(1 - totals["flops"] / totals["dense_flops"])


def test_totals_include_earlier_runs() -> None:
    earlier = FlopSegment(0, 0, 9, 10, 640, 100, 400, 0.75, dense_grad_flops=5)
    ledger = FlopLedger(run=1)
    ledger.charge(0, 64, DENSE)
    totals = ledger.totals([earlier])
    assert totals["flops"] == earlier.flops + 3 * 400 * 64 and totals["tokens"] == 704
    assert totals["dense_grad_flops"] == 5 and ledger.segments[0].run == 1


def test_state_round_trip_and_earlier_versions_states() -> None:
    ledger = FlopLedger()
    ledger.charge(0, 64, SPARSE, dense_grad_tokens=64)
    ledger.charge(1, 64, DENSE)
    restored = FlopLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.segments == ledger.segments and restored.counters == ledger.counters
    # An earlier FlopCounter: segments only (no dense_grad_flops field): totals are their sums.
    old = [{k: v for k, v in vars(s).items() if k != "dense_grad_flops"} for s in ledger.segments]
    from_segments = FlopLedger()
    from_segments.load_state_dict({"segments": old})
    assert from_segments.counters["train_flops"] == ledger.counters["train_flops"]
    assert from_segments.counters["dense_train_flops"] == ledger.counters["dense_train_flops"]
    # An earlier SparseRunSummary: totals only.
    from_counters = FlopLedger()
    from_counters.load_state_dict({"counters": {"tokens": 8, "train_flops": 24}})
    assert from_counters.train_flops == 24 and from_counters.counters["dense_grad_steps"] == 0
