"""Masks left out of DDP's buffer broadcast: they are the same on every rank without it.

``DistributedDataParallel`` (``broadcast_buffers=True``, its default) sends every buffer of the
module it wraps from rank 0 to the others before each forward (``_sync_buffers``). The masks
(``<param>_mask``) and ITOP's ever-active sets (``<param>_ever_active``) are bool buffers, so that
is 2 bytes per masked weight per forward (a ring all-reduce of its fp32 gradient moves about 8),
for tensors every rank already holds: randomness comes from ``(seed, step, name)``, ties break to
the lower index, and updates read weights and all-reduced gradients that DDP keeps equal.

So when an algorithm is applied (`MaskState.commit`), their names go into DDP's list of
names to ignore, ``root._ddp_params_and_buffers_to_ignore``, set through DDP's own
``_set_params_and_buffers_to_ignore_for_model``, after any names already there; ``remove()``
takes out only the names it added. DDP reads the list once, when it is built (torch 2.13,
``DistributedDataParallel.__init__``: ``parameters_to_ignore``), and leaves those names out of
its construction-time sync and of every forward's broadcast. The names are full dotted names
below ``root``, as ``root.named_buffers()`` gives them, so:

- apply the algorithm to the module you wrap (plain PyTorch: ``sparsity.apply(model)``, then
  ``DistributedDataParallel(model)``; Lightning's ``"ddp"`` strategies wrap the LightningModule,
  which the callback's ``setup`` sparsified before);
- a mask registered again later (a ``to_empty``, a ``.to()`` or a load that the per-step path
  follows) keeps its name, so it stays left out: DDP filters the buffers by name at every forward;
- a model wrapped in DDP *before* the algorithm is applied (the ``transformers.Trainer`` path) is
  as before: DDP has read its list already. It collects the buffers again at each forward only if
  the model had a buffer when it was wrapped (BatchNorm statistics, a rotary table); then the
  masks are broadcast at every forward, else never.

The one case where the masks are not the same on every rank is at ``apply``, when the initial
masks read weights that differ between ranks (``init_method="topk"`` on a model each rank
initialised with its own seed): DDP's sync at construction then hands every rank rank 0's masks
and weights (unless ``broadcast_buffers=False``: it never syncs buffers). So under
``torch.distributed`` the ranks first compare their masks (a digest each, one
``all_gather_object``; every rank must apply, as the seed broadcast of ``seed=None`` already
needs) and the names go on the list only where all ranks agree; otherwise DDP keeps broadcasting
them, as before, and rank 0 logs a warning naming the fix. A mask sharded by FSDP2 (a ``DTensor``)
is decided on the gathered tensor, identically everywhere (`sharding`), and not compared.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .bitpack import pack_bits
from .sharding import is_sharded
from .sparse_parameter import SparseParameter

__all__ = ["IGNORE_ATTR", "buffer_names", "ignore_masks", "restore_ignored", "same_on_every_rank"]

log = logging.getLogger("lightning_sparse")

IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"  # what DistributedDataParallel reads

# root -> {owner: the names that owner added to root's list}, so `restore_ignored` takes out
# only those (not a user's, not another algorithm's).
_ADDED: weakref.WeakKeyDictionary[nn.Module, dict[str, list[str]]] = weakref.WeakKeyDictionary()


def buffer_names(root: nn.Module, sps: Iterable[SparseParameter]) -> list[str]:
    """Full dotted names below ``root`` of the mask and ever-active buffers of ``sps``, as
    ``root.named_buffers()`` (what DDP filters) names them; a module reachable twice under its
    first name, as there."""
    wanted: dict[int, list[str]] = {}
    for sp in sps:
        own = wanted.setdefault(id(sp.module), [])
        own += [b for b in (sp.mask_name, sp.ever_name) if b in sp.module._buffers]
    return [
        f"{path}.{buffer}" if path else buffer
        for path, module in root.named_modules()
        for buffer in wanted.get(id(module), ())
    ]


def same_on_every_rank(masks: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether every rank of the default process group holds these ``(name, mask)`` pairs, the
    same names, shapes and values (sharded and meta masks left out; True without
    ``torch.distributed``). Collective: every rank must call it. Costs one host copy of the
    packed masks (1 bit per element) and one ``all_gather_object`` of a 32-byte digest."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return True
    digest = hashlib.sha256()
    for name, mask in masks:
        if is_sharded(mask) or mask.is_meta:
            continue
        packed = pack_bits(mask)
        raw = bytearray(packed.numel())
        if raw:  # `torch.frombuffer` refuses an empty buffer
            torch.frombuffer(raw, dtype=torch.uint8).copy_(packed)
        digest.update(f"{name}{tuple(mask.shape)}".encode())
        digest.update(raw)
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digest.digest())
    return all(d == gathered[0] for d in gathered)


def ignore_masks(root: nn.Module, owner: str, sps: Sequence[SparseParameter]) -> list[str]:
    """Add the mask and ever-active buffer names of ``sps`` (`buffer_names`) to ``root``'s DDP
    ignore list, after the names already there, if every rank holds the same masks
    (`same_on_every_rank`, collective); remembered under ``owner`` for `restore_ignored`.

    Returns:
        The names added (none already listed; empty when the ranks' masks differ).
    """
    if not same_on_every_rank([(sp.name, sp.mask) for sp in sps]):
        if torch.distributed.get_rank() == 0:
            log.warning(
                "%s: the masks differ between ranks (an init method or distribution that "
                "reads weights the ranks initialised differently, or different models), so they "
                "stay in DDP's buffer broadcast, which makes them rank 0's (unless DDP is built "
                "with broadcast_buffers=False: then each rank trains its own); give every rank "
                "the same weights before apply (the same torch seed, or load them)",
                owner,
            )
        return []
    listed = list(getattr(root, IGNORE_ATTR, ()))
    added = [name for name in buffer_names(root, sps) if name not in listed]
    if added:
        _ADDED.setdefault(root, {})[owner] = added
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(root, listed + added)
    return added


def restore_ignored(root: nn.Module | None, owner: str) -> None:
    """Take the names `ignore_masks` added for ``owner`` out of ``root``'s DDP ignore list again;
    the attribute goes when nothing is left in it (DDP reads a missing list as empty)."""
    if root is None:
        return
    added = set(_ADDED.get(root, {}).pop(owner, []))
    if not added:
        return
    kept = [name for name in getattr(root, IGNORE_ATTR, ()) if name not in added]
    if kept:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(root, kept)
    elif hasattr(root, IGNORE_ATTR):
        delattr(root, IGNORE_ATTR)
