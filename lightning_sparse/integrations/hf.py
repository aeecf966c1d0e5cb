"""`SparsityTrainerCallback`: a core algorithm (or `Group`) driven by ``transformers.Trainer``.

The hooks call what a plain PyTorch loop calls (`docs/hf_trainer.md`):

1. ``on_train_begin`` (the Trainer has built, wrapped and, on resume, loaded the model and the
   optimizer): the schedules checked up to ``max_steps`` (before anything changes);
   ``apply(model)``; on resume, the checkpoint's algorithm state (masks included) and weights;
   then ``apply(optimizer)`` (the torch optimizer inside Accelerate's wrapper).
2. ``on_pre_optimizer_step`` (gradients accumulated, before ``optimizer.step()``):
   ``before_step`` (mask update on update steps, gradients and weights pruned), then gradient
   clipping. The Trainer clips *before* any callback hook, but masks must change before clipping
   (RigL's and GraNet's gradients are dense on update steps, and the norm must be the norm of the
   gradient the step applies), so the callback takes the clipping over: it sets
   ``args.max_grad_norm`` to 0 for the run and clips with the original value itself (restored at
   ``on_train_end``; the ``grad_norm`` the Trainer logs is then measured before the update).
3. ``on_save``: the algorithm state, masks included (packed bits), into
   ``checkpoint-N/sparsity_state.pt``. The mask buffers are non-persistent, so the Trainer's
   checkpoints and ``save_model`` hold the weights only (pruned ones 0) and
   ``from_pretrained`` loads them with no unexpected key. Files of earlier versions (a bool
   ``"masks"`` dict beside the state) still resume.

Only ``lightning_sparse.core`` is imported here; ``transformers`` is needed (``pip install
lightning_sparse[hf]``). DeepSpeed, whose engine clips inside its own step, is not supported.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lightning_sparse.core import Group, SparsityAlgorithm, legacy

__all__ = ["STATE_FILE", "SparsityTrainerCallback"]

STATE_FILE = "sparsity_state.pt"  # in each checkpoint-N/ folder
log = logging.getLogger(__name__)


class SparsityTrainerCallback(TrainerCallback):
    """Trains with ``sparsity`` under ``transformers.Trainer``; checkpoints resume exactly.

    Args:
        sparsity: a core algorithm (``lightning_sparse.core.RigL(0.9, update={"freq": 100})``)
            or a `Group` (``lightning_sparse.core.configure(...)``), not yet applied (or applied
            to the Trainer's model).

    Raises:
        TypeError: ``sparsity`` is neither.
    """

    def __init__(self, sparsity: SparsityAlgorithm | Group) -> None:
        if not isinstance(sparsity, SparsityAlgorithm | Group):
            raise TypeError(
                f"SparsityTrainerCallback(sparsity={sparsity!r}) needs a lightning_sparse.core "
                "algorithm or Group, e.g. lightning_sparse.core.RigL(0.9, update={'freq': 100})"
            )
        self.sparsity = sparsity
        self.max_grad_norm = 0.0  # taken over from the TrainingArguments (module docstring)
        self._optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ 1. train begin
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        """Check the schedules up to ``max_steps``, then sparsify the model (restoring the
        checkpoint's masks on resume) and the optimizer.

        Raises:
            ValueError: a schedule reaches an invalid value by ``max_steps`` (the Trainer's
                ``state.max_steps``), DeepSpeed, or a checkpoint that does not fit; the model
                and the optimizer are unchanged.
        """
        if model is None or optimizer is None:
            raise RuntimeError(
                "SparsityTrainerCallback needs the model and optimizer the Trainer "
                "passes to on_train_begin; use transformers.Trainer"
            )
        if getattr(args, "deepspeed", None):
            raise ValueError(
                "SparsityTrainerCallback does not support DeepSpeed (its engine "
                "clips gradients before the mask update); train without --deepspeed"
            )
        # Checked and read before anything changes.
        horizon = state.max_steps if state.max_steps and state.max_steps > 0 else args.max_steps
        if horizon and horizon > 0:
            self.sparsity.check_range(horizon)
        saved = self._load_checkpoint(args, state) if state.global_step > 0 else None
        if self.sparsity.root is None:
            self._apply_model(model, saved)
        elif self.sparsity.root is not model:
            raise RuntimeError(
                "the sparsity algorithm is applied to another model; give every "
                "Trainer its own algorithm object"
            )
        elif saved is not None:
            self._restore(model, saved)
        inner = _torch_optimizer(optimizer)
        # The callback calls before_step itself, after the last backward (not the pre-hook).
        self.sparsity.step_driver = "transformers.Trainer"
        self.sparsity.check_finite = bool(args.fp16)  # a step the scaler skips updates nothing
        for stale in [o for o in self.sparsity.optimizers if o is not inner]:
            self.sparsity.detach_optimizer(stale)  # a previous train()'s optimizer
        if all(o is not inner for o in self.sparsity.optimizers):
            self.sparsity.apply(inner)
        self._optimizer = inner
        if args.max_grad_norm and args.max_grad_norm > 0:
            self.max_grad_norm, args.max_grad_norm = float(args.max_grad_norm), 0.0

    def _apply_model(self, model: nn.Module, saved: dict[str, Any] | None) -> None:
        """``apply(model)``; on resume the checkpoint's masks and weights replace the initial
        ones (apply prunes by the initial mask, so the loaded weights are kept aside first)."""
        names = _saved_shapes(saved) if saved is not None else {}
        if saved is not None:
            self._check(model, saved)
        kept = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
        self.sparsity.apply(model)
        if saved is None:
            return
        try:
            self._restore(model, saved, kept)
        except BaseException:
            self.sparsity.remove()
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name in kept:
                        param.copy_(kept[name])
            raise

    def _check(self, model: nn.Module, saved: dict[str, Any]) -> None:
        """Raise, before ``apply``, unless the checkpoint's masks are for the parameters this
        algorithm selects, with their shapes, and its state fits the algorithm's settings."""
        if isinstance(self.sparsity, Group):
            chosen = [c for member in self.sparsity.route(model) for c in member]
            states = saved["algorithm"].get("groups", [])
            if len(states) != len(self.sparsity):
                raise ValueError(
                    f"the checkpoint holds {len(states)} sparsity group(s), this "
                    f"Group has {len(self.sparsity)}; resume with the same Group"
                )
            for algorithm, state in zip(self.sparsity, states, strict=True):
                algorithm.check_state_dict(state)
        else:
            chosen = self.sparsity.select(model)
            self.sparsity.check_state_dict(saved["algorithm"])
        ours = {name: tuple(param.shape) for name, _, _, param in chosen}
        theirs = _saved_shapes(saved)
        if ours != theirs:
            differ = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
            raise ValueError(
                f"the checkpoint's masks differ from the parameters this algorithm sparsifies "
                f"(names or shapes of {differ[:3]}); resume with the model and param_filter "
                "that wrote it"
            )

    def _restore(
        self,
        model: nn.Module,
        saved: dict[str, Any],
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The algorithm state (masks, step, last update, ITOP masks), then ``weights`` through
        ``model.load_state_dict``, whose hooks prune them (and take an earlier version's bool
        masks, which come as ``<param>_mask`` entries)."""
        if set(self.sparsity.sparse_params) != set(_saved_shapes(saved)):
            raise ValueError(
                "the checkpoint's masks are for other parameters than this "
                "algorithm sparsifies; resume with the param_filter that wrote it"
            )
        self.sparsity.load_state_dict(saved["algorithm"])
        entries = {f"{name}_mask": mask for name, mask in saved.get("masks", {}).items()}
        entries.update(weights or {})
        if not entries:
            return
        result = model.load_state_dict(entries, strict=False)
        if result.unexpected_keys:
            raise ValueError(
                f"checkpoint sparsity entries {result.unexpected_keys[:3]} match no "
                "parameter of the model; resume with the model that wrote them"
            )

    def _load_checkpoint(self, args: TrainingArguments, state: TrainerState) -> dict[str, Any]:
        """The ``sparsity_state.pt`` of the checkpoint the Trainer resumed from: in
        ``args.resume_from_checkpoint`` if set, else ``<output_dir>/checkpoint-<global step>``
        (``resume_from_checkpoint=True`` or a path in the output directory)."""
        folder = args.resume_from_checkpoint or os.path.join(
            _output_dir(args), f"checkpoint-{state.global_step}"
        )
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"resuming at step {state.global_step} but {path} does not exist; checkpoints "
                "need SparsityTrainerCallback when saved, and a checkpoint outside output_dir "
                "needs TrainingArguments(resume_from_checkpoint=<its path>) too"
            )
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("global_step") != state.global_step:
            raise ValueError(
                f"{path} was saved at step {saved.get('global_step')} but the Trainer resumes at "
                f"step {state.global_step}; set TrainingArguments(resume_from_checkpoint=...) "
                "to the folder trainer.train(resume_from_checkpoint=...) gets"
            )
        return saved

    # ------------------------------------------------------------------ 2. each step
    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Update masks and prune (`before_step`), then clip the masked gradients."""
        if self._optimizer is None:
            return
        self.sparsity.before_step(self._optimizer)
        if self.max_grad_norm > 0:
            # Under fp16 the Trainer has unscaled the gradients already (it measures their norm
            # before this hook even with max_grad_norm 0).
            params = [p for group in self._optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Give the clipping back to the TrainingArguments."""
        if self.max_grad_norm > 0:
            args.max_grad_norm, self.max_grad_norm = self.max_grad_norm, 0.0

    # ------------------------------------------------------------------ 3. checkpoints
    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Write the algorithm state (masks included) next to the Trainer's checkpoint files."""
        if not state.is_world_process_zero or self.sparsity.root is None:
            return
        folder = os.path.join(_output_dir(args), f"checkpoint-{state.global_step}")
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"the Trainer saved no {folder} (hyper-parameter search runs "
                "save elsewhere, which SparsityTrainerCallback does not support)"
            )
        payload = {"global_step": state.global_step, "algorithm": self.sparsity.state_dict()}
        torch.save(payload, os.path.join(folder, STATE_FILE))


def _saved_shapes(saved: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of the masks in a ``sparsity_state.pt``: the algorithm
    state's parameters (a `Group`'s members' together), or an earlier version's bool masks."""
    earlier = legacy.hf_bool_mask_shapes(saved)
    if earlier is not None:
        return earlier
    states = saved["algorithm"].get("groups", [saved["algorithm"]])
    return {name: tuple(shape) for s in states for name, shape in s.get("params", {}).items()}


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers (Accelerate's ``AcceleratedOptimizer``), whose step
    hooks run when the wrapper steps."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def _output_dir(args: TrainingArguments) -> str:
    """``args.output_dir``, which ``TrainingArguments`` fills in when not given."""
    if args.output_dir is None:
        raise ValueError(
            "TrainingArguments.output_dir is None: SparsityTrainerCallback saves its state in "
            "the Trainer's checkpoint folders; pass output_dir="
        )
    return args.output_dir
