"""Whether gemc's kernels can run in Triton's interpreter is what Triton was imported with,
not only what ``TRITON_INTERPRET`` says now (gemc.backends.triton.runtime)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.runner.harness import REPO

# torch.export imports Triton through torch._dynamo, before anything of gemc's can set the
# variable: the Python-API script that compiles a plan, then runs it on the CPU
_SCRIPT = """
import os, torch, torch._dynamo
assert os.environ.get("TRITON_INTERPRET") is None
from gemc.backends.triton import runtime
from gemc.backends.triton.masked_row_update import masked_row_update_
assert os.environ["TRITON_INTERPRET"] == "1" and not runtime.INTERPRETED
weight, grad = torch.ones(4, 8), torch.zeros(4, 8)
grad[1] = 1.0
state = {"sum": torch.zeros(4)}
masked_row_update_(weight, grad, state, optimizer="rowwise_adagrad", lr=0.1, eps=1e-8,
                   betas=(0.9, 0.999), weight_decay=0.0, step_size=0.0)
assert weight[1].lt(1).all() and weight[0].eq(1).all(), weight
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_triton_imported_before_the_variable_takes_the_aten_fallback() -> None:
    """The sparse optimizer's row update crashed there ("Cannot call @triton.jit'd outside
    of the scope of a kernel": an interpreted kernel calling Triton's compiled-mode
    helpers); the runtime now counts such kernels as not runnable, and the update takes
    its ATen fallback."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
