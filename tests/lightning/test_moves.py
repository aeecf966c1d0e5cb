"""Nothing of a run stays behind when Lightning moves the module after ``fit``.

Lightning moves the module back to the CPU when ``fit`` ends, and no optimizer step follows:
whatever the sparsity callback kept of the run's device (old masks, their copies, the last
update's figures) would stay there until the callback is freed, run after run in a sweep or a
test session. The move here is to the ``meta`` device, which the CPU can emulate.
"""

from __future__ import annotations

import pytest

from benchmarks.held import held_tensors
from lightning_sparse import GMP, SET, RigL, Static
from tests.helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.lightning.test_amp import TinyModule, fit

CALLBACKS = {
    "static": lambda: Static(0.5, seed=0),
    "set": lambda: SET(0.5, update={"freq": 2}, seed=0),
    "rigl": lambda: RigL(0.5, update={"freq": 2}, seed=0),
    "gmp": lambda: GMP(
        {"type": "cubic", "init": 0.0, "final": 0.5, "begin": 0, "end": 4}, update={"freq": 2}
    ),
}


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_after_fit_a_move_leaves_nothing_of_the_run_behind(name: str) -> None:
    module = TinyModule()
    callback = CALLBACKS[name]()
    fit(module, callback, max_steps=5)
    assert callback.step == 5
    module.to("meta")
    left = [f"{w}: {t.device}" for w, t in held_tensors(callback) if t.device.type != "meta"]
    assert left == [], left
    for sp in callback.sparse_params.values():
        assert sp.mask.is_meta
