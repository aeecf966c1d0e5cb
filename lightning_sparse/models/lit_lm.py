"""`LitCausalLM`: next-token language-model training as a LightningModule.

The constructor takes flat typed arguments (the fields of `LlamaConfig` plus optimiser settings),
so LightningCLI can configure it from YAML and checkpoints hold only plain Python values.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_sparse.core.materialize import materialize, placeholders_for_meta
from lightning_sparse.lightning.clipping import clip_gradients
from lightning_sparse.lightning.loading import restore_checkpoint_masks
from lightning_sparse.models.llama import Llama, LlamaConfig, generate

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig


LLAMA_ARGS = (
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len",
    "rope_theta", "norm_eps", "tie_embeddings",
)  # fmt: skip
"""The `LlamaConfig` fields `LitCausalLM` takes as arguments (its hyper-parameters)."""


def llama_config(args: Mapping[str, Any]) -> LlamaConfig:
    """The default model's config from `LitCausalLM`'s arguments or saved hyper-parameters
    (missing ones take `LlamaConfig`'s defaults)."""
    return LlamaConfig(**{k: args[k] for k in LLAMA_ARGS if k in args})


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over `warmup_steps`, then cosine decay to `min_lr_ratio`.

    `step` counts completed optimizer steps, so step 0 already trains at 1 / warmup_steps.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LitCausalLM(L.LightningModule):
    """Trains a causal language model on batches of token windows.

    Batches are LongTensor [B, T + 1]: inputs are the first T tokens, targets the last T.

    Args:
        model: Any module mapping token ids [B, T] to logits [B, T, V]; when given, the model
            arguments below (`vocab_size` ... `tie_embeddings`) are ignored except
            `max_seq_len`, which crops the context in `predict_step`. Default: a `Llama` built
            from those arguments.
        vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_hidden, max_seq_len, rope_theta,
            norm_eps, tie_embeddings: Fields of `LlamaConfig`.
        lr: Peak learning rate of AdamW.
        weight_decay: Decoupled weight decay for matrices (not norms, embeddings or biases).
        betas: AdamW betas.
        warmup_steps: Steps of linear warmup.
        max_steps: Length of the cosine schedule; `None` uses the trainer's
            `estimated_stepping_batches`.
        min_lr_ratio: Final learning rate as a fraction of `lr`.
        max_new_tokens, temperature, top_k: Sampling settings of `predict_step`.
        build_sparse: Build the default `Llama` on the meta device, so that its dense weights
            never exist: a sparsity callback applied to it draws its masks as each layer is
            made, and ``accelerator="wse"`` makes it one module at a time, each masked layer
            compact (`lightning_sparse.wse.materialize`), which trains models whose dense
            weights do not fit in memory. Another accelerator makes it whole, pruned, in
            `configure_model`. The initial values are `init_tensor`'s, the same for a given
            seed as a dense build on the meta device (`Llama.reset_parameters` after
            ``to_empty``), not as ``Llama(cfg)`` on the CPU (whose layers draw their own
            default init first).
    """

    if TYPE_CHECKING:
        # save_hyperparameters() makes hparams an AttributeDict (read as hp.lr); Lightning
        # declares the wider MutableMapping.
        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(
        self,
        model: nn.Module | None = None,
        vocab_size: int = 256,
        dim: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        ffn_hidden: int | None = None,
        max_seq_len: int = 256,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        tie_embeddings: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        build_sparse: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        if model is not None and build_sparse:
            raise ValueError(
                "build_sparse=True builds the default Llama on the meta device; with a model of "
                "your own, build it under torch.device('meta') yourself and give this module an "
                "init_tensor(name, tensor) method"
            )
        if model is None:
            with torch.device("meta") if build_sparse else contextlib.nullcontext():
                model = Llama(llama_config(locals()))
        self.model = model
        self.val_loss = MeanMetric()

    def init_tensor(self, name: str, t: Tensor) -> None:
        """Initialise this module's parameter or buffer ``name`` in place, as a dense build
        does (`Llama.init_tensor`): what `lightning_sparse.wse.materialize` calls for a model
        built sparse."""
        if not name.startswith("model.") or not isinstance(self.model, Llama):
            raise ValueError(
                f"init_tensor knows the default Llama's tensors (model.*), not {name!r}"
            )
        self.model.init_tensor(name.removeprefix("model."), t)

    def configure_model(self) -> None:
        """A model built sparse (``build_sparse``) is made here, before Lightning loads a
        checkpoint into it: by an accelerator that makes it itself (``"wse"``: one layer at a
        time, each masked layer compact), else whole, pruned (`core.materialize`)."""
        if not any(t.is_meta for t in [*self.parameters(), *self.buffers()]):
            return
        make = getattr(self.trainer.accelerator, "materialize", None)
        if callable(make):
            make(self.trainer, self.init_tensor)
        else:
            materialize(self, self.init_tensor, [])

    def configure_callbacks(self) -> list[L.Callback]:
        """Built sparse: `_LeftOnMeta`, so a run refused before the model is made ends with its
        refusal."""
        return [_LeftOnMeta()] if self.hparams.get("build_sparse") else []

    def forward(self, idx: Tensor) -> Tensor:
        """idx: [B, T] -> logits [B, T, V]."""
        return self.model(idx)

    def loss(self, batch: Tensor) -> Tensor:
        """Mean next-token cross-entropy of batch [B, T + 1], computed in float32."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        # A true 16-bit precision (``bf16-true``) casts the whole module to its dtype, metric
        # states included: a bfloat16 sum of token-weighted losses keeps about 3 digits.
        self.val_loss.set_dtype(torch.float32)

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        loss = self.loss(batch)
        # Weight by token count so the epoch mean is per token even with a short last batch.
        self.val_loss.update(loss, weight=batch[:, 1:].numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # already reduced across ranks by torchmetrics
        # Identical on every rank, so the mean over ranks sync_dist takes is the same value; it
        # only tells Lightning the epoch-level value is synchronised (no DDP warning).
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", loss.exp(), sync_dist=True)
        self.val_loss.reset()

    # Test: the validation loss's computation on the data module's test split (the held-out
    # windows after the validation ones), logged as test/loss and test/ppl. The accumulator is
    # the validation one: validation and test never run at the same time.
    def on_test_epoch_start(self) -> None:
        self.val_loss.reset()
        self.val_loss.set_dtype(torch.float32)  # a bf16-true module casts metric states too

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self.val_loss.update(self.loss(batch), weight=batch[:, 1:].numel())

    def on_test_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log("test/loss", loss, sync_dist=True)
        self.log("test/ppl", loss.exp(), sync_dist=True)
        self.val_loss.reset()

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Continues prompts [B, T] -> [B, T + max_new_tokens]."""
        prompt = batch[0] if isinstance(batch, (tuple, list)) else batch
        hp = self.hparams
        return generate(
            self.model, prompt, hp.max_new_tokens, hp.max_seq_len, hp.temperature, hp.top_k
        )

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Register the sparse checkpoint's masks before Lightning loads its ``state_dict``, so a
        module loaded with ``load_from_checkpoint`` or ``ckpt_path=`` without a sparsity callback
        carries them (for the device, reports, export), and checkpoints of earlier versions
        (``*_mask`` entries) load (a callback in the Trainer has applied its algorithm already,
        which then restores the masks itself). A module built sparse and loaded outside a fit
        is made whole first, and a checkpoint's sparse CSR weights (a model built sparse wrote
        them) are made dense for layers that do not load them compact."""
        if any(t.is_meta for t in [*self.parameters(), *self.buffers()]):
            # Built sparse and loaded outside a fit (load_from_checkpoint, export, generate):
            # made whole first, the checkpoint's values then load into it.
            materialize(self, self.init_tensor, [])
        restore_checkpoint_masks(self, checkpoint)
        _dense_where_needed(self, checkpoint.get("state_dict"))

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip as the Trainer says, under mixed precision too: Lightning's own clipping refuses
        the fused AdamW there (`lightning_sparse.lightning.clipping`)."""
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """AdamW with decay on matrices only, and a per-step warmup-cosine LambdaLR."""
        hp = self.hparams
        embeddings = {id(m.weight) for m in self.model.modules() if isinstance(m, nn.Embedding)}
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for p in self.model.parameters():  # shared (tied) tensors appear once
            if not p.requires_grad:
                continue
            (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.lr,
            betas=tuple(hp.betas),
            # The fused kernel is faster on the CPU, and unlike the foreach path it does not slow
            # down on the exact zeros that pruned positions keep in exp_avg_sq (MKL's sqrt does;
            # benchmarks/README.md, "Figures behind the code").
            fused=all(type(p) is nn.Parameter and p.device.type in ("cpu", "cuda") for p in decay),
        )
        max_steps = hp.max_steps or int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, hp.warmup_steps, max_steps, hp.min_lr_ratio),
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class _LeftOnMeta(L.Callback):
    """A run that fails before its module built sparse is made (a configuration the device
    refuses): the tensors still on the meta device get stand-ins without storage
    (`placeholders_for_meta`), so Lightning's teardown can move the module to the CPU and the
    error the user sees is the refusal, not that move."""

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        placeholders_for_meta(pl_module)


def _dense_where_needed(module: nn.Module, state_dict: dict | None) -> None:
    """A checkpoint of a model built sparse holds its masked weights as sparse CSR tensors;
    each is made dense, in ``state_dict``, for a layer that does not load one itself (a device
    layer declares ``loads_sparse_csr``): any model loads such a checkpoint."""
    if not state_dict:
        return
    modules = dict(module.named_modules())
    for key, value in list(state_dict.items()):
        if torch.is_tensor(value) and value.layout == torch.sparse_csr:
            owner = modules.get(key.rpartition(".")[0])
            if not getattr(owner, "loads_sparse_csr", False):
                state_dict[key] = value.to_dense()
