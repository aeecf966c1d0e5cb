"""configure(): ModelZoo config files (2.1 and 2.10), dict / list / float forms, errors, masks.

The ModelZoo params files are the repository's own fixtures (tests/fixtures/modelzoo, written in
the documented 2.2+ and 2.0/2.1 formats); a small module tree with ModelZoo GPT parameter names
checks which parameters each file sparsifies. Where the published ModelZoo files sit beside the
checkout (``../shared/compat``), one more test checks that each fixture configures exactly as the
published file of the same name; without them it is skipped.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_sparse import GMP, SET, DynamicSparsityAlgorithm, Group, RigL, Static, configure
from lightning_sparse.core.configure import available_algorithms, load_sparsity_block
from lightning_sparse.core.init_methods import random as random_init
from lightning_sparse.core.mask_ops import topk_mask
from lightning_sparse.core.schedules import Constant, Cosine, Cycling, FreqSchedule, ListSchedule
from tests.helpers import MODELZOO_FIXTURES, MODELZOO_PUBLISHED, TinyNet

COMPAT = MODELZOO_FIXTURES
VERSIONS = ("v2.1", "v2.10")
# name -> (class, sparsity, update freq, update stop = drop_fraction half period); None = dense.
MODELZOO_FILES: dict[str, tuple[type, float, int | None, int | None] | None] = {
    "params_gpt3_125m_rigl75.yaml": (RigL, 0.75, 100, 3584),
    "params_gpt3_125m_set75.yaml": (SET, 0.75, 100, 3584),
    "params_gpt3_125m_sparsewide-ift_dense.yaml": None,
    "params_gpt3_125m_sparsewide-ift_rigl75.yaml": (RigL, 0.75, 500, 17209),
    "params_gpt3_125m_sparsewide-ift_static50.yaml": (Static, 0.5, None, None),
    "params_gpt3_125m_static75.yaml": (Static, 0.75, None, None),
    "params_gpt3_6p7b_vspdf_dart.yaml": None,
    "params_gpt3_6p7b_vspdf_phase1.yaml": (Static, 0.9, None, None),
    "params_gpt3_6p7b_vspdf_phase2.yaml": None,
}
SPARSE_FILES = [name for name, expected in MODELZOO_FILES.items() if expected is not None]
N_LAYERS = 2


# ---------------------------------------------------------------- a ModelZoo-named GPT tree


class Dense(nn.Module):
    """ModelZoo ``SingleFeedForwardLayer``: the weight is ``...linear_layer.weight``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear_layer = nn.Linear(d_in, d_out)


class FFN(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ffn = nn.ModuleList([Dense(d, 2 * d), Dense(2 * d, d)])


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj_q_dense_layer = nn.Linear(d, d)
        self.proj_k_dense_layer = nn.Linear(d, d)
        self.proj_v_dense_layer = nn.Linear(d, d)
        self.proj_output_dense_layer = nn.Linear(d, d)


class DecoderLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.self_attn = Attention(d)
        self.norm1 = nn.LayerNorm(d)
        self.ffn = FFN(d)


class Decoder(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(N_LAYERS)])


class Embeddings(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Embedding(16, d)


class GPT(nn.Module):
    """Parameter names as in ModelZoo's GPT-3 (``transformer_decoder.layers.{i}...``)."""

    def __init__(self, vocab: int = 32, d: int = 8) -> None:
        super().__init__()
        self.embedding_layer = Embeddings(vocab, d)
        self.transformer_decoder = Decoder(d)
        self.lm_head = nn.Linear(d, vocab)  # 2-D and dense: no pattern names it


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT()


GPT_SPARSE = {
    f"transformer_decoder.layers.{i}.{leaf}.weight"
    for i in range(N_LAYERS)
    for leaf in (
        "self_attn.proj_q_dense_layer",
        "self_attn.proj_k_dense_layer",
        "self_attn.proj_v_dense_layer",
        "self_attn.proj_output_dense_layer",
        "ffn.ffn.0.linear_layer",
        "ffn.ffn.1.linear_layer",
    )
}


def assert_masks(algorithm: Group, sparsity: float | dict[str, float]) -> None:
    """Every sparse parameter keeps exactly int((1 - s) * n) and is zero where pruned."""
    assert algorithm.sparse_params, "nothing was sparsified"
    for name, sp in algorithm.sparse_params.items():
        s = sparsity if isinstance(sparsity, float) else sparsity[name]
        assert sp.mask.dtype == torch.bool and sp.mask.shape == sp.param.shape
        assert int(sp.mask.sum()) == int((1 - s) * sp.mask.numel()), name
        assert not sp.param[~sp.mask].any(), name


def masks(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.named_buffers() if k.endswith("_mask")}


def describe(algorithm: object) -> tuple:
    """Everything that defines an algorithm's behaviour, comparable across config versions."""
    return (
        type(algorithm),
        repr(algorithm.sparsity),
        repr(getattr(algorithm, "update_schedule", None)),
        repr(getattr(algorithm, "drop_fraction", None)),
        repr(getattr(algorithm, "shaper", None)),
        algorithm.init_method,
        algorithm.seed,
    )


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        sum(p.square().sum() for p in model.parameters()).backward()
        optimizer.step()


# ---------------------------------------------------------------- ModelZoo files, unchanged


def test_compat_files_present() -> None:
    """The fixtures are part of the repository: a missing one fails, it is never skipped."""
    for version in VERSIONS:
        assert {p.name for p in (COMPAT / version).glob("*.yaml")} == set(MODELZOO_FILES)


@pytest.mark.skipif(
    not MODELZOO_PUBLISHED.is_dir(),
    reason=f"no published ModelZoo files at {MODELZOO_PUBLISHED} (optional: a checkout with "
    "shared/compat beside it); the repository's fixtures are tested without them",
)
@pytest.mark.parametrize("version", VERSIONS)
def test_fixtures_configure_as_the_published_modelzoo_files(version: str) -> None:
    """Each fixture's sparsity block equals the published file's, which configures unchanged
    into the same algorithms and the same masks."""
    published = MODELZOO_PUBLISHED / version
    assert {p.name for p in published.glob("*.yaml")} == set(MODELZOO_FILES)
    for name in MODELZOO_FILES:
        ours, theirs = COMPAT / version / name, published / name
        assert load_sparsity_block(ours) == load_sparsity_block(theirs), name
        mine, original = configure(ours), configure(theirs)
        if original is None:
            assert mine is None, name
            continue
        assert [describe(a) for a in mine] == [describe(a) for a in original], name
        model_mine, model_original = gpt(), gpt()
        model_mine.apply(mine)
        model_original.apply(original)
        for key, mask in masks(model_original).items():
            assert torch.equal(mask, masks(model_mine)[key]), (name, key)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", list(MODELZOO_FILES))
def test_modelzoo_file_configures(version: str, name: str) -> None:
    expected = MODELZOO_FILES[name]
    sparsity = configure(COMPAT / version / name)
    if expected is None:
        assert sparsity is None  # no sparsity block: dense training
        return
    cls, level, freq, stop = expected
    assert isinstance(sparsity, Group) and len(sparsity) == 1
    algorithm = sparsity[0]
    assert type(algorithm) is cls and algorithm.seed is None  # None: the experiment's seed
    assert algorithm.init_method is random_init
    assert algorithm.target_sparsity("any", 0) == level
    if cls is not Static:
        assert isinstance(algorithm.sparsity, Constant)
        # Update cadence {freq, stop}: stop exclusive, and step 0 is an update step (sparse start).
        assert isinstance(algorithm.update_schedule, FreqSchedule)
        assert (algorithm.update_schedule.freq, algorithm.update_schedule.stop) == (freq, stop)
        assert algorithm.starts_sparse
        assert algorithm.is_update_step(freq) and not algorithm.is_update_step(freq + freq // 2)
        assert algorithm.is_update_step((stop - 1) // freq * freq)  # the last update
        assert not algorithm.is_update_step(stop) and not algorithm.is_update_step(stop + freq)
        # drop_fraction: cosine from 0.3 down to 0 at half_period (= the update stop).
        assert isinstance(algorithm.drop_fraction, Cosine)
        assert algorithm.drop_fraction.init == 0.3 and algorithm.drop_fraction.half_period == stop
        assert algorithm.drop_fraction(0) == pytest.approx(0.3)
        assert algorithm.drop_fraction(stop // 2) == pytest.approx(0.15, abs=1e-3)
        assert algorithm.drop_fraction(stop) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", SPARSE_FILES)
def test_modelzoo_file_selects_attention_and_ffn_weights(version: str, name: str) -> None:
    model = gpt()
    sparsity = configure(COMPAT / version / name)
    model.apply(sparsity)
    assert set(sparsity.sparse_params) == GPT_SPARSE  # no biases, embeddings, norms or lm_head
    assert set(masks(model)) == {f"{n}_mask" for n in GPT_SPARSE}
    assert_masks(sparsity, MODELZOO_FILES[name][1])


def test_drop_fraction_cosine_values() -> None:
    """``{type: cosine, init: 0.3, half_period: 3584}``: 0.3 -> 0.15 -> 0 -> 0.3 (period 7168)."""
    drop = configure(COMPAT / "v2.10" / "params_gpt3_125m_rigl75.yaml")[0].drop_fraction
    for step, value in {0: 0.3, 1792: 0.15, 3584: 0.0, 5376: 0.15, 7168: 0.3}.items():
        assert drop(step) == pytest.approx(value, abs=1e-12)


@pytest.mark.parametrize("name", SPARSE_FILES)
def test_v21_and_v210_files_are_equivalent(name: str) -> None:
    old, new = (configure(COMPAT / version / name) for version in VERSIONS)
    assert [describe(a) for a in old] == [describe(a) for a in new]
    model_old, model_new = gpt(), gpt()
    model_old.apply(old)
    model_new.apply(new)
    assert list(old.sparse_params) == list(new.sparse_params)
    for key, mask in masks(model_old).items():
        assert torch.equal(mask, masks(model_new)[key]), key
    for key, value in model_old.state_dict().items():
        assert torch.equal(value, model_new.state_dict()[key]), key


def test_same_file_with_another_seed_gives_other_masks() -> None:
    """Guards the equivalence test above: masks do depend on the seed."""
    block = load_sparsity_block(COMPAT / "v2.1" / "params_gpt3_125m_static75.yaml")
    a, b = configure(block), configure({**block, "seed": 1})
    model_a, model_b = gpt(), gpt()
    model_a.apply(a)
    model_b.apply(b)
    assert any(not torch.equal(m, masks(model_b)[k]) for k, m in masks(model_a).items())
    assert_masks(b, 0.75)


def test_load_sparsity_block_finds_both_layouts() -> None:
    old = load_sparsity_block(COMPAT / "v2.1" / "params_gpt3_125m_rigl75.yaml")
    new = load_sparsity_block(COMPAT / "v2.10" / "params_gpt3_125m_rigl75.yaml")
    assert old["type"] == new["algorithm"] == "rigl"
    assert old["schedule"] == new["update"] == {"freq": 100, "stop": 3584}
    assert load_sparsity_block(COMPAT / "v2.10" / "params_gpt3_6p7b_vspdf_phase2.yaml") is None


# ---------------------------------------------------------------- float, dict and list forms


def test_float_is_static_with_default_filter() -> None:
    model = TinyNet()
    sparsity = configure(0.75)
    assert len(sparsity) == 1 and type(sparsity[0]) is Static and sparsity[0].sparsity(0) == 0.75
    model.apply(sparsity)
    assert set(sparsity.sparse_params) == {"fc1.weight", "fc2.weight"}  # not embed/norm/lm_head
    assert_masks(sparsity, 0.75)


def test_int_zero_is_a_valid_sparsity() -> None:
    sparsity = configure(0)
    assert type(sparsity[0]) is Static and sparsity[0].sparsity(0) == 0.0


def test_22_schedule_alias_with_update_steps() -> None:
    """``schedule`` is the 2.2+ alias of ``sparsity``: Cycling values at the listed steps."""
    model = TinyNet()
    sparsity = configure(
        {"algorithm": "gmp", "schedule": [0.1, 0.3, 0.5], "update": {"steps": [0, 6, 8]}}
    )
    gmp = sparsity[0]
    assert type(gmp) is GMP and isinstance(gmp.sparsity, Cycling)
    assert gmp.sparsity.values == [0.1, 0.3, 0.5]
    assert isinstance(gmp.update_schedule, ListSchedule) and gmp.update_schedule.steps == (0, 6, 8)
    model.apply(sparsity)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sparsity.apply(optimizer)
    assert set(sparsity.sparse_params) == {"fc1.weight", "fc2.weight"}
    assert_masks(sparsity, 0.1)
    train(model, optimizer, 7)  # the update at step 6 runs before the 7th optimizer step
    assert_masks(sparsity, 0.3)
    train(model, optimizer, 2)
    assert_masks(sparsity, 0.5)


PER_PATTERN_20 = {
    "type": "gmp",
    "param_name_patterns": {
        "fc_layers.*weight": {"sparsity_schedule": [[0, 0.1], [6, 0.3], [8, 0.5]]},
        "final_layer.*weight": {"sparsity_schedule": [[0, 0.2], [6, 0.5], [8, 0.7]]},
    },
}
# Its 2.2+ equivalent (reference section 5.2): a list of configs with globs.
PER_PATTERN_22 = [
    {
        "algorithm": "gmp",
        "param_filter": "fc_layers*weight",
        "schedule": [0.1, 0.3, 0.5],
        "update": {"steps": [0, 6, 8]},
    },
    {
        "algorithm": "gmp",
        "param_filter": "final_layer*weight",
        "schedule": [0.2, 0.5, 0.7],
        "update": {"steps": [0, 6, 8]},
    },
]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc_layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.final_layer = nn.Linear(16, 4)


FC = ["fc_layers.0.weight", "fc_layers.2.weight"]


def test_20_per_pattern_dict_is_a_group_of_gmps() -> None:
    sparsity = configure(PER_PATTERN_20)
    assert isinstance(sparsity, Group) and [type(a) for a in sparsity] == [GMP, GMP]
    assert [a.sparsity.values for a in sparsity] == [[0.1, 0.3, 0.5], [0.2, 0.5, 0.7]]
    assert all(isinstance(a.sparsity, Cycling) for a in sparsity)
    assert [a.update_schedule.steps for a in sparsity] == [(0, 6, 8), (0, 6, 8)]
    model = MLP()
    model.apply(sparsity)
    assert list(sparsity[0].sparse_params) == FC  # biases do not match "...weight"
    assert list(sparsity[1].sparse_params) == ["final_layer.weight"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sparsity.apply(optimizer)
    for steps, (fc, final) in [(0, (0.1, 0.2)), (7, (0.3, 0.5)), (2, (0.5, 0.7))]:
        train(model, optimizer, steps)
        assert_masks(sparsity, {**dict.fromkeys(FC, fc), "final_layer.weight": final})


def test_20_per_pattern_dict_equals_its_22_list_form() -> None:
    old, new = configure(PER_PATTERN_20), configure(PER_PATTERN_22)
    assert [describe(a) for a in old] == [describe(a) for a in new]
    models = MLP(), MLP()
    for model, sparsity in zip(models, (old, new), strict=True):
        model.apply(sparsity)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sparsity.apply(optimizer)
        train(model, optimizer, 9)
    assert masks(models[0]).keys() == masks(models[1]).keys()
    for key, mask in masks(models[0]).items():
        assert torch.equal(mask, masks(models[1])[key]), key


def test_20_per_pattern_options_override_shared_ones() -> None:
    sparsity = configure(
        {
            "type": "set",
            "sparsity": 0.5,
            "schedule": 10,
            "drop_fraction": 0.1,
            "param_name_patterns": {"fc_layers": None, "final_layer": {"sparsity": 0.8}},
        }
    )
    assert [a.sparsity(0) for a in sparsity] == [0.5, 0.8]
    assert [a.drop_fraction(0) for a in sparsity] == [0.1, 0.1]
    assert [a.update_schedule.freq for a in sparsity] == [10, 10]


def test_20_sparsity_schedule_without_patterns() -> None:
    gmp = configure({"type": "gmp", "sparsity_schedule": [[0, 0.1], [6, 0.3], [8, 0.5]]})[0]
    assert gmp.sparsity.values == [0.1, 0.3, 0.5] and gmp.update_schedule.steps == (0, 6, 8)


@pytest.mark.parametrize(
    "config",
    [
        {"type": "set", "sparsity": 0.5, "schedule": 100},  # 2.0/2.1: schedule = cadence
        {"type": "gmp", "sparsity": [0.2, 0.5], "schedule": 100},
        {"sparsity": 0.5, "type": "rigl", "schedule": 100, "param_name_patterns": ".*"},
    ],
)
def test_legacy_int_schedule_is_update_frequency(config: dict) -> None:
    algorithm = configure(config)[0]
    assert isinstance(algorithm.update_schedule, FreqSchedule)
    assert (algorithm.update_schedule.freq, algorithm.update_schedule.start) == (100, 0)
    assert algorithm.update_schedule.stop is None
    assert [algorithm.is_update_step(t) for t in (50, 100, 150, 200, 10_000)] == [
        False,
        True,
        False,
        True,
        True,
    ]


@pytest.mark.parametrize(
    "config",
    [
        None,
        {"sparsity": None},
        {"algorithm": "rigl", "sparsity": None, "update": {"freq": 5}},
        {"type": "set", "sparsity": None},
        [{"sparsity": None}],
        [],
    ],
)
def test_null_sparsity_is_dense(config: object) -> None:
    assert configure(config) is None


def test_configure_does_not_mutate_its_input() -> None:
    config = [copy.deepcopy(PER_PATTERN_20), copy.deepcopy(PER_PATTERN_22[0])]
    for entry in config:
        entry.setdefault("drop_fraction", {"type": "cosine", "init": 0.3, "half_period": 10})
    config[0]["type"] = config[1]["algorithm"] = "set"
    before = copy.deepcopy(config)
    configure(config)
    configure({"groups": [{"algorithm": "set", "params": config[1]}]})
    assert config == before


def test_null_entry_in_a_list_is_dropped() -> None:
    sparsity = configure([{"sparsity": None, "param_filter": "fc1.*"}, {"sparsity": 0.5}])
    assert len(sparsity) == 1 and sparsity[0].sparsity(0) == 0.5


@pytest.mark.parametrize(
    "config",
    [
        {"sparsity": 0.5, "schedule": 0.5},
        {"algorithm": "gmp", "sparsity": [0.1, 0.2], "schedule": [0.1, 0.2]},
        {"algorithm": "gmp", "sparsity": [0.1, 0.2], "schedule": 100, "update": {"freq": 10}},
        {
            "algorithm": "set",
            "sparsity": 0.5,
            "schedule": {"type": "linear", "init": 0.1, "slope": 0},
        },
    ],
)
def test_sparsity_and_schedule_aliases_conflict(config: dict) -> None:
    with pytest.raises(ValueError, match="'sparsity' and 'schedule'"):
        configure(config)


@pytest.mark.parametrize("schedule", [100, {"freq": 100}])
def test_22_form_with_sparsity_and_cadence_schedule_conflicts(schedule: object) -> None:
    """With ``algorithm`` (a 2.2+ key) ``schedule`` can only be the ``sparsity`` alias, as in
    Cerebras 2.2+ ``configure`` and the ModelZoo validator: giving both is an error."""
    with pytest.raises(ValueError, match="'sparsity' and 'schedule'"):
        configure({"algorithm": "set", "sparsity": 0.5, "schedule": schedule})


def test_sparsity_schedule_is_not_silently_overridden_by_schedule() -> None:
    """2.0 ``validate_options`` lets ``sparsity_schedule``'s steps win over ``schedule``; dropping
    them for ``schedule: 100`` would apply the Cycling values at the wrong steps."""
    config = {"type": "gmp", "sparsity_schedule": [[0, 0.1], [6, 0.3]], "schedule": 100}
    try:
        gmp = configure(config)[0]
    except ValueError:
        return  # rejecting the mix is fine too
    assert isinstance(gmp.update_schedule, ListSchedule) and gmp.update_schedule.steps == (0, 6)


def test_list_first_match_wins() -> None:
    model = TinyNet()
    sparsity = configure(
        [
            {"sparsity": 0.25, "param_filter": "fc1.weight"},
            {
                "algorithm": "set",
                "sparsity": 0.75,
                "param_filter": ["fc*.weight", "lm_head.weight"],
                "update": {"freq": 10},
            },
            {"sparsity": 0.5},  # default filter: fc1/fc2 are taken already, the rest stays dense
        ]
    )
    assert [type(a) for a in sparsity] == [Static, SET, Static]
    model.apply(sparsity)
    assert list(sparsity[0].sparse_params) == ["fc1.weight"]
    assert list(sparsity[1].sparse_params) == ["fc2.weight", "lm_head.weight"]
    assert not sparsity[2].sparse_params
    assert_masks(sparsity, {"fc1.weight": 0.25, "fc2.weight": 0.75, "lm_head.weight": 0.75})


def test_regex_patterns_use_search_and_globs_match_whole_names() -> None:
    model = gpt()
    by_regex = configure({"type": "static", "sparsity": 0.5, "param_name_patterns": "q_dense"})
    model.apply(by_regex)
    assert set(by_regex.sparse_params) == {n for n in GPT_SPARSE if "proj_q" in n} | {
        n.replace("weight", "bias") for n in GPT_SPARSE if "proj_q" in n
    }
    with pytest.warns(UserWarning, match="no parameter"):
        gpt().apply(configure({"sparsity": 0.5, "param_filter": "q_dense"}))


# ---------------------------------------------------------------- user subclasses


class MyGranet(DynamicSparsityAlgorithm):
    """Test-only algorithm: magnitude pruning with an extra option, selectable by name."""

    def __init__(self, sparsity: object, boost: float = 1.0, **kwargs: object) -> None:
        super().__init__(sparsity, **kwargs)
        self.boost = boost

    def update_mask(
        self, name: str, p: torch.Tensor, mask: torch.Tensor, sparsity: float
    ) -> torch.Tensor:
        keep = int((1 - sparsity) * p.numel())
        return topk_mask(p.abs().flatten() * self.boost, keep).view_as(p)


def test_user_subclass_is_selectable_by_name(tmp_path: Path) -> None:
    assert available_algorithms()["mygranet"] is MyGranet
    config = {"algorithm": "mygranet", "sparsity": 0.6, "boost": 2.0, "update": {"freq": 3}}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(config))
    for source in (config, tmp_path / "mine.yaml", str(tmp_path / "mine.yaml")):
        model = TinyNet()
        sparsity = configure(source)
        mine = sparsity[0]
        assert type(mine) is MyGranet and mine.boost == 2.0 and mine.update_schedule.freq == 3
        model.apply(sparsity)
        assert_masks(sparsity, 0.6)


def test_user_subclass_by_legacy_type_key() -> None:
    assert type(configure({"type": "MyGranet", "sparsity": 0.5})[0]) is MyGranet


# ---------------------------------------------------------------- errors


def test_unknown_key_names_it_and_lists_accepted_keys() -> None:
    with pytest.raises(ValueError, match="drop_fractoin") as err:
        configure({"algorithm": "rigl", "sparsity": 0.5, "drop_fractoin": 0.3})
    for key in ("drop_fraction", "update", "init_method", "param_filter", "balance_in_groups"):
        assert key in str(err.value)
    with pytest.raises(ValueError, match="boots") as err:
        configure({"algorithm": "mygranet", "sparsity": 0.5, "boots": 2.0})
    assert "boost" in str(err.value) and "update" in str(err.value)


def test_static_rejects_dynamic_options() -> None:
    with pytest.raises(ValueError, match="drop_fraction"):
        configure({"algorithm": "static", "sparsity": 0.5, "drop_fraction": 0.3})


def test_legacy_static_with_schedule_names_the_key_the_user_wrote() -> None:
    """The user wrote ``schedule``; an error that only says ``update`` points nowhere."""
    with pytest.raises(ValueError, match="schedule"):
        configure({"type": "static", "sparsity": 0.5, "schedule": 100})


def test_unknown_algorithm_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown sparsity algorithm 'magic'") as err:
        configure({"algorithm": "magic", "sparsity": 0.5})
    for name in ("static", "gmp", "set", "rigl", "granet", "mygranet"):
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({}, ValueError, "no 'sparsity'"),
        ({"algorithm": "set"}, ValueError, "no 'sparsity'"),
        (1.0, ValueError, r"\[0, 1\)"),
        (-0.1, ValueError, r"\[0, 1\)"),
        (True, TypeError, "not supported"),
        ({"type": "sideband", "sparsity": 0.5}, ValueError, "sideband"),
        ({"algorithm": "gmp", "sparsity": 0.5}, ValueError, "constant"),
        ({"algorithm": "static", "type": "rigl", "sparsity": 0.5}, ValueError, "keep only"),
        (
            {"sparsity": 0.5, "param_filter": "*", "param_name_patterns": ".*"},
            ValueError,
            "not both",
        ),
        ({"sparsity": 0.5, "param_filter": 3}, TypeError, "param_filter"),
        ({"algorithm": "set", "sparsity": 0.5, "update": {"every": 3}}, ValueError, "every"),
        ({"type": "gmp", "sparsity_schedule": [0.1, 0.3]}, ValueError, "sparsity_schedule"),
        ([{"sparsity": 0.5}, "fc1"], TypeError, "dict or a float"),
    ],
)
def test_bad_configs_raise_before_building(config: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        configure(config)


def test_ignored_legacy_keys_warn() -> None:
    with pytest.warns(UserWarning, match="add_summaries"):
        sparsity = configure({"sparsity": 0.5, "add_summaries": True})
    assert sparsity[0].sparsity(0) == 0.5


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        configure(tmp_path / "nope.yaml")


# ---------------------------------------------------------------- YAML files


def test_yaml_bare_sparsity_block(tmp_path: Path) -> None:
    path = tmp_path / "sparsity.yaml"
    path.write_text(
        "algorithm: set\nsparsity: 0.8\nupdate: {freq: 10, stop: 50}\ndrop_fraction: 0.2\n"
        "param_filter: ['fc*.weight']\n"
    )
    algorithm = configure(path)[0]
    assert type(algorithm) is SET and algorithm.sparsity(0) == 0.8
    assert algorithm.drop_fraction(0) == 0.2 and algorithm.update_schedule.stop == 50


@pytest.mark.parametrize(
    ("text", "types"),
    [
        ("0.7\n", [Static]),
        (
            "- {algorithm: static, sparsity: 0.3, param_filter: 'fc1.*'}\n"
            "- {algorithm: rigl, sparsity: 0.8, update: {freq: 10}}\n",
            [Static, RigL],
        ),
        ("trainer:\n  init:\n    sparsity: {algorithm: gmp, sparsity: [0.1, 0.2]}\n", [GMP]),
        ("model: {}\nsparsity: {type: set, sparsity: 0.5, schedule: 20}\n", [SET]),
    ],
)
def test_yaml_forms(tmp_path: Path, text: str, types: list[type]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert [type(a) for a in configure(path)] == types


@pytest.mark.parametrize("text", ["", "model: {d_model: 8}\n", "trainer: {init: {seed: 1}}\n"])
def test_yaml_without_sparsity_is_dense(tmp_path: Path, text: str) -> None:
    path = tmp_path / "dense.yaml"
    path.write_text(text)
    assert configure(path) is None


def test_yaml_with_only_a_legacy_sparsity_section(tmp_path: Path) -> None:
    """The ``sparsity:`` section of a 2.1 params file, saved on its own, configures unchanged."""
    path = tmp_path / "legacy.yaml"
    path.write_text("sparsity:\n  type: rigl\n  sparsity: 0.75\n  schedule: 100\n")
    algorithm = configure(path)[0]
    assert type(algorithm) is RigL and algorithm.update_schedule.freq == 100


# ---------------------------------------------------------------- ModelZoo config-class nesting


def test_modelzoo_groups_params_nesting_list() -> None:
    """``flatten_sparsity_params``: ``{"groups": [{"algorithm", "params": {...}}, ...]}``."""
    sparsity = configure(
        {
            "groups": [
                {"algorithm": "static", "params": {"sparsity": 0.3, "param_filter": "fc1.weight"}},
                {"algorithm": "set", "params": {"sparsity": 0.7, "update": {"freq": 5}}},
            ]
        }
    )
    assert [type(a) for a in sparsity] == [Static, SET]
    assert sparsity[1].update_schedule.freq == 5
    model = TinyNet()
    model.apply(sparsity)
    assert_masks(sparsity, {"fc1.weight": 0.3, "fc2.weight": 0.7})


def test_modelzoo_groups_params_nesting_single_dict() -> None:
    """``flatten_sparsity_params`` also accepts one group as a dict (not a list)."""
    sparsity = configure({"groups": {"algorithm": "rigl", "params": {"sparsity": 0.6}}})
    assert [type(a) for a in sparsity] == [RigL] and sparsity[0].sparsity(0) == 0.6


def test_params_only_nesting() -> None:
    sparsity = configure({"algorithm": "set", "params": {"sparsity": 0.4, "drop_fraction": 0.1}})
    assert type(sparsity[0]) is SET and sparsity[0].drop_fraction(0) == 0.1


# ---------------------------------------------------------------- masks at the configured sparsity


@settings(max_examples=15, deadline=None)
@given(level=st.floats(0.0, 0.99), seed=st.integers(0, 2**31))
def test_float_config_masks_keep_exact_count(level: float, seed: int) -> None:
    model = TinyNet()
    sparsity = configure({"sparsity": level, "seed": seed})
    model.apply(sparsity)
    assert_masks(sparsity, level)


@pytest.mark.parametrize("algorithm", ["static", "set", "rigl", "granet", "mygranet"])
@pytest.mark.parametrize("init_method", ["random", "topk"])
def test_every_algorithm_starts_at_configured_sparsity(algorithm: str, init_method: str) -> None:
    model = gpt()
    sparsity = configure(
        {
            "algorithm": algorithm,
            "sparsity": 0.8,
            "init_method": init_method,
            "param_filter": ["*proj_[qkv]_dense_layer.weight", "*linear_layer.weight"],
            **({} if algorithm == "static" else {"update": {"freq": 10}}),
        }
    )
    model.apply(sparsity)
    assert len(sparsity.sparse_params) == N_LAYERS * 5
    assert_masks(sparsity, 0.8)
