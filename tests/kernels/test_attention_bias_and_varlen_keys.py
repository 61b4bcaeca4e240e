"""The additive score bias of the jagged attention kernels (softmax and SiLU: forward, and
the gradients of q, k, v and the bias, for each way it broadcasts) and the varlen-key
kernel (dense queries over the first len_b padded keys), against padded PyTorch."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton.jagged import jagged_to_padded, padded_to_jagged
from gemc.backends.triton.jagged_attention import (
    bias_grad_buffer,
    bias_grad_sum,
    broadcast_bias,
    jagged_attention,
)
from gemc.backends.triton.varlen_key_attention import varlen_key_attention
from kernel_helpers import nan_buffers

from tests.hopper_target import HOPPER_DRIVER

jagged_attention_module = importlib.import_module("gemc.backends.triton.jagged_attention")
REPO = Path(__file__).resolve().parents[2]
B, H, L, D = 3, 2, 6, 4
LENGTHS = [2, 0, 6]


def _inputs(seed: int, m: int = L):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, m, D, generator=gen).requires_grad_()
    k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(2))
    keep = torch.arange(L)[None] < torch.tensor(LENGTHS)[:, None]
    return q, k, v, keep, gen


def _grads(out, inputs):
    return torch.autograd.grad(out.square().sum(), inputs)


@pytest.mark.parametrize("kind", ["softmax", "silu"])
@pytest.mark.parametrize("shape", [(L, L), (B, 1, L, L), (1, H, L, L)], ids=str)
def test_bias_matches_padded(kind: str, shape: tuple[int, ...]):
    q, k, v, keep, gen = _inputs(1)
    bias = torch.randn(*shape, generator=gen).requires_grad_()
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    total = int(offsets[-1])
    qj, kj, vj = (padded_to_jagged(x.transpose(1, 2), offsets, total) for x in (q, k, v))
    out = jagged_attention(qj, kj, vj, offsets, L, scale=0.5, causal=True, kind=kind,
                           bias=bias)
    got = jagged_to_padded(out, offsets, L).transpose(1, 2)
    visible = keep[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    s = 0.5 * q @ k.transpose(-1, -2) + bias
    if kind == "silu":
        ref = (F.silu(s) / L * visible) @ v
    else:
        ref = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num() @ v
    rows = keep[:, None, :, None].float()  # the kernel defines real query rows only
    torch.testing.assert_close(got * rows, ref * rows)
    for g, w in zip(_grads(got * rows, (q, k, v, bias)), _grads(ref * rows, (q, k, v, bias))):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_varlen_keys_match_masked_sdpa(m: int):
    q, k, v, keep, _ = _inputs(2, m)
    got = varlen_key_attention(q, k, v, keep.sum(1).to(torch.int32))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    torch.testing.assert_close(got, ref)
    for g, w in zip(_grads(got, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("shape, shared", [((L, L), True), ((B, 1, L, L), True),
                                           ((1, H, L, L), False)], ids=str)
def test_heads_add_into_one_gradient_block_where_the_bias_has_no_heads(shape, shared):
    """The gradient buffer is ``[B, 1, Lb, Lb]`` for a bias shared by the heads (they add
    into it with atomics, and autotuning zeroes it before each timed run) and per head
    otherwise; the gradients themselves are checked by ``test_bias_matches_padded``."""
    bias4 = broadcast_bias(torch.zeros(shape), B, H)
    meta, buffer, view = bias_grad_buffer(bias4, {"BIAS_GRAD": True, "BIAS_GRAD_ADD": False})
    assert meta["BIAS_GRAD_ADD"] is shared
    assert buffer.shape == (B, 1 if shared else H, L, L) and view.shape == (B, H, L, L)
    assert ("DBIAS" in jagged_attention_module._accumulated(meta, (), True)) is shared
    # a launch that does not write the bias's gradient never zeroes it
    assert "DBIAS" not in jagged_attention_module._accumulated(meta, (), False)
    assert bias_grad_sum(buffer, torch.zeros(shape)).shape == shape



@pytest.mark.parametrize("lengths, qlens", [
    ([3, 0, 70, 65], None),   # a key block wholly past a non-empty row's length
    ([3, 0, 70, 65], [2, 5, 0, 7]),   # padded queries too (jagged_query_attention's call)
    ([0, 0, 0, 0], None),
], ids=["keys", "keys-and-queries", "all-empty"])
def test_varlen_gradients_written_in_full_without_a_zero_fill(monkeypatch, lengths, qlens):
    """dq, dk and dv come uninitialised (here NaN) and the kernels write every element:
    zeros past each row's key length and on padding queries, the masked SDPA's gradients
    elsewhere (a stale element would be NaN)."""
    uncovered = importlib.import_module("gemc.backends.triton.uncovered_rows")
    monkeypatch.setattr(uncovered, "uninitialised", nan_buffers)
    gen = torch.Generator().manual_seed(7)
    n_keys, m = 70, 7
    q = torch.randn(len(lengths), H, m, D, generator=gen).requires_grad_()
    k, v = (torch.randn(len(lengths), H, n_keys, D, generator=gen).requires_grad_()
            for _ in range(2))
    klen = torch.tensor(lengths, dtype=torch.int32)
    qlen = None if qlens is None else torch.tensor(qlens, dtype=torch.int32)
    got = varlen_key_attention(q, k, v, klen, query_lengths=qlen)
    keep = torch.arange(n_keys)[None] < klen[:, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    rows = torch.ones(len(lengths), 1, m, 1) if qlen is None else \
        (torch.arange(m)[None] < qlen[:, None]).float()[:, None, :, None]
    torch.testing.assert_close(got, ref * rows)
    grads = _grads(got, (q, k, v))
    assert not any(g.isnan().any() for g in grads)
    for g, w in zip(grads, _grads(ref * rows, (q, k, v))):
        torch.testing.assert_close(g, w)


_HOPPER = HOPPER_DRIVER + textwrap.dedent("""
    import sys
    from gemc.backends.triton import warm as W
    from gemc.backends.triton.varlen_key_attention import attention_backward
    meta = dict(device="meta")
    q = torch.empty(4, 2, 8, 64, dtype=torch.bfloat16, **meta)
    k = torch.empty(4, 2, 100, 64, dtype=torch.bfloat16, **meta)
    lengths = torch.empty(4, dtype=torch.int32, **meta)
    lse = torch.empty(8, 8, dtype=torch.float32, **meta)
    with W.dry_launches() as launches:
        for qlen in (None, lengths):
            attention_backward(q, k, k, lengths, qlen, q, lse, q, 0.125)
    errors = [r for r in map(W.compile_launch, launches) if r["error"]]
    print(len(launches), "launches;", errors)
    sys.exit(1 if errors or len(launches) != 4 else 0)
""")


def test_varlen_backward_compiles_for_hopper(tmp_path: Path) -> None:
    """The key-block kernel's loop bound is a ``where`` of the row's lengths (no early
    return, so it stores the zeros past them): each backward launch, with and without
    padded queries, compiles for sm_90, no GPU needed."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _HOPPER], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
