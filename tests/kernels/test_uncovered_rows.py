"""The attention's outputs are never zero-filled first (``jagged_attention.written_rows``):
the kernels store every row a sequence covers and ``zero_uncovered_rows`` zeroes the others.

Intent: ``zero_uncovered_rows`` touches only the uncovered rows (a covered row keeps what was
there), in both layouts. Numbers: with every uninitialised buffer NaN, the softmax and silu
attentions over packed values with spare slots past ``offsets[-1]`` (the packed token
regions' buffers), forward and backward, equal the reference and are exactly zero in the
spare slots."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gemc.backends.triton import jagged_attention
from gemc.backends.triton.jagged_attention import jagged_attention_reference
from gemc.backends.triton.uncovered_rows import zero_uncovered_rows
from kernel_helpers import fresh_generator, nan_buffers

from tests.hopper_target import HOPPER_DRIVER

kernel = importlib.import_module("gemc.backends.triton.jagged_attention")
REPO = Path(__file__).resolve().parents[2]


def test_only_rows_outside_the_sequences_are_zeroed():
    """Packed layout: rows before ``offsets[0]`` and from ``offsets[-1]`` on; three buffers
    of one launch, fp32 and bf16 alike."""
    offsets = torch.tensor([2, 5, 5, 9])
    bufs = [torch.full((12, 2, 3), 7.0), torch.full((12, 2, 3), 7.0),
            torch.full((12, 2, 3), 7.0, dtype=torch.bfloat16)]
    zero_uncovered_rows(bufs, offsets)
    covered = torch.zeros(12, dtype=torch.bool)
    covered[2:9] = True
    for b in bufs:
        assert (b[covered] == 7).all() and (b[~covered] == 0).all()


def test_padded_layout_zeroes_each_rows_tail_and_rows_past_the_batch():
    """Padded ``[B, pad_len]`` layout: row ``b``'s positions from its length (clamped to
    ``pad_len``) on, and every row past ``B * pad_len``; lengths 0, full, longer than the
    pad, ragged."""
    pad, lengths = 4, [0, 4, 6, 3]
    offsets = torch.tensor([0, 0, 4, 10, 13])
    buf = torch.full((len(lengths) * pad + 3, 5), 7.0)
    zero_uncovered_rows([buf], offsets, pad_len=pad)
    for r in range(buf.shape[0]):
        b, pos = divmod(r, pad)
        kept = b < len(lengths) and pos < min(lengths[b], pad)
        assert (buf[r] == (7.0 if kept else 0.0)).all(), r


def test_rejects_buffers_of_different_shapes():
    with pytest.raises(ValueError, match="one shape"):
        zero_uncovered_rows([torch.zeros(3, 2), torch.zeros(4, 2)], torch.tensor([0, 3]))


@pytest.mark.parametrize("kind, causal", [("softmax", True), ("silu", False)])
def test_spare_slots_read_zero_and_the_rest_matches_the_reference(monkeypatch, kind, causal):
    """Values with 5 spare slots past ``offsets[-1]`` and every buffer NaN before the
    kernels run: out, dq, dk, dv equal the reference on the tokens and are exactly 0 in
    the spare slots (a stale slot would be NaN)."""
    monkeypatch.setattr(kernel, "uninitialised", nan_buffers)
    gen = fresh_generator()
    lengths, spare, heads, dim = [5, 0, 17, 9], 5, 2, 16
    offsets = torch.tensor([0, 5, 5, 22, 31])
    total = sum(lengths)
    q, k, v, g = (torch.randn(total + spare, heads, dim, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*leaves, offsets, 17, causal=causal, kind=kind)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [t[:total].clone().requires_grad_() for t in (q, k, v)]
    ref = jagged_attention_reference(*ref_leaves, offsets, 17, causal=causal, kind=kind)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g[:total])
    for got, want in zip((out.detach(), *grads), (ref.detach(), *ref_grads)):
        torch.testing.assert_close(got[:total], want, rtol=2e-5, atol=2e-5)
        assert torch.equal(got[total:], torch.zeros_like(got[total:]))


_HOPPER = HOPPER_DRIVER + textwrap.dedent("""
    import sys
    from gemc.backends.triton import warm as W
    from gemc.backends.triton.uncovered_rows import zero_uncovered_rows
    offsets = torch.empty(5, dtype=torch.int64, device="meta")
    with W.dry_launches() as launches:
        for pad_len in (0, 16):
            for count, dtype in ((1, torch.bfloat16), (3, torch.float32)):
                zero_uncovered_rows([torch.empty(64, 4, 128, dtype=dtype, device="meta")
                                     for _ in range(count)], offsets, pad_len)
    errors = [r for r in map(W.compile_launch, launches) if r["error"]]
    print(len(launches), "launches;", errors)
    sys.exit(1 if errors or len(launches) != 4 else 0)
""")


def test_the_kernel_compiles_for_hopper_in_both_layouts(tmp_path: Path) -> None:
    """The interpreter runs what the GPU compiler refuses (a run-time branch whose two arms
    give a variable different types: the first GPU run of this kernel failed so): each
    launch the attention makes (packed and padded layout, one buffer and three) compiles
    for sm_90, no GPU needed."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _HOPPER], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
