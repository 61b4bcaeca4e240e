"""The attention's outputs are never zero-filled first (``jagged_attention.written_rows``):
the kernel that stores a buffer's covered rows also stores zeros into the rows no sequence
covers (``_zero_uncovered``, one chunk of rows per program), so no launch of its own does.

Intent: with every uninitialised buffer NaN, out, dq, dk and dv equal the reference on the
rows the sequences cover and are exactly 0 on every other row, in both layouts: packed
values with rows before ``offsets[0]`` and spare slots past ``offsets[-1]`` (as many as
the grid reaches with ``max_len`` alone, and more: ``grid_rows``), and padded rows read in
place (a row's tail past its length, a length longer than the pad, rows past
``B * pad_len``); for the softmax's backward (two kernels, or one program per row:
``FUSED_SOFTMAX_SHORT_ROWS``) and every silu backward (key-block
or two-kernel, dq fused with atomics or from the dq kernel, the heads looped over a shared
bias). And each launch those paths make compiles for sm_90 (the interpreter accepts what
the GPU compiler refuses)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gemc.backends.triton import ops
from gemc.backends.triton.jagged import padded_to_jagged_reference
from gemc.backends.triton.jagged_attention import jagged_attention_reference
from kernel_helpers import fresh_generator, nan_buffers, silu_padded_reference

from tests.hopper_target import HOPPER_DRIVER

kernel = importlib.import_module("gemc.backends.triton.jagged_attention")
REPO = Path(__file__).resolve().parents[2]
H, D = 2, 16


def _layout(lengths: list[int], pad: int, layout: str, spare: int
            ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(the kernels' offsets, the covered rows in packed order, the buffer's rows, pad_len)
    of a batch whose clamped lengths are ``min(len, pad)``."""
    kept = [min(n, pad) for n in lengths]
    if layout == "packed":  # 3 rows before offsets[0], ``spare`` past offsets[-1]
        shift = 3
        offsets = torch.tensor([shift] + [shift + sum(kept[:i + 1]) for i in range(len(kept))])
        return offsets, torch.arange(shift, shift + sum(kept)), shift + sum(kept) + spare, 0
    ends = torch.tensor([0] + lengths).cumsum(0)  # unclamped: the kernels clamp
    rows = torch.cat([b * pad + torch.arange(n) for b, n in enumerate(kept)])
    return ends, rows, len(lengths) * pad + spare, pad


def _scatter(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """Packed ``x`` into a ``total``-row buffer at ``rows``; the other rows random (the
    kernels must never read them)."""
    out = torch.randn(total, *x.shape[1:])
    out[rows] = x
    return out


@pytest.mark.parametrize("kind, key_block, fused, bias", [
    ("softmax", False, False, False),  # two kernels
    ("softmax", False, True, False),   # one program per row (softmax_row_backward)
    ("silu", True, False, True),    # key-block backward, dq kernel, heads looped (bias)
    ("silu", True, True, False),    # key-block backward, dq fused (atomics)
    ("silu", False, False, False),  # two-kernel backward
    ("silu", False, True, True),    # two-kernel backward, dq fused, bias
])
@pytest.mark.parametrize("layout, spare", [("packed", 5), ("packed", 60), ("padded", 3)])
def test_uncovered_rows_read_zero_and_the_rest_matches_the_reference(
        monkeypatch, kind, key_block, fused, bias, layout, spare):
    """Every buffer NaN before the kernels run: the covered rows equal the reference, the
    others are exactly 0 (a row no program zeroed would be NaN). Lengths 0, ragged, the
    pad, and (padded) one longer than the pad; 60 spare slots need more programs than
    ``max_len`` gives (``grid_rows``)."""
    monkeypatch.setattr(kernel, "uninitialised", nan_buffers)
    monkeypatch.setattr(kernel, "SILU_KEY_BLOCK_BACKWARD", key_block)
    monkeypatch.setattr(kernel, "FUSED_SILU_BACKWARD", fused)
    monkeypatch.setattr(kernel, "FUSED_SOFTMAX_SHORT_ROWS", fused)
    gen = fresh_generator()
    pad, causal = 17, kind == "silu"
    lengths = [5, 0, 17, 9] if layout == "packed" else [5, 0, 20, 9]
    offsets, rows, total, pad_len = _layout(lengths, pad, layout, spare)
    kept = [min(n, pad) for n in lengths]
    packed_offsets = torch.tensor([0] + kept).cumsum(0)
    q, k, v, g = (torch.randn(sum(kept), H, D, generator=gen) for _ in range(4))
    b = (0.5 * torch.randn(len(lengths), 1, pad, pad, generator=gen)) if bias else None
    if kind == "silu":
        ref = silu_padded_reference(q, k, v, b, g, packed_offsets, pad, causal)
        want = [padded_to_jagged_reference(t, packed_offsets, sum(kept)) for t in ref[:4]]
    else:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = jagged_attention_reference(*leaves, packed_offsets, pad, causal=causal)
        want = [out.detach(), *torch.autograd.grad(out, leaves, g)]
    x = [_scatter(t, rows, total) for t in (q, k, v, g)]
    scale = D ** -0.5
    if kind == "silu":
        got = [ops._silu_forward(x[:3], offsets, b, pad, scale, causal, pad_len)]
        grads, dbias = ops._silu_grads(x[:3], x[3], offsets, b, pad, scale, causal,
                                       bias, pad_len)
        got += grads
        if bias:
            torch.testing.assert_close(dbias, ref[4], rtol=1e-4, atol=1e-4)
    else:
        meta = kernel._meta(x[0], causal, kind, "max_len", pad)
        assert meta["FUSED_DQ"] is fused
        out, lse = kernel._attention_forward(*x[:3], offsets, pad, scale, meta,
                                             pad_len=pad_len)
        got = [out, *kernel._attention_backward(*x[:3], out, lse, x[3], offsets, pad, scale,
                                                meta, pad_len=pad_len)]
    uncovered = torch.ones(total, dtype=torch.bool)
    uncovered[rows] = False
    assert uncovered.any()
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a[rows], w, rtol=1e-4, atol=1e-4, msg=name)
        assert torch.equal(a[uncovered], torch.zeros_like(a[uncovered])), name
    if kind == "softmax":  # the logsumexp [H, rows]: not zero-filled first either
        assert lse.isfinite()[:, rows].all()
        assert torch.equal(lse[:, uncovered], torch.zeros_like(lse[:, uncovered]))


@pytest.mark.parametrize("kind, causal", [("softmax", True), ("silu", False)])
def test_spare_slots_through_the_autograd_function(monkeypatch, kind, causal):
    """The public ``jagged_attention`` (its autograd Function) over values with 5 spare
    slots past ``offsets[-1]``: out, dq, dk, dv equal the reference on the tokens and are
    exactly 0 in the spare slots."""
    monkeypatch.setattr(kernel, "uninitialised", nan_buffers)
    gen = fresh_generator()
    spare = 5
    offsets = torch.tensor([0, 5, 5, 22, 31])
    total = 31
    q, k, v, g = (torch.randn(total + spare, H, D, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kernel.jagged_attention(*leaves, offsets, 17, causal=causal, kind=kind)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [t[:total].clone().requires_grad_() for t in (q, k, v)]
    ref = jagged_attention_reference(*ref_leaves, offsets, 17, causal=causal, kind=kind)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g[:total])
    for got, want in zip((out.detach(), *grads), (ref.detach(), *ref_grads)):
        torch.testing.assert_close(got[:total], want, rtol=2e-5, atol=2e-5)
        assert torch.equal(got[total:], torch.zeros_like(got[total:]))


@pytest.mark.parametrize("fused", [False, True])
def test_a_batch_whose_kernels_do_not_run_reads_zero(monkeypatch, fused):
    """``max_len == 0`` (every sequence empty): nothing launches, so the buffers are
    zeroed on the host instead (``written_rows(zeroed=True)``), not left NaN; the
    one-kernel softmax backward's dq too (its zeroed fp32 buffer, cast)."""
    monkeypatch.setattr(kernel, "uninitialised", nan_buffers)
    x = torch.randn(6, H, D)
    offsets = torch.zeros(3, dtype=torch.long)
    meta = {**kernel._meta(x, False, "softmax", "max_len", 0), "FUSED_DQ": fused}
    out, lse = kernel._attention_forward(x, x, x, offsets, 0, 1.0, meta)
    grads = kernel._attention_backward(x, x, x, out, lse, x, offsets, 0, 1.0, meta)
    for t in (out, lse, *grads):
        assert t.dtype == x.dtype and torch.equal(t, torch.zeros_like(t))


def test_grid_rows_reach_every_row():
    """The grid spans ``max_len`` rows a sequence unless the buffer has more rows than
    ``B * max_len``: then enough for ``B`` chunks per block row to reach them all."""
    assert kernel.grid_rows(8 * 64, 8, 64) == 64
    assert kernel.grid_rows(100, 8, 64) == 64
    assert kernel.grid_rows(8 * 64 + 1, 8, 64) == 65
    assert kernel.grid_rows(5, 0, 0) == 5


_HOPPER = HOPPER_DRIVER + textwrap.dedent("""
    import importlib, sys
    from gemc.backends.triton import ops, warm as W
    J = importlib.import_module("gemc.backends.triton.jagged_attention")
    B, L, H, D = 4, 16, 2, 128
    offsets = torch.empty(B + 1, dtype=torch.int64, device="meta")
    bias = torch.empty(B, 1, L, L, dtype=torch.bfloat16, device="meta")
    key_bias = torch.empty(B, L, dtype=torch.float32, device="meta")
    with W.dry_launches() as launches:
        for pad_len, spare in ((0, 5), (16, 0)):
            x = [torch.empty(B * L + spare, H, D, dtype=torch.bfloat16, device="meta")
                 for _ in range(3)]
            meta = J._meta(x[0], True, "softmax", "max_len", L)
            out, lse = J._attention_forward(*x, offsets, L, 0.1, meta, pad_len=pad_len)
            J._attention_backward(*x, out, lse, x[0], offsets, L, 0.1, meta,
                                  pad_len=pad_len)
            # a per-key bias (a region with padding representatives): KEY_BIAS's load
            kmeta, kbias = ops._values_meta(x[0], offsets, False, key_bias, L)
            out, lse = J._attention_forward(*x, offsets, L, 0.1, kmeta, bias=kbias,
                                            pad_len=pad_len)
            J._attention_backward(*x, out, lse, x[0], offsets, L, 0.1, kmeta, bias=kbias,
                                  pad_len=pad_len)
            for key_block, fused, b in ((True, False, bias), (True, True, None),
                                        (False, False, None), (False, True, bias)):
                J.SILU_KEY_BLOCK_BACKWARD, J.FUSED_SILU_BACKWARD = key_block, fused
                ops._silu_forward(x, offsets, b, L, 0.1, True, pad_len)
                ops._silu_grads(x, x[0], offsets, b, L, 0.1, True, b is not None, pad_len)
        # the one-kernel softmax backward of short rows (one program per row: its delta
        # pass, dq's scratch sums) at TransAct's head dim, 48, with its per-key bias
        J.FUSED_SOFTMAX_SHORT_ROWS = True
        x = [torch.empty(B * L, H, 48, dtype=torch.bfloat16, device="meta") for _ in range(3)]
        fmeta, fbias = ops._values_meta(x[0], offsets, False, key_bias, L)
        assert fmeta["FUSED_DQ"] and not fmeta["SILU"], fmeta
        lse = torch.empty(H, B * L, dtype=torch.float32, device="meta")
        J._attention_backward(*x, x[0], lse, x[0], offsets, L, 0.1, fmeta, bias=fbias)
    # one compile per kernel and constexprs: the two layouts differ in run-time ints only
    # (pad_len, the buffer's rows), which change no code path, and each compile builds
    # every config of the kernel's autotuner (every launch twice took 75 s of the 2-core CI)
    unique = list({(l.kernel, l.kwargs): l for l in launches}.values())
    errors = [r for r in map(W.compile_launch, unique) if r["error"]]
    kinds = sorted({l.kernel for l in launches})
    print(len(launches), "launches,", len(unique), "compiled, of", kinds, errors)
    sys.exit(1 if errors or len(kinds) != 5 else 0)
""")


def test_the_kernels_compile_for_hopper_in_both_layouts(tmp_path: Path) -> None:
    """The interpreter runs what the GPU compiler refuses (a run-time branch whose two arms
    give a variable different types: the first GPU run of the old zero-fill kernel failed
    so): each launch of the five kernels that zero their outputs' uncovered rows, packed
    (spare slots) and padded, softmax and silu, key-block and two-kernel backward, dq fused
    or not, heads looped over a shared bias or not, a per-key bias (``KEY_BIAS``), and the
    one-program-per-row softmax backward of short rows (``FUSED_SOFTMAX_SHORT_ROWS``,
    TransAct's head dim and key bias), compiles for sm_90, no GPU needed (once per kernel and constexprs:
    the layouts differ in run-time ints only)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _HOPPER], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("shape", [(3, 4, 5), (1, 4, 5), (3, 0, 5), (3, 1, 1), (7,), (),
                                   (0,), (2, 0, 0), (5, 1, 3)])
def test_contiguous_strides_are_torchs(shape):
    """The buffers' strides computed in Python (no meta tensor made per call) are the ones
    torch gives a contiguous tensor, zero and size-1 dims included."""
    from gemc.backends.triton.uncovered_rows import contiguous_strides

    assert contiguous_strides(shape) == torch.empty(shape).stride()
    assert contiguous_strides(torch.Size(shape)) == torch.empty(shape).stride()
