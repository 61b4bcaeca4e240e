"""The torch.compile baseline compiles the whole model as a user would, tables left to eager.

benchmarks/e2e.py and benchmarks/zoo.py compare gemc with this baseline; compiling only the
plan's dense regions (the old way) left every op outside them in eager and flattered gemc.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gemc.backends.torch.reference import ReferenceTrainer  # noqa: E402

from gemc.api import load_model  # noqa: E402


@pytest.mark.parametrize("model", ["din", "sasrec_bst"])
def test_whole_model_compile_trains_like_eager(model: str) -> None:
    compiled_calls: list[torch.nn.Module] = []

    def compile_fn(m: torch.nn.Module):  # noqa: ANN202
        compiled_calls.append(m)
        return torch.compile(m, backend="aot_eager")

    losses = []
    for fn in (None, compile_fn):
        spec = load_model(f"{REPO}/examples/zoo/{model}.py:build", {"preset": "tiny"},
                          device="meta")
        trainer = ReferenceTrainer(spec, seed=0, compile_fn=fn)
        losses.append(torch.tensor([trainer.step(s) for s in range(3)]))
        if fn is not None:
            # the whole model was handed to torch.compile, and every table still trains on
            # sparse row gradients (eager lookups inside the compiled forward)
            assert compiled_calls == [spec.model]
            assert trainer.tables and all(t.weight.grad is None or t.weight.grad.is_sparse
                                          for t in trainer.tables.values())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
