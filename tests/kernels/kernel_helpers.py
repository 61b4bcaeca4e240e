"""Shared helpers of the kernel tests: fresh random generators, jagged batches, tolerances."""

from __future__ import annotations

import os
import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# The interpreter runs a kernel in about a second; keep the example counts small by default
# (GEMC_KERNEL_EXAMPLES=200 for a soak run).
KERNEL_SETTINGS = settings(
    max_examples=int(os.environ.get("GEMC_KERNEL_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)

SEEDS = st.integers(min_value=0, max_value=2**31 - 1)


def fresh_generator() -> torch.Generator:
    """A CPU generator with a new seed per call, printed so a failure can be replayed.

    Tests draw on the CPU with it and move the result to the test device (``randn`` does).
    """
    seed = random.SystemRandom().randrange(2**31)
    print(f"torch generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


def offsets_of(lengths: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as a tensor of ``dtype``."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)  # on the default device (the test device)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32,
          requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen, device="cpu").to(torch.get_default_device(), dtype)
    return x.requires_grad_(requires_grad)


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances: fp32 tight; bf16 a few units of its 8-bit mantissa."""
    if dtype == torch.bfloat16:
        return {"atol": 3e-2, "rtol": 3e-2}
    return {"atol": 2e-5, "rtol": 2e-5}


def silu_padded_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          bias: torch.Tensor | None, g: torch.Tensor, offsets: torch.Tensor,
                          max_len: int, causal: bool) -> list[torch.Tensor]:
    """HSTU's pointwise attention as the padded formula in fp32, the SiLU kernels' reference:
    out, dq, dk, dv (q-shaped ``[B, L, H, D]``) and, with a bias, its gradient in the bias's
    own shape; scale ``D ** -0.5``, normaliser ``max_len``, padding keys and queries masked."""
    from gemc.backends.triton import jagged_to_padded

    lengths = offsets[1:] - offsets[:-1]
    pos = torch.arange(max_len)
    real = pos[None, :] < lengths[:, None]
    visible = real[:, None, :] & real[:, :, None]
    if causal:
        visible = visible & (pos[:, None] >= pos[None, :])
    x = [jagged_to_padded(t, offsets, max_len).float().transpose(1, 2).requires_grad_()
         for t in (q, k, v)]
    b = bias.float().requires_grad_() if bias is not None else None
    s = q.shape[-1] ** -0.5 * x[0] @ x[1].transpose(-1, -2) + (b if b is not None else 0.0)
    out = (torch.nn.functional.silu(s) * visible[:, None] / max_len) @ x[2]
    gp = jagged_to_padded(g, offsets, max_len).float().transpose(1, 2)
    grads = torch.autograd.grad(out, (*x, b) if b is not None else x, gp)
    return [t.transpose(1, 2) for t in (out, *grads[:3])] + list(grads[3:])


def nan_buffers(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """``uncovered_rows.uninitialised`` with every element of its storage NaN: a test
    patches it in to see that the kernels write every element of their outputs."""
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,)).fill_(float("nan"))
    return t


def as_jit_kernels(module: object, monkeypatch: object) -> None:
    """Every interpreted Triton kernel of ``module`` re-wrapped as a JIT function (what a
    GPU registers), for a trace that must see ``triton_op`` launches on a CPU machine."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, value in list(vars(module).items()):
        if isinstance(value, InterpretedFunction):
            monkeypatch.setattr(module, name, JITFunction(value.fn))  # type: ignore[attr-defined]


class _Traced(Exception):
    """Raised instead of running the captured graph: the JIT kernels cannot run here."""


def forward_graph_targets(fn: object, *args: torch.Tensor,
                          dynamic: tuple[int, ...] = ()) -> list[str]:
    """The call targets of AOTAutograd's forward graph of ``fn(*args)`` under
    ``torch.compile`` (fullgraph), captured and never run; ``dynamic``: dim 0 of those
    arguments marked dynamic."""
    import pytest
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _: object):  # noqa: ANN202
        graphs.append(gm)

        def run(*_args: object) -> None:
            raise _Traced

        return run

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True)
    for i in dynamic:
        torch._dynamo.mark_dynamic(args[i], 0)
    with pytest.raises(_Traced):
        compiled(*args)
    torch._dynamo.reset()
    (graph,) = graphs
    return [getattr(n.target, "__name__", str(n.target)) for n in graph.graph.nodes
            if n.op == "call_function"]
