"""`SparsityTrainerCallback` under ``transformers.Trainer``: pruned weights exactly zero after
every step, masks updated before gradient clipping, a run resumed from a mid-run checkpoint
equal to the uninterrupted run (masks, weights, algorithm state), no mask in the Trainer's
checkpoints nor in ``save_model`` (``from_pretrained`` loads it cleanly), schedules checked up to
``max_steps`` before anything changes, and the files of earlier versions still resume."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_sparse.core import Group, RigL, Static  # noqa: E402
from lightning_sparse.core.bitpack import unpack_bits  # noqa: E402
from lightning_sparse.integrations.hf import STATE_FILE, SparsityTrainerCallback  # noqa: E402
from tests.helpers import (  # noqa: E402, F401  (one_thread: autouse fixture)
    assert_state_equal,
    full_state,
    hf_llama_fields,
    mask_buffers,
    one_thread,
)

LLAMA = hf_llama_fields(hidden_size=16, num_hidden_layers=1, intermediate_size=32)


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences; labels = inputs (the model shifts them)."""

    def __init__(self, n: int = 24, seq: int = 8) -> None:
        self.ids = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class ZeroCheck(transformers.TrainerCallback):
    """Records, after every optimizer step, whether every pruned weight is exactly zero."""

    def __init__(self, sparsity: Any) -> None:
        self.sparsity = sparsity
        self.steps: list[tuple[int, bool]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        exact = all(
            bool((sp.param.detach()[~sp.mask] == 0).all())
            for sp in self.sparsity.sparse_params.values()
        )
        self.steps.append((state.global_step, exact))


class StopAt(transformers.TrainerCallback):
    """Interrupts training after ``step`` (the run keeps its max_steps, so its learning-rate
    schedule is the uninterrupted run's; a shorter max_steps would decay it differently)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def rigl() -> RigL:
    return RigL(0.75, update={"freq": 2, "stop": 12}, drop_fraction=0.3, seed=1)


def train(
    out: Path,
    sparsity: Any,
    max_steps: int,
    resume: str | None = None,
    stop_at: int | None = None,
    model: nn.Module | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, ZeroCheck]:
    model = model if model is not None else llama()
    check = ZeroCheck(sparsity)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **kwargs,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        callbacks=[
            SparsityTrainerCallback(sparsity),
            check,
            *([StopAt(stop_at)] if stop_at else []),
        ],
    )
    trainer.train(resume_from_checkpoint=resume)
    return model, check


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_equals_uninterrupted(tmp_path: Path, accumulate: int) -> None:
    """8 steps straight versus 4, interrupted, then resumed from ``checkpoint-4`` to 8. The
    Trainer restores the data order (RNG states, skipped batches), so everything is bit-exact."""
    acc = {"gradient_accumulation_steps": accumulate}
    straight = rigl()
    model_a, check_a = train(tmp_path / "a", straight, max_steps=8, **acc)
    first = rigl()
    train(tmp_path / "b", first, max_steps=8, stop_at=4, **acc)
    assert (tmp_path / "b" / "checkpoint-4" / STATE_FILE).is_file()
    resumed = rigl()
    model_b, check_b = train(
        tmp_path / "b", resumed, max_steps=8, resume=str(tmp_path / "b" / "checkpoint-4"), **acc
    )

    assert straight.step == resumed.step == 8
    assert straight.last_update_step == resumed.last_update_step == 6
    assert len(straight.sparse_params) == 7  # q, k, v, o, gate, up, down
    # RigL changed the masks during the run: the resume had real updates to reproduce.
    first_masks = {n: sp.mask for n, sp in first.sparse_params.items()}
    assert any(not torch.equal(first_masks[n], sp.mask) for n, sp in straight.sparse_params.items())
    assert_state_equal(full_state(model_a), full_state(model_b))  # weights and masks
    assert_state_equal(straight.state_dict(), resumed.state_dict())
    assert check_a.steps == [(s, True) for s in range(1, 9)]
    assert check_b.steps == [(s, True) for s in range(5, 9)]
    for folder in (tmp_path / "b" / "checkpoint-4", tmp_path / "b" / "checkpoint-8"):
        assert not [k for k in saved_keys(folder) if k.endswith("_mask")], folder
        assert set(torch.load(folder / STATE_FILE, weights_only=True)) == {
            "global_step",
            "algorithm",
        }


def saved_keys(folder: Path) -> list[str]:
    """The tensor names of a ``save_pretrained`` folder's safetensors file(s)."""
    from safetensors import safe_open

    keys = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys += list(f.keys())
    assert keys, f"no safetensors in {folder}"
    return keys


def test_save_model_has_no_masks_and_from_pretrained_is_clean(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sparsity = rigl()
    model, _ = train(tmp_path / "run", sparsity, max_steps=4)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True
    )
    trainer = transformers.Trainer(model=model, args=args)
    trainer.save_model(str(tmp_path / "final"))
    assert not [k for k in saved_keys(tmp_path / "final") if k.endswith("_mask")]
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        loaded, info = transformers.LlamaForCausalLM.from_pretrained(
            str(tmp_path / "final"), output_loading_info=True
        )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info.get("error_msgs"), info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    tokens = Tokens().ids[:2]
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    for name, sp in sparsity.sparse_params.items():  # zero where pruned, nothing else needed
        assert not loaded.get_parameter(name).detach()[~sp.mask].any(), name


def test_a_schedule_invalid_before_max_steps_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    """0.5 + 0.1 * step reaches 1.0 at step 5; the Lightning callback refuses it at setup, this
    one at train begin, before the model or the optimizer is modified."""
    sparsity = RigL({"type": "linear", "init": 0.5, "slope": 0.1}, update={"freq": 2})
    model = llama()
    before = full_state(model)
    with pytest.raises(ValueError, match=r"sparsity.*step 6"):
        train(tmp_path, sparsity, max_steps=8, model=model)
    assert_state_equal(full_state(model), before)
    assert sparsity.root is None and not sparsity.optimizers and not mask_buffers(model)


def test_a_sparsity_state_of_an_earlier_version_resumes(tmp_path: Path) -> None:
    """Earlier versions wrote the masks into the model files and a bool ``"masks"`` dict into
    ``sparsity_state.pt``: such a checkpoint resumes exactly."""
    straight = rigl()
    model_a, _ = train(tmp_path / "a", straight, max_steps=8)
    train(tmp_path / "b", rigl(), max_steps=8, stop_at=4)
    folder = tmp_path / "b" / "checkpoint-4"
    saved = torch.load(folder / STATE_FILE, weights_only=True)
    algorithm = saved["algorithm"]
    masks = {
        name: unpack_bits(packed, algorithm["params"][name])
        for name, packed in algorithm.pop("masks").items()
    }
    torch.save({**saved, "masks": masks}, folder / STATE_FILE)
    from safetensors.torch import load_file, save_file

    (weights,) = folder.glob("*.safetensors")
    state = load_file(str(weights))
    state.update({f"{name}_mask": mask for name, mask in masks.items()})
    save_file(state, str(weights), metadata={"format": "pt"})
    resumed = rigl()
    model_b, _ = train(tmp_path / "b", resumed, max_steps=8, resume=str(folder))
    assert_state_equal(full_state(model_a), full_state(model_b))
    assert_state_equal(straight.state_dict(), resumed.state_dict())


def test_masks_update_before_clipping(tmp_path: Path) -> None:
    """On an update step the clipped gradient is the masked one: the norm of the gradient the
    optimizer applies is at most max_grad_norm (RigL leaves it dense until the update)."""
    sparsity = RigL(0.75, update={"freq": 1}, drop_fraction=0.3, seed=1)
    norms: list[float] = []

    def record(optimizer: torch.optim.Optimizer, *args: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norms.append(
            float(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            )
        )
        for name, sp in sparsity.sparse_params.items():
            assert bool((sp.param.grad[~sp.mask] == 0).all()), name  # masked before clipping

    model = llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_grad_norm=1e-3,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    callback = SparsityTrainerCallback(sparsity)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[callback]
    )
    trainer.create_optimizer()
    trainer.optimizer.register_step_pre_hook(record)
    trainer.train()
    assert len(norms) == 3 and sparsity.last_update_step == 2
    assert all(n == pytest.approx(1e-3, rel=1e-4) for n in norms), norms
    assert args.max_grad_norm == 1e-3  # handed back at the end of training


def test_group_and_wrong_checkpoint(tmp_path: Path) -> None:
    group = Group({"*mlp*": RigL(0.5, update={"freq": 2}, seed=0), "*self_attn*": Static(0.8)})
    _, check = train(tmp_path, group, max_steps=4)
    assert check.steps == [(s, True) for s in range(1, 5)]
    saved = torch.load(tmp_path / "checkpoint-4" / STATE_FILE, weights_only=True)
    groups = saved["algorithm"]["groups"]
    assert len(groups) == 2 and sum(len(g["masks"]) for g in groups) == 7
    # Resuming with other filters or settings is refused before the model is touched.
    for other, message in (
        (
            Group({"*mlp*": RigL(0.5, update={"freq": 2}, seed=0), "*q_proj*": Static(0.8)}),
            "names or shapes",
        ),
        (
            Group({"*mlp*": RigL(0.6, update={"freq": 2}, seed=0), "*self_attn*": Static(0.8)}),
            "sparsity=",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            train(tmp_path, other, max_steps=6, resume=str(tmp_path / "checkpoint-4"))
        assert other.root is None and not other.sparse_params


def test_imports_no_lightning() -> None:
    code = (
        "import sys, lightning_sparse.integrations.hf; "
        "sys.exit(any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_rejects_non_algorithm() -> None:
    with pytest.raises(TypeError, match="lightning_sparse.core algorithm or Group"):
        SparsityTrainerCallback(0.9)  # type: ignore[arg-type]
