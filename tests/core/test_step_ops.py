"""The per-step path at GPU cost, held on the CPU: kernel launches and host syncs of a step
(`benchmarks/step_ops.py`: the counting rules; `benchmarks/bench_step_ops.py`: the table).

Counts are deterministic, so the tests pin what grows with the number of masked weights: two
sizes of the same Llama (2 and 4 blocks: 14 and 28 masked weights) are compared.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from benchmarks.bench_step_ops import Loop, measure
from benchmarks.step_ops import as_on_a_gpu, count
from lightning_sparse.core import flops
from lightning_sparse.core.report import sparsity_report
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)

DIM = 64
SIZES = (1, 2)  # blocks: 7 and 14 masked weights


@pytest.fixture(scope="module")
def counts() -> dict[tuple[str, int], tuple[int, int, int]]:
    """``(kind, blocks) -> (kernels, host syncs, masked weights)``."""
    out = {}
    for kind in ("dense", "static", "rigl", "rigl update"):
        for layers in SIZES:
            c, n = measure(kind, DIM, layers)
            out[kind, layers] = (c.n_kernels, c.n_syncs, n)
    return out


@pytest.mark.parametrize("kind", ["static", "rigl"])
@pytest.mark.parametrize("layers", SIZES)
def test_an_ordinary_step_makes_no_host_sync(counts, kind: str, layers: int) -> None:
    assert counts[kind, layers][1] == 0


@pytest.mark.parametrize("kind", ["static", "rigl"])
def test_an_ordinary_step_adds_a_handful_of_kernels_whatever_the_number_of_weights(
    counts, kind: str
) -> None:
    """One fused pass over the gradients (when backward produced the last) and one over the
    weights, each one compiled kernel that casts the bool masks inside it (`fused_mask`; was:
    two launches per masked weight, a hook's ``mul_`` and a mixed-dtype ``_foreach_mul_``)."""
    extra = [counts[kind, layers][0] - counts["dense", layers][0] for layers in SIZES]
    assert extra[0] == extra[1] <= 4, extra


def test_the_gpu_path_trains_bit_for_bit_as_the_cpu_path() -> None:
    """The GPU's path (the compiled product, `as_on_a_gpu`) and the CPU's (``_foreach_mul_`` by
    the bool masks) give the same weights and masks."""
    runs = []
    for gpu_path in (False, True):
        with as_on_a_gpu() if gpu_path else contextlib.nullcontext():
            loop = Loop("rigl", DIM, 1)
            for _ in range(6):
                loop.step()
        runs.append({k: v.clone() for k, v in loop.model.state_dict().items()})
        assert loop.sparsity is not None
        runs[-1].update({n: sp.mask.clone() for n, sp in loop.sparsity.sparse_params.items()})
    assert runs[0].keys() == runs[1].keys()
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def test_an_update_makes_one_host_sync_whatever_the_number_of_weights(counts) -> None:
    """The rows' kept counts of every mask are read in one transfer (was: 2 per weight)."""
    small, large = (counts["rigl update", layers] for layers in SIZES)
    assert large[2] == 2 * small[2] > 0
    assert small[1] == large[1] == 1


def test_an_update_adds_at_most_eight_kernels_per_masked_weight(counts) -> None:
    """Same-shape weights share one top-k over their stack (was about 62 kernels per weight):
    what a weight adds is its grow score, its share of the stacks and the dense-gradient hook.
    The rest is per shape, so it does not grow with the weights."""
    (small, n_small), (large, n_large) = (
        (counts["rigl update", layers][0] - counts["dense", layers][0], counts["static", layers][2])
        for layers in SIZES
    )
    assert (large - small) / (n_large - n_small) <= 8, (small, large)


def test_the_counter_sees_a_host_read_and_a_sync() -> None:
    t = torch.arange(4.0)
    c = count(lambda: (int(t.sum()), t.tolist(), t[t > 1]))
    assert c.syncs["_local_scalar_dense"] == 1 and c.syncs["tolist"] == 1
    assert c.syncs["index"] == 1 and c.n_kernels >= 3


def test_the_loop_trains_sparse(counts) -> None:
    loop = Loop("rigl", DIM, 1)
    for _ in range(5):
        loop.step()
    assert loop.sparsity is not None and loop.sparsity.last_update_step == 4
    for sp in loop.sparsity.sparse_params.values():
        assert int(sp.mask.sum()) == int(0.2 * sp.mask.numel())
        assert torch.count_nonzero(sp.param.detach()[~sp.mask]) == 0


@pytest.mark.parametrize("layers", SIZES)
def test_reports_after_an_update_read_the_counts_in_one_transfer(layers: int) -> None:
    """`SparseRunSummary` and the FLOP meter count every mask after an update
    (`sparsity_report`, `flops`): one host transfer, not one ``int(count_nonzero)`` per mask."""
    loop = Loop("rigl", DIM, layers)
    report = count(lambda: sparsity_report(loop.model, masked_only=True))
    kept = count(lambda: flops._kept_by_param(loop.model, {}))
    assert report.n_syncs == kept.n_syncs == 1, (dict(report.syncs), dict(kept.syncs))
    rows = sparsity_report(loop.model, masked_only=True).rows
    assert loop.sparsity is not None and len(rows) == len(loop.sparsity.sparse_params)
    for name, sp in loop.sparsity.sparse_params.items():
        assert rows[name]["nonzeros"] == int(sp.mask.sum()) == int(0.2 * sp.mask.numel())


def test_a_sparsity_state_loaded_mid_run_prunes_by_its_masks_on_the_gpu_path() -> None:
    """Masks written in place by ``load_state_dict`` (their tensors stay the same objects),
    then a step as on a GPU: every weight, and Adam's state, is zero where the loaded masks are
    False. (A per-mask cache keyed by the tensor alone, like the integer multipliers once kept
    for the fused pass, keeps pruning by the masks from before.)"""
    with as_on_a_gpu():
        loop = Loop("rigl", DIM, 1)
        assert loop.sparsity is not None
        loop.step()
        saved = loop.sparsity.state_dict()
        for _ in range(6):  # RigL updates move the masks away from the saved ones
            loop.step()
        params = loop.sparsity.sparse_params
        before = {n: sp.mask.clone() for n, sp in params.items()}
        loop.sparsity.load_state_dict(saved)
        loop.step()
    assert any(not torch.equal(before[n], sp.mask) for n, sp in params.items())
    for name, sp in params.items():
        pruned = ~sp.mask
        assert int(sp.param.detach()[pruned].count_nonzero()) == 0, name
        for key, value in loop.optimizer.state[sp.param].items():
            if torch.is_tensor(value) and value.shape == sp.param.shape:
                assert int(value[pruned].count_nonzero()) == 0, f"{name} {key}"
