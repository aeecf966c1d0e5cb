"""`load_lit_checkpoint` (behind ``export(<checkpoint path>)``) runs nothing a file names: a class
path from the checkpoint or its config is checked against the allow-list before any import, and
the config is read only from the checkpoint's own run directory (or the file the caller names).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_sparse import Static, export  # noqa: E402
from lightning_sparse.integrations.lit_checkpoint import (  # noqa: E402
    load_lit_checkpoint,
    run_config_of,
)
from lightning_sparse.models import LitCausalLM  # noqa: E402
from tests.helpers import one_thread, sparse_hf_lit  # noqa: E402, F401  (autouse: one torch thread)


class MyLit(LitCausalLM):
    """A user's subclass: allowed only when passed in ``model_classes``."""


def side_effect_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A module on ``sys.path`` that writes a file when imported; (its name, that file)."""
    name = f"side_effect_{tmp_path.name.replace('-', '_')}"
    ran = tmp_path / "import_ran"
    (tmp_path / "pkgs").mkdir()
    (tmp_path / "pkgs" / f"{name}.py").write_text(
        f"open({str(ran)!r}, 'w').close()\n"
        "from lightning_sparse.models import LitCausalLM\n"
        "class Lit(LitCausalLM):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    return name, ran


def save(path: Path, lit: LitCausalLM, class_path: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    hparams = {"_class_path": class_path, **lit.hparams}
    torch.save({"hyper_parameters": hparams, "state_dict": lit.state_dict()}, path)
    return path


def tiny_lit() -> LitCausalLM:
    torch.manual_seed(0)
    lit = LitCausalLM(vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=32)
    lit.apply(Static(0.8))
    return lit.eval()


def test_a_class_path_outside_the_allow_list_is_refused_and_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, ran = side_effect_module(tmp_path, monkeypatch)
    ckpt = save(tmp_path / "run/checkpoints/last.ckpt", tiny_lit(), f"{name}.Lit")
    with pytest.raises(ValueError, match=rf"names the class '{name}.Lit'.*model_classes="):
        export(ckpt, tmp_path / "out")
    assert not ran.exists() and name not in sys.modules

    # The same module named by the run's config (the recipe's model.init_args.model).
    ckpt = save(
        tmp_path / "run/checkpoints/last.ckpt", tiny_lit(), "lightning_sparse.models.LitCausalLM"
    )
    (tmp_path / "run/config.yaml").write_text(
        f"model:\n  init_args:\n    model:\n      class_path: {name}.Lit\n"
    )
    with pytest.raises(ValueError, match=rf"config.yaml' \(model.init_args.model\) names .*{name}"):
        export(ckpt, tmp_path / "out")
    (tmp_path / "run/config.yaml").write_text(f"model:\n  init_args:\n    model: {name}.Lit\n")
    with pytest.raises(ValueError, match=rf"names the class '{name}.Lit'"):
        export(ckpt, tmp_path / "out")
    assert not ran.exists() and name not in sys.modules
    assert not (tmp_path / "out").exists()


def test_a_class_the_caller_passes_is_allowed(tmp_path: Path) -> None:
    lit = tiny_lit()
    ckpt = save(tmp_path / "user.ckpt", lit, f"{__name__}.MyLit")
    with pytest.raises(ValueError, match=r"MyLit'.*allowed: \['lightning_sparse"):
        load_lit_checkpoint(ckpt)
    module = load_lit_checkpoint(ckpt, model_classes=[MyLit])
    assert type(module) is MyLit
    idx = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert torch.equal(module(idx), lit(idx))


def test_a_checkpoint_outside_its_run_directory_reads_no_config(tmp_path: Path) -> None:
    """``downloads/last.ckpt`` with a ``config.yaml`` in ``downloads/`` and one folder above:
    neither is the run's, so neither is read; ``run_config=`` names one explicitly."""
    lit = sparse_hf_lit(tmp_path / "base")
    ckpt = save(tmp_path / "downloads/last.ckpt", lit, "lightning_sparse.models.LitCausalLM")
    recipe = (
        "model:\n  class_path: lightning_sparse.models.LitCausalLM\n  init_args:\n    model:\n"
        "      class_path: lightning_sparse.models.hf.HFCausalLM\n"
        f"      init_args: {{path: {tmp_path / 'base'}}}\n"
    )
    (tmp_path / "config.yaml").write_text(recipe)
    (tmp_path / "downloads/config.yaml").write_text(recipe)
    assert run_config_of(ckpt) is None
    with pytest.raises(ValueError, match=r"and no run config.yaml.*--run_config"):
        export(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    # The recipe's nested model is built by LightningCLI's instantiate_module: jsonargparse.
    pytest.importorskip("jsonargparse")
    export(ckpt, tmp_path / "out", run_config=tmp_path / "config.yaml")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    idx = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=idx).logits, lit(idx), rtol=0, atol=1e-5)

    # In its run directory (version_N/checkpoints/), the run's config.yaml is found.
    run = tmp_path / "outputs/version_3"
    ckpt = save(run / "checkpoints/last.ckpt", lit, "lightning_sparse.models.LitCausalLM")
    (run / "config.yaml").write_text(recipe)
    assert run_config_of(ckpt) == run / "config.yaml"
    assert run_config_of(run / "last.ckpt") is None  # beside it is not where fit writes it


def test_unreadable_checkpoints_and_configs_name_the_file(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"checkpoint '.*garbage.ckpt' is not a file torch.load"):
        export(garbage, tmp_path / "out")
    plain = tmp_path / "plain.ckpt"
    torch.save([1, 2], plain)
    with pytest.raises(ValueError, match=r"plain.ckpt' has no 'state_dict'"):
        export(plain, tmp_path / "out")
    ckpt = save(
        tmp_path / "run/checkpoints/last.ckpt", tiny_lit(), "lightning_sparse.models.LitCausalLM"
    )
    (tmp_path / "run/config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match=r"run config '.*config.yaml' is not valid YAML"):
        export(ckpt, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"run config '.*nope.yaml' is not a file"):
        export(ckpt, tmp_path / "out", run_config=tmp_path / "nope.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.ckpt", "plain.ckpt", "run"]
