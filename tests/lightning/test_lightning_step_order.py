"""Lightning and plain PyTorch take the same optimizer step after a mask update.

Lightning's automatic optimization calls ``optimizer.step(closure)``: the optimizer's step
pre-hooks run *before* the closure (forward, backward, ``on_before_optimizer_step``). So the mask
update the callback makes in ``on_before_optimizer_step`` must itself prune the gradients and the
optimizer state, or the optimizer math of that step sees RigL's dense gradient at pruned positions.
AdamW's update is elementwise, so the weights come out the same anyway; Adafactor's factored
second moments (row and column means of ``grad**2``) are not, which exposes the difference.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import trainer
from tests.scripts import lightning_ddp as setup

STEPS = 3  # the RigL update (every 2 steps) runs inside the 3rd optimizer step


class AdafactorRegressor(setup.Regressor):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(self.parameters(), lr=1e-2)


def test_lightning_update_step_equals_plain_pytorch_with_adafactor() -> None:
    lit_algorithm, lit = setup.make_algorithm("rigl"), AdafactorRegressor()
    trainer(max_steps=STEPS, callbacks=[lit_algorithm]).fit(lit)

    algorithm, model = setup.make_algorithm("rigl"), AdafactorRegressor()
    model.apply(algorithm)
    optimizer = model.configure_optimizers()
    algorithm.apply(optimizer)
    x, y = setup.dataset().tensors
    batch = setup.GLOBAL_BATCH
    for step in range(STEPS):
        rows = slice(step * batch, (step + 1) * batch)
        loss = nn.functional.mse_loss(model.net(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    assert lit_algorithm.step == algorithm.step == STEPS
    for name, sp in algorithm.sparse_params.items():
        assert torch.equal(lit_algorithm.sparse_params[name].mask, sp.mask), name
    for (name, p), q in zip(model.named_parameters(), lit.parameters(), strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-12, rtol=0, msg=name)
