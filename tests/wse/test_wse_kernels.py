"""CSR kernels of the emulated wafer-scale device against masked dense references.

Every execution path must equal `F.linear(x, weight * mask, bias)` (computed in float64) in value
and in the gradients w.r.t. x, weight (dense, zero where pruned) and bias.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_sparse.wse import CSRWeight, autotune, kernels, native, policy, sparse_linear
from lightning_sparse.wse.kernels import PATH_ENV, autotune_choices, clear_autotune_cache

pytestmark = pytest.mark.filterwarnings("ignore:.*[Ss]parse.*:UserWarning")

# The native library is built (or loaded from the disk cache) once per test session.
COMPILED = pytest.param(
    "compiled",
    marks=pytest.mark.skipif(
        not kernels.compiled_available(),
        reason=f"native kernels unavailable: {native.unavailable_reason()}",
    ),
)
SPARSE_PATHS = ["torch", COMPILED]
ALL_PATHS = ["torch", COMPILED, "dense"]


@pytest.fixture(autouse=True)
def _no_forced_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PATH_ENV, raising=False)


def _mask(shape: tuple[int, int], sparsity: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator) >= sparsity


# --- CSRWeight -------------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=COMPILED.marks)])
def test_csr_structure_hand_computed(compiled: bool) -> None:
    weight = torch.arange(1.0, 10.0).view(3, 3)
    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    csr = CSRWeight.from_dense(weight, mask, compiled=compiled)
    assert csr.crow_indices.tolist() == [0, 2, 2, 4]
    assert csr.col_indices.tolist() == [0, 2, 0, 1]
    assert csr.gather_values(weight).tolist() == [1.0, 3.0, 7.0, 8.0]
    assert csr.flat_indices().tolist() == [0, 2, 6, 7]
    # One orientation only: int32 row pointers and 16-bit columns (3 <= 65536).
    assert (csr.crow_indices.dtype, csr.col_indices.dtype) == (torch.int32, torch.int16)
    assert csr.columns().tolist() == [0, 2, 0, 1] and csr.columns().dtype == torch.int64
    assert (csr.nnz, csr.sparsity) == (4, pytest.approx(5 / 9))
    assert csr.nbytes == 4 * 4 + 2 * 4  # indices only: no values, no mask
    assert torch.equal(csr.to_mask(), mask)


def test_csr_round_trips_and_keeps_zero_valued_weights() -> None:
    weight = torch.randn(13, 7)
    mask = _mask((13, 7), 0.6, seed=1)
    weight[mask.nonzero()[0].tolist()] = 0.0  # a kept weight that happens to be zero
    csr = CSRWeight.from_dense(weight, mask)
    assert csr.nnz == int(mask.sum())
    torch.testing.assert_close(csr.to_dense(csr.gather_values(weight)), weight * mask)
    torch.testing.assert_close(csr.to_torch_csr(weight).to_dense(), weight * mask)


def test_csr_copies_the_mask_structure_and_gathers_live_values() -> None:
    weight, mask = torch.randn(4, 6), _mask((4, 6), 0.5, seed=2)
    csr = CSRWeight.from_dense(weight, mask)
    expected_mask = mask.clone()
    mask.fill_(True)  # mutating the caller's mask must not change the structure
    assert torch.equal(csr.to_mask(), expected_mask)
    values = csr.gather_values(weight)
    torch.testing.assert_close(csr.gather_values(2 * weight), 2 * values)
    # The native gathers equal plain indexing, also for a non-contiguous weight.
    torch.testing.assert_close(values, weight.reshape(-1)[csr.flat_indices()])
    wide = torch.randn(6, 4).t()  # a non-contiguous [4, 6] weight
    torch.testing.assert_close(csr.gather_values(wide), wide.reshape(-1)[csr.flat_indices()])


@pytest.mark.skipif(not kernels.compiled_available(), reason="native kernels unavailable")
@pytest.mark.parametrize(
    ("shape", "sparsity"),
    [((3, 3), 0.5), ((1, 1), 0.0), ((5, 0), 0.5), ((0, 4), 0.5), ((37, 9), 1.0),
     ((100, 1000), 0.999), ((3, 700), 0.2), ((260, 130), 0.6),
     ((600, 500), 0.9),  # above the size where the build goes parallel
     ((3, 65536), 0.999), ((2, 70001), 0.999)],  # the widest 16-bit columns; int32 beyond
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
def test_native_builder_equals_torch_builder(
    shape: tuple[int, int], sparsity: float, threads: int
) -> None:
    weight, mask = torch.randn(shape), _mask(shape, sparsity, seed=8)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        built = CSRWeight.from_dense(weight, mask, compiled=True)
    finally:
        torch.set_num_threads(previous)
    reference = CSRWeight.from_dense(weight, mask, compiled=False)
    assert built.narrow == (shape[1] <= 65536)
    for field in ("crow_indices", "col_indices"):
        expected = getattr(reference, field)
        assert getattr(built, field).dtype == expected.dtype
        assert torch.equal(getattr(built, field), expected), field


@pytest.mark.parametrize(
    ("weight", "mask", "match"),
    [
        (torch.randn(3, 4), torch.ones(3, 4), "torch.bool"),
        (torch.randn(3, 4), torch.ones(4, 3, dtype=torch.bool), "must equal weight shape"),
        (torch.randn(12), torch.ones(12, dtype=torch.bool), "2-D"),
    ],
)
def test_csr_rejects_bad_inputs(weight: torch.Tensor, mask: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CSRWeight.from_dense(weight, mask)


# --- sparse_linear against masked dense references --------------------------------------------

# (out, in), input shape, sparsity, pruned rows, pruned columns
CASES = {
    "tiny": ((8, 5), (3, 5), 0.5, [], []),
    "wide": ((6, 40), (9, 40), 0.7, [], []),
    "tall": ((70, 12), (11, 12), 0.7, [], []),
    "one_token": ((64, 48), (1, 48), 0.9, [], []),
    "tokens_3d": ((48, 64), (2, 7, 64), 0.8, [], []),
    "dense_mask": ((40, 30), (17, 30), 0.0, [], []),
    "sparsity_99.9": ((100, 1000), (33, 1000), 0.999, [], []),
    "empty_rows_cols": ((24, 20), (19, 20), 0.5, [0, 5, 23], [0, 7, 19]),
    "all_pruned": ((10, 9), (4, 9), 1.0, [], []),
    # More tokens than one tile (padding of the last tile), features past the L2 tile budget.
    "multi_tile": ((72, 2100), (300, 2100), 0.95, [3], [11]),
    # Enough work for several threads but too few tokens to split: threads split the rows.
    "few_tokens_many_rows": ((512, 2048), (17, 2048), 0.9, [7], [5]),
}


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    """Runs a test single- and multi-threaded (the native kernels partition work differently)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_masked_dense(path: str, case: str, threads: int) -> None:
    (out_features, in_features), x_shape, sparsity, rows, cols = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    weight = torch.randn(out_features, in_features, generator=generator, requires_grad=True)
    bias = torch.randn(out_features, generator=generator, requires_grad=True)
    x = torch.randn(x_shape, generator=generator, requires_grad=True)
    mask = _mask((out_features, in_features), sparsity, seed=3)
    mask[rows, :] = False
    mask[:, cols] = False
    grad_y = torch.randn(*x_shape[:-1], out_features, generator=generator)

    y = sparse_linear(x, weight, CSRWeight.from_dense(weight, mask), bias, path=path)
    grads = torch.autograd.grad(y, (x, weight, bias), grad_y)

    ref_inputs = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    y_ref = F.linear(ref_inputs[0], ref_inputs[1] * mask, ref_inputs[2])
    ref_grads = torch.autograd.grad(y_ref, ref_inputs, grad_y.double())
    tolerance = {"atol": 1e-4, "rtol": 1e-4}
    assert y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref.float(), **tolerance)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad.float(), **tolerance)
    assert not grads[1][~mask].any(), "weight gradient must be exactly zero where pruned"


@pytest.mark.parametrize("path", SPARSE_PATHS)
def test_float64_matches_masked_dense(path: str, threads: int) -> None:
    # Big enough for full vector blocks in every kernel (8 float64 lanes, 32-feature blocks).
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(80, 96, dtype=torch.float64, generator=generator, requires_grad=True)
    x = torch.randn(2, 45, 96, dtype=torch.float64, generator=generator, requires_grad=True)
    mask = _mask((80, 96), 0.7, seed=10)
    y = sparse_linear(x, weight, mask, path=path)
    grad_y = torch.randn(y.shape, dtype=torch.float64, generator=generator)
    grads = torch.autograd.grad(y, (x, weight), grad_y)
    y_ref = F.linear(x, weight * mask)
    ref_grads = torch.autograd.grad(y_ref, (x, weight), grad_y)
    torch.testing.assert_close(y, y_ref)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("path", ALL_PATHS)
def test_gradcheck_float64(path: str) -> None:
    generator = torch.Generator().manual_seed(0)
    mask = _mask((5, 6), 0.5, seed=4)
    mask[1, :] = False
    mask[:, 2] = False
    csr = CSRWeight.from_dense(torch.zeros(5, 6, dtype=torch.float64), mask)
    inputs = (
        torch.randn(2, 3, 6, dtype=torch.float64, generator=generator, requires_grad=True),
        torch.randn(5, 6, dtype=torch.float64, generator=generator, requires_grad=True),
        torch.randn(5, dtype=torch.float64, generator=generator, requires_grad=True),
    )
    assert torch.autograd.gradcheck(lambda x, w, b: sparse_linear(x, w, csr, b, path=path), inputs)


@pytest.mark.parametrize("path", SPARSE_PATHS)
def test_non_contiguous_input_and_expanded_gradient(path: str) -> None:
    weight = torch.randn(9, 16, requires_grad=True)
    x = torch.randn(16, 5).t().requires_grad_()  # [5, 16] view, not contiguous
    mask = _mask((9, 16), 0.6, seed=5)
    # sum().backward() hands the Function a stride-0 (expanded) gradient.
    sparse_linear(x, weight, mask, path=path).sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    F.linear(x_ref, w_ref * mask).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(weight.grad, w_ref.grad)


@pytest.mark.parametrize("path", SPARSE_PATHS)
def test_weight_written_before_backward_is_an_error_like_nn_linear(path: str) -> None:
    # Backward gathers W^T's values from the saved weight (no copy of its values is kept), so an
    # in-place write in between must fail loudly, as it does for F.linear / nn.Linear.
    weight = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    mask = _mask((6, 4), 0.5, seed=6)
    for run in (lambda: F.linear(x, weight), lambda: sparse_linear(x, weight, mask, path=path)):
        y = run()
        with torch.no_grad():
            weight.mul_(3.0)  # an in-place update between forward and backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(y.sum(), x)


# --- path selection ----------------------------------------------------------------------------


def _small_problem() -> tuple[torch.Tensor, torch.Tensor, CSRWeight]:
    weight = torch.randn(32, 24)
    return torch.randn(5, 24), weight, CSRWeight.from_dense(weight, _mask((32, 24), 0.9, seed=7))


@pytest.mark.parametrize("forced", ["torch", COMPILED, "dense"])
def test_environment_variable_forces_path(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    x, weight, csr = _small_problem()
    monkeypatch.setenv(PATH_ENV, forced)
    assert kernels.resolve_path(x, weight, csr) == forced
    assert kernels.resolve_path(x, weight, csr, path="dense") == "dense"  # argument wins


@pytest.mark.parametrize("path", ["bogus", "Compiled"])
def test_unknown_path_names_the_choices(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    x, weight, csr = _small_problem()
    with pytest.raises(ValueError, match="'auto' or one of"):
        sparse_linear(x, weight, csr, path=path)
    monkeypatch.setenv(PATH_ENV, path)
    with pytest.raises(ValueError, match=PATH_ENV):
        sparse_linear(x, weight, csr)


def test_forced_compiled_path_reports_why_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight, csr = _small_problem()
    monkeypatch.setattr(native, "library", lambda: (None, "no compiler in this test"))
    with pytest.raises(ValueError, match="no compiler in this test"):
        sparse_linear(x, weight, csr, path="compiled")
    with pytest.raises(ValueError, match="CPU float32/float64"):
        sparse_linear(x.half(), weight.half(), csr, path="compiled")
    clear_autotune_cache()
    assert kernels.resolve_path(x, weight, csr, path="auto") in ("torch", "dense")


@pytest.mark.skipif(not kernels.compiled_available(), reason="native kernels unavailable")
def test_compiled_path_runs_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("spmm", "spmm_t", "sddmm"):
        original = getattr(native, name)
        monkeypatch.setattr(
            native, name, lambda *a, _f=original, _n=name: (calls.append(_n), _f(*a))[1]
        )
    x, weight, csr = _small_problem()
    x.requires_grad_(), weight.requires_grad_()
    sparse_linear(x, weight, csr, path="compiled").sum().backward()
    assert sorted(calls) == ["sddmm", "spmm", "spmm_t"]


def test_auto_measures_once_and_caches_choice() -> None:
    clear_autotune_cache()
    x, weight, csr = _small_problem()
    weight.requires_grad_()
    y = sparse_linear(x, weight, csr)
    torch.testing.assert_close(y, F.linear(x, weight * csr.to_mask()))
    choices = autotune_choices()
    assert len(choices) == 1 and next(iter(choices.values())) in kernels.PATHS
    sparse_linear(torch.randn(7, 24), weight, csr)  # same token bucket (8): no new measurement
    assert autotune_choices() == choices


def _fake_timings(
    monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]
) -> list[tuple[str, bool]]:
    """Make autotuning measure ``seconds[path]`` for each path (training and inference runner
    alike); returns the (path, requires_grad) pairs it timed."""
    timed: list[tuple[str, bool]] = []

    def time_once(path: str, *args: object) -> float:
        timed.append((path, True))
        return seconds[path]

    def runner(path: str, *args: object) -> object:
        def run(x: torch.Tensor) -> None:
            return None

        run.path = path  # type: ignore[attr-defined]
        return run

    def time_runner(runs: list[object], x: torch.Tensor, calls: int = 1) -> float:
        path = runs[0].path  # type: ignore[attr-defined]
        timed.append((path, False))
        return seconds[path]

    monkeypatch.setattr(autotune, "_time_once", time_once)
    monkeypatch.setattr(autotune, "inference_runner", runner)
    monkeypatch.setattr(autotune, "_time_runner", time_runner)
    return timed


@pytest.mark.parametrize("requires_grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize(
    ("sparse_seconds", "expected"),
    [(2.0, "dense"), (0.97, "dense"), (0.5, "sparse")],
    ids=["sparse-slower", "sparse-within-margin", "sparse-clearly-faster"],
)
def test_auto_falls_back_to_dense_unless_sparse_clearly_wins(
    monkeypatch: pytest.MonkeyPatch, requires_grad: bool, sparse_seconds: float, expected: str
) -> None:
    """50% density on a small shape, 32 tokens (not a memory-bound decode call): with "dense"
    timed at 1.0 s, a sparse path slower than it, or faster by less than the margin, loses; one
    clearly faster wins."""
    clear_autotune_cache()
    seconds = {"compiled": sparse_seconds, "torch": sparse_seconds + 0.01, "dense": 1.0}
    timed = _fake_timings(monkeypatch, seconds)
    weight = torch.randn(16, 12)
    csr = CSRWeight.from_dense(weight, _mask((16, 12), 0.5, seed=3))
    chosen = kernels.resolve_path(torch.randn(32, 12), weight, csr, "auto", requires_grad)
    sparse = "compiled" if kernels.compiled_available() else "torch"
    assert chosen == (sparse if expected == "sparse" else "dense")
    assert ("dense", requires_grad) in timed, "dense was not among the measured candidates"
    assert {p for p, _ in timed} == {p for p in kernels.PATHS if p != "compiled" or sparse == p}
    clear_autotune_cache()


def test_dense_path_mask_cache_survives_inference_mode_then_training() -> None:
    """The dense path keeps its mask per structure; one made under ``inference_mode`` is not
    reused where autograd must save it."""
    x, weight, csr = _small_problem()
    with torch.inference_mode():
        sparse_linear(x, weight, csr, path="dense")
    weight.requires_grad_()
    sparse_linear(x, weight, csr, path="dense").sum().backward()
    mask = csr.to_mask()
    torch.testing.assert_close(weight.grad, (torch.ones(5, 32).t() @ x) * mask)
    assert torch.count_nonzero(weight.grad[~mask]) == 0


def test_choose_path_margin() -> None:
    assert policy.choose_path({"torch": 0.96, "dense": 1.0}) == "dense"
    assert policy.choose_path({"torch": 0.94, "dense": 1.0}) == "torch"
    assert policy.choose_path({"torch": 0.96, "dense": 1.0}, margin=0.0) == "torch"
    assert policy.choose_path({"compiled": 0.5, "torch": 0.4}) == "torch"  # no dense: fastest


def test_rejects_mismatched_inputs() -> None:
    x, weight, csr = _small_problem()
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 24\]"):
        sparse_linear(torch.randn(5, 23), weight, csr)
    with pytest.raises(ValueError, match="share a dtype"):
        sparse_linear(x.double(), weight, csr)
    with pytest.raises(ValueError, match="rebuild the CSRWeight"):
        sparse_linear(torch.randn(5, 25), torch.randn(32, 25), csr)
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        sparse_linear(x, weight, csr, torch.randn(31))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=COMPILED.marks)])
@pytest.mark.parametrize(("in_features", "narrow"), [(30, True), (65536, True), (65537, False)])
def test_one_structure_serves_training_with_index_bytes_at_most_the_values(
    compiled: bool, in_features: int, narrow: bool
) -> None:
    """One orientation (no transposed structure) serves inference and training: 16-bit columns
    up to 65536 inputs (the last column, 65535, included), int32 beyond; the indices then take
    at most the bytes of the fp32 values at any sparsity where a row keeps two weights."""
    weight = torch.randn(40, in_features)
    mask = _mask((40, in_features), 1 - 4 / in_features, seed=11)
    mask[:, [0, in_features - 1]] = True
    mask[7] = False  # an empty row
    csr = CSRWeight.from_dense(weight, mask, compiled=compiled)
    assert csr.narrow == narrow
    assert csr.col_indices.dtype == (torch.int16 if narrow else torch.int32)
    assert int(csr.columns().max()) == in_features - 1
    assert torch.equal(csr.to_mask(), mask)
    assert csr.nbytes == 4 * 41 + (2 if narrow else 4) * csr.nnz
    if narrow:
        assert csr.nbytes <= 4 * csr.nnz  # the fp32 values' bytes
    x = torch.randn(3, in_features, dtype=torch.float64)
    w = weight.double().requires_grad_()
    with torch.no_grad():
        torch.testing.assert_close(sparse_linear(x, w, csr), F.linear(x, w * mask))
    x.requires_grad_()
    y = sparse_linear(x, w, csr)  # the same structure, now with gradients
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    x_ref, w_ref = x.detach().requires_grad_(), weight.double().requires_grad_()
    F.linear(x_ref, w_ref * mask).backward(grad_y)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-12, atol=1e-12)


# --- One token (the decode kernel) and bf16 storage -------------------------------------------
ONE_TOKEN_CASES = {
    # shape, sparsity, rows pruned entirely, columns kept in every row (index edge cases)
    "tiny": ((7, 5), 0.5, [2], []),
    "empty_rows": ((64, 1024), 0.9, [0, 31, 63], [1023]),
    "threads_split_rows": ((2752, 1024), 0.9, [5, 2751], [0]),  # over the parallel threshold
    "u16_max_column": ((12, 65536), 0.999, [4], [65535]),  # 16-bit indices up to 65535
    "int32_columns": ((9, 70001), 0.999, [], [65536, 70000]),  # wider: int32 indices
    "all_pruned": ((16, 16), 1.0, [], []),
}


def _one_token_case(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    (out_features, in_features), sparsity, rows, cols = ONE_TOKEN_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    mask = _mask((out_features, in_features), sparsity, seed=4)
    mask[:, cols] = True
    mask[rows, :] = False
    x = torch.randn(1, in_features, generator=generator)
    return weight, mask, bias, x


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("case", list(ONE_TOKEN_CASES))
def test_one_token_runner_matches_masked_dense(path: str, case: str, threads: int) -> None:
    weight, mask, bias, x = _one_token_case(case)
    csr = CSRWeight.from_dense(weight, mask)
    runner = kernels.inference_runner(path, csr.gather_values(weight), csr, weight, mask, bias)
    reference = F.linear(x.double(), weight.double() * mask, bias.double()).float()
    torch.testing.assert_close(runner(x), reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner(x[0]), reference[0], atol=1e-4, rtol=1e-4)  # 1-D input
    if case in ("all_pruned", "empty_rows"):
        rows = ~mask.any(1)
        assert torch.equal(runner(x)[:, rows], bias[rows].expand(1, -1))


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("case", ["empty_rows", "int32_columns"])
def test_bf16_storage_computes_with_rounded_values_on_every_path(path: str, case: str) -> None:
    """bf16 values (opt-in `inference_dtype`): every path and token count computes in fp32 with
    the bf16-rounded kept values, so the result matches that reference, not the fp32 one."""
    weight, mask, bias, x = _one_token_case(case)
    csr = CSRWeight.from_dense(weight, mask)
    values = csr.gather_values(weight).to(torch.bfloat16)
    runner = kernels.inference_runner(path, values, csr, weight, mask, bias)
    rounded = weight.to(torch.bfloat16).double() * mask
    for tokens in (x, torch.cat([x, -x, 2 * x])):
        reference = F.linear(tokens.double(), rounded, bias.double()).float()
        torch.testing.assert_close(runner(tokens), reference, atol=1e-4, rtol=1e-4)
    exact = F.linear(x, weight * mask, bias)
    assert not torch.allclose(runner(x), exact, atol=1e-4, rtol=1e-4)  # it did round


@pytest.mark.parametrize("requires_grad", [True, False], ids=["train", "infer"])
def test_training_needs_the_wider_margin(
    monkeypatch: pytest.MonkeyPatch, requires_grad: bool
) -> None:
    """A sparse path 12% faster than dense alone: enough for inference (`TUNED["margin"]`), not
    for a training call (`TUNED["margin_training"]`: costs inside a step its timing misses)."""
    assert policy.margin(False) < 0.12 < policy.margin(True)
    clear_autotune_cache()
    _fake_timings(monkeypatch, {"compiled": 0.88, "torch": 0.89, "dense": 1.0})
    weight = torch.randn(16, 12)
    csr = CSRWeight.from_dense(weight, _mask((16, 12), 0.5, seed=3))
    chosen = kernels.resolve_path(torch.randn(32, 12), weight, csr, "auto", requires_grad)
    sparse = "compiled" if kernels.compiled_available() else "torch"
    assert chosen == ("dense" if requires_grad else sparse)
    clear_autotune_cache()


@pytest.mark.parametrize(("sparsity", "told", "expected"), [
    (0.5, {"compiled": 1.3, "torch": 1.4, "dense": 1.0}, "dense"),   # sparse loses: dense
    (0.9, {"compiled": 1.3, "torch": 1.4, "dense": 1.0}, "dense"),   # even at 90%
    (0.9, {"compiled": 0.3, "torch": 0.4, "dense": 1.0}, "sparse"),  # sparse wins at 90%
    (0.5, {"compiled": 0.5, "torch": 0.6, "dense": 1.0}, "sparse"),  # and at 50%, if measured
])  # fmt: skip
def test_decode_follows_the_measurement(
    monkeypatch: pytest.MonkeyPatch, sparsity: float, told: dict[str, float], expected: str
) -> None:
    """One-token inference of a layer large enough to time beyond the cache takes the path the
    streamed timing says is fastest: dense where the sparse paths lose, sparse where they win,
    at 50% as at 90% (no fixed density rule)."""
    clear_autotune_cache()
    monkeypatch.setattr(autotune, "_cache_bytes", lambda: 64 * 48 * 4 * 5)  # 10 copies stream
    _fake_timings(monkeypatch, told)
    weight = torch.randn(64, 48)
    csr = CSRWeight.from_dense(weight, _mask((64, 48), sparsity, seed=4))
    chosen = kernels.resolve_path(torch.randn(1, 48), weight, csr, "auto", False)
    sparse = "compiled" if kernels.compiled_available() else "torch"
    assert chosen == (sparse if expected == "sparse" else "dense")
    clear_autotune_cache()


@pytest.mark.parametrize(("layer_bytes", "cache", "tokens", "grad", "expected"), [
    (4 << 20, 32 << 20, 1, False, 16),      # 2 x 32 MB of 4 MB copies
    (11 << 20, 32 << 20, 16, False, 6),     # ceil(64 / 11)
    (1 << 20, 32 << 20, 1, False, 64),      # 64 copies: still streamed
    (180 << 10, 32 << 20, 1, False, None),  # too small to stream: its model sits in cache
    (4 << 20, None, 1, False, 16),          # cache unknown: 32 MB
    (4 << 20, 32 << 20, 17, False, 1),      # not decode: weights in cache
    (4 << 20, 32 << 20, 1, True, 1),        # training: one copy
])  # fmt: skip
def test_decode_is_timed_through_copies_beyond_the_cache(
    layer_bytes: int, cache: int | None, tokens: int, grad: bool, expected: int | None
) -> None:
    assert policy.decode_stream_copies(layer_bytes, cache, tokens, grad) == expected


@pytest.mark.parametrize(("sparsity", "tokens", "expected"), [
    (0.5, 1, "dense"),    # values + 16-bit indices: 0.75 of the dense bytes
    (0.8, 1, "sparse"),   # 0.3 of the dense bytes
    (0.5, 32, "sparse"),  # a prefill: timing decides
])  # fmt: skip
def test_a_layer_too_small_to_stream_keeps_the_bytes_rule(
    monkeypatch: pytest.MonkeyPatch, sparsity: float, tokens: int, expected: str
) -> None:
    """A layer too small to time beyond the cache (`policy.decode_stream_copies` None: its model
    sits in cache) takes a sparse decode path only if it halves the bytes
    (`TUNED["decode_bytes_ratio"]`), however fast it ran alone."""
    clear_autotune_cache()
    monkeypatch.setattr(autotune, "_cache_bytes", lambda: 32 << 20)
    _fake_timings(monkeypatch, {"compiled": 0.5, "torch": 0.5, "dense": 1.0})
    weight = torch.randn(64, 48)
    csr = CSRWeight.from_dense(weight, _mask((64, 48), sparsity, seed=4))
    chosen = kernels.resolve_path(torch.randn(tokens, 48), weight, csr, "auto", False)
    sparse = "compiled" if kernels.compiled_available() else "torch"
    assert chosen == (sparse if expected == "sparse" else "dense")
    clear_autotune_cache()


def test_decode_timing_streams_through_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few-token timing cycles through `policy.decode_stream_copies` distinct copies of the
    layer (dense: each runner on its own weight), a many-token one runs one."""
    clear_autotune_cache()
    monkeypatch.setattr(autotune, "_cache_bytes", lambda: 64 * 48 * 4 * 5)  # 10 copies
    seen: dict[int, list[int]] = {}

    def time_runner(runs: list[object], x: torch.Tensor, calls: int = 1) -> float:
        if isinstance(runs[0], functools.partial):  # dense: F.linear on its own weight copy
            seen.setdefault(x.shape[0], []).append(
                len({r.keywords["weight"].data_ptr() for r in runs})  # type: ignore[attr-defined]
            )
        return 1.0

    monkeypatch.setattr(autotune, "_time_runner", time_runner)
    weight = torch.randn(64, 48)
    csr = CSRWeight.from_dense(weight, _mask((64, 48), 0.5, seed=4))
    for tokens in (1, 64):
        kernels.resolve_path(torch.randn(tokens, 48), weight, csr, "auto", False)
    assert set(seen[1]) == {10} and set(seen[64]) == {1}
    clear_autotune_cache()


@pytest.mark.skipif(not kernels.compiled_available(), reason="native kernels unavailable")
@pytest.mark.parametrize("tokens", [7, 40, 100, 700])
def test_compiled_results_do_not_depend_on_the_thread_count(tokens: int) -> None:
    """The device picks its kernel threads by the cores free at the moment (`threads.py`), so the
    compiled kernels must give bit-identical outputs and gradients (dense and compact layers) on
    any thread count: SDDMM sums fixed token ranges in a fixed order, whoever computes them."""
    from lightning_sparse.wse.ops import run_compact_path, run_path

    generator = torch.Generator().manual_seed(tokens)
    weight = torch.randn(300, 700, generator=generator)
    csr = CSRWeight.from_dense(weight, _mask((300, 700), 0.9, seed=5))
    x, grad_y = torch.randn(tokens, 700, generator=generator), torch.randn(tokens, 300)
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            values = csr.gather_values(weight).requires_grad_()
            x1, x2, w2 = (t.clone().requires_grad_() for t in (x, x, weight))
            run_compact_path("compiled", x1, values, csr, None).backward(grad_y)
            run_path("compiled", x2, w2, csr, None).backward(grad_y)
            results.append((x1.grad, values.grad, x2.grad, w2.grad))
    finally:
        torch.set_num_threads(previous)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("requested", "cpus", "others", "expected"),
    [
        (2, 2, None, 2),  # load unknown: torch's count
        (2, 2, 0.0, 2),
        (2, 2, 0.4, 2),  # a core counts as busy from half of it used
        (2, 2, 0.5, 1),
        (2, 2, 1.0, 1),  # one busy process: one thread on the free core
        (2, 2, 1.9, 1),  # never fewer than one
        (4, 8, 5.0, 3),
        (1, 8, 0.0, 1),
    ],
)
def test_kernel_threads_policy(requested: int, cpus: int, others: float | None, expected: int):
    assert policy.kernel_threads(requested, cpus, others) == expected


def test_load_monitor_counts_other_processes_busy_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two samples of a fake ``/proc/stat`` 1 s apart: 150 ticks busy (at 100 per second) while
    this process used 0.5 s of CPU, so others kept 1.0 core busy and a 2-thread kernel call gets
    one thread."""
    from lightning_sparse.wse import threads

    stat = tmp_path / "stat"
    clock = iter([100.0, 100.0, 101.0, 101.0])
    own = iter([10.0, 10.5])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(threads.time, "process_time", lambda: next(own))
    monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)
    monitor = threads.LoadMonitor(stat, interval=0.5)
    monitor.cpus = 2
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: 2)
    stat.write_text("cpu  1000 0 500 8000 100 0 0 0 0 0\ncpu0 ...\n")
    assert monitor.threads() == 2  # first sample: no window yet
    stat.write_text("cpu  1100 0 550 8050 100 0 0 0 0 0\ncpu0 ...\n")
    assert monitor.threads() == 1
    assert monitor.others == pytest.approx(1.0)


# --- The native kernels' tiling paths, one by one -------------------------------------------
# Tile budgets small enough for one vector of tokens per tile in every kernel (4 KB), and this
# machine's (`native.tile_budgets`: two vectors in the SpMM, four or eight in the SDDMM at 1100
# features). Shapes are not multiples of the vector width (16 floats, 8 doubles), the 32-feature
# transpose block or the tile; tokens cover one partial vector, a tile and a partial last tile,
# and the few-token path where threads split the rows of each tile.
KERNEL_BUDGETS = {"small_tiles": (4 << 10, 4 << 10), "this_machine": None}
# The input gradient's accumulator: whole (0); column blocks of 4 KB (32 or 64 features: 1100 is
# no multiple of either, most rows keep no weight in some block); this machine's L1 block; one
# block holding every column.
SCATTER_BLOCKS = (0, 4 << 10, "this_machine", 1 << 30)


@pytest.fixture(params=list(KERNEL_BUDGETS))
def budgets(request: pytest.FixtureRequest):
    if not kernels.compiled_available():
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    chosen = KERNEL_BUDGETS[request.param]
    machine = native.tile_budgets()
    defaults = (machine.spmm, machine.sddmm)
    native.set_tile_budgets(*(chosen or defaults))
    yield request.param
    native.set_tile_budgets(*defaults)


def _scatter_blocks() -> list[int]:
    return [native.tile_budgets().scatter_block if b == "this_machine" else b
            for b in SCATTER_BLOCKS]  # fmt: skip


def _kernel_operands(
    tokens: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, CSRWeight]:
    """(weight * mask, mask, x, grad_y, CSR) with empty rows and columns: rows 0 and 5 and
    columns 1 and in_features - 1 have no kept weight."""
    generator = torch.Generator().manual_seed(seed)
    mask = _mask((out_features, in_features), 0.9, seed=seed)
    mask[[0, 5], :] = False
    mask[:, [1, in_features - 1]] = False
    weight = torch.randn(out_features, in_features, generator=generator, dtype=dtype) * mask
    x = torch.randn(tokens, in_features, generator=generator, dtype=dtype)
    grad_y = torch.randn(tokens, out_features, generator=generator, dtype=dtype)
    csr = CSRWeight.from_dense(weight, mask)
    return weight, mask, x, grad_y, csr


@pytest.mark.parametrize("tokens", [0, 1, 17, 129, 300])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("index", ["u16", "i32"])
def test_native_kernels_equal_masked_dense_on_every_tiling_path(
    tokens: int, dtype: torch.dtype, index: str, budgets: str, threads: int
) -> None:
    """The forward SpMM (gathers along W's CSR), the input-gradient kernel (scatters along the
    same CSR) and the SDDMM (dense and compact outputs), with 16-bit and int32 column indices,
    against masked dense products in float64; float32 within a tolerance that grows with the
    square root of a row's kept count (the rounding of a sum of that many terms)."""
    # 405 rows: a partial last block of 16 rows; enough work at 17 tokens for two threads to
    # split the rows of each tile.
    out_features, in_features = 405, 1100
    weight, mask, x, grad_y, csr = _kernel_operands(tokens, out_features, in_features, dtype, 7)
    crow = csr.crow_indices
    col = csr.col_indices if index == "u16" else csr.columns(torch.int32)
    assert col.dtype == (torch.int16 if index == "u16" else torch.int32)
    values = csr.gather_values(weight)
    bias = torch.randn(out_features, dtype=dtype)
    w64, x64, g64 = weight.double(), x.double(), grad_y.double()

    y = torch.empty(tokens, out_features, dtype=dtype)
    native.spmm(crow, col, values, x, bias, y)
    grad_xs = []
    for block in _scatter_blocks():
        grad_xs.append(torch.full((tokens, in_features), float("nan"), dtype=dtype))
        native.spmm_t(crow, col, values, grad_y, grad_xs[-1], block)
    grad_x = grad_xs[0]
    grad_w = torch.full((out_features, in_features), float("nan"), dtype=dtype)
    native.sddmm(crow, col, grad_y, x, grad_w)
    grad_values = torch.full((csr.nnz,), float("nan"), dtype=dtype)
    native.sddmm(crow, col, grad_y, x, grad_values)

    kept = int(mask.sum(1).max())
    if dtype == torch.float64:
        tolerance = {"rtol": 1e-12, "atol": 1e-12}
    else:  # unit roundoff x sqrt(terms) x magnitude (unit normal operands), with headroom
        tolerance = {"rtol": 1e-5, "atol": 8 * 2**-24 * max(kept, tokens) ** 0.5 * 4}
    torch.testing.assert_close(y.double(), x64 @ w64.t() + bias.double(), **tolerance)
    torch.testing.assert_close(grad_x.double(), g64 @ w64, **tolerance)
    assert not grad_x[:, [1, in_features - 1]].any(), "columns with no kept weight get exact 0"
    for blocked in grad_xs[1:]:  # column blocks sum every output in the same order: same bits
        assert torch.equal(blocked, grad_x)
    reference = (g64.t() @ x64) * mask
    torch.testing.assert_close(grad_w.double(), reference, **tolerance)
    assert not grad_w[~mask].any(), "the SDDMM must write exact zeros where pruned"
    torch.testing.assert_close(grad_values.double(), reference[mask], **tolerance)


def _isa_flags() -> list[str]:
    """-march values of the kernels' portable paths this machine can run: AVX2 (32-byte vectors,
    no AVX-512) and baseline x86-64 (the vector extensions lowered to SSE2)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return (["x86-64-v3"] if " avx2 " in flags and " fma " in flags else []) + ["x86-64"]


@pytest.mark.parametrize("march", _isa_flags())
def test_native_kernels_without_avx512_equal_masked_dense(march: str, tmp_path: Path) -> None:
    """The kernels built for an older instruction set (what `-march=native` gives on a CPU
    without AVX-512) against masked dense products, float64 and float32, on the tiling paths."""
    import ctypes
    import shutil
    import subprocess

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    built = tmp_path / f"wse_kernels_{march}.so"
    flags = [f for f in native._CXX_FLAGS if not f.startswith("-march")]
    source = Path(native.__file__).parent / "csrc" / "wse_kernels.cpp"
    subprocess.run([compiler, *flags, f"-march={march}", str(source), "-o", str(built)], check=True)
    lib = ctypes.CDLL(str(built))
    native._declare(lib)
    for dtype, suffix in ((torch.float64, "f64"), (torch.float32, "f32")):
        for tokens, threads in ((17, 2), (129, 1), (300, 2)):
            weight, mask, x, grad_y, csr = _kernel_operands(tokens, 405, 1100, dtype, tokens)
            values = csr.gather_values(weight)
            y = torch.empty(tokens, 405, dtype=dtype)
            grad_x = torch.empty(tokens, 1100, dtype=dtype)
            grad_values = torch.empty(csr.nnz, dtype=dtype)
            spmm, spmm_t, sddmm = (
                getattr(lib, f"ls_{name}_{suffix}_u16")
                for name in ("spmm", "spmm_t", "sddmm_values")
            )
            crow, col = csr.crow_indices.data_ptr(), csr.col_indices.data_ptr()
            spmm(crow, col, values.data_ptr(), x.data_ptr(), None, tokens, 1100, 405,
                 y.data_ptr(), threads)  # fmt: skip
            blocked = torch.empty(tokens, 1100, dtype=dtype)
            assert spmm_t(crow, col, values.data_ptr(), grad_y.data_ptr(), tokens, 405, 1100,
                          grad_x.data_ptr(), threads, 0) == 0  # fmt: skip
            assert spmm_t(crow, col, values.data_ptr(), grad_y.data_ptr(), tokens, 405, 1100,
                          blocked.data_ptr(), threads, 4 << 10) == 0  # fmt: skip
            assert torch.equal(blocked, grad_x)
            assert sddmm(crow, col, grad_y.data_ptr(), x.data_ptr(), tokens, 1100, 405,
                         grad_values.data_ptr(), threads) == 0  # fmt: skip
            w64, x64, g64 = weight.double(), x.double(), grad_y.double()
            if dtype == torch.float64:
                tolerance = {"rtol": 1e-12, "atol": 1e-12}
            else:  # as in the test above: roundoff x sqrt(terms), with headroom
                kept = int(mask.sum(1).max())
                tolerance = {"rtol": 1e-5, "atol": 32 * 2**-24 * max(kept, tokens) ** 0.5}
            torch.testing.assert_close(y.double(), x64 @ w64.t(), **tolerance)
            torch.testing.assert_close(grad_x.double(), g64 @ w64, **tolerance)
            reference = (g64.t() @ x64)[mask]
            torch.testing.assert_close(grad_values.double(), reference, **tolerance)
