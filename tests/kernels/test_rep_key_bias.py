"""``gemc::rep_key_bias``: the per-key bias of an attention over padding representatives in
one kernel (``backends/triton/rep_key_bias.py``), against the ten-op torch formula it
replaced (kept here only, as the reference); the op's opcheck; its compile for sm_90; and
``packed_tokens.rep_attention`` on it against eager padded SDPA, a row keeping no key
included (0 forward and no gradient, as eager's SDPA gives it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gemc.backends.triton import packed_tokens as pt
from gemc.backends.triton.rep_key_bias import rep_key_bias
from kernel_helpers import as_jit_kernels, forward_graph_targets, fresh_generator

from tests.hopper_target import HOPPER_DRIVER

REPO = Path(__file__).resolve().parents[2]


def old_formula(mask: torch.Tensor, additive: bool, offsets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch formula ``packed_tokens.rep_key_bias`` ran before the kernel (session 26)."""
    m = mask.float() if additive else \
        torch.zeros(mask.shape).masked_fill(~mask.bool(), float("-inf"))
    suffix = torch.logcumsumexp(m.flip(-1), -1).flip(-1)
    width = (offsets[1:] - offsets[:-1])[:, None]
    pos = torch.arange(m.shape[1])[None, :]
    bias = torch.where(pos < width - 1, m, torch.where(pos == width - 1, suffix, 0.0))
    return bias, (m > float("-inf")).any(-1)


def _widths(gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """Row widths 1..L, width 1 and width L always among them."""
    widths = torch.randint(1, length + 1, (batch,), generator=gen)
    widths[0], widths[1] = 1, length
    return widths


def _offsets(widths: torch.Tensor) -> torch.Tensor:
    return torch.cat([widths.new_zeros(1), widths.cumsum(0)])


def _masks(gen: torch.Generator, batch: int, length: int
           ) -> list[tuple[str, torch.Tensor, bool]]:
    """A bool keep-mask and additive masks: 0 / -inf, finite (-1e4, BERT-style, and random
    values), mixed, each with a row keeping none (all -inf / all False) and padded tails
    (dropped positions from a random length on)."""
    keep = torch.rand(batch, length, generator=gen) < 0.6
    tail = torch.arange(length)[None, :] >= torch.randint(0, length + 1, (batch, 1),
                                                          generator=gen)
    keep &= ~tail
    keep[2] = False  # keeps none
    keep[3] = True  # keeps all
    inf = torch.zeros(batch, length).masked_fill(~keep, float("-inf"))
    finite = torch.zeros(batch, length).masked_fill(~keep, -1e4)
    noisy = torch.randn(batch, length, generator=gen) * 3
    mixed = noisy.masked_fill(~keep, float("-inf"))
    mixed[4, ::2] = -1e4
    return [("bool", keep, False), ("additive -inf", inf, True),
            ("additive -1e4", finite, True), ("additive random", noisy, True),
            ("additive mixed", mixed, True), ("additive bf16", inf.bfloat16(), True)]


@pytest.mark.parametrize("length", [1, 7, 16, 33])
def test_the_kernel_is_the_old_formula_on_random_masks(length: int) -> None:
    """Every entry and the kept flags equal the old formula's, rows keeping no key
    (``-inf`` at their slots) included."""
    gen = fresh_generator()
    batch = 9
    widths = _widths(gen, batch, length)
    offsets = _offsets(widths)
    for label, mask, additive in _masks(gen, batch, length):
        bias, kept = rep_key_bias(mask, offsets, additive)
        want, want_kept = old_formula(mask, additive, offsets)
        assert bias.dtype == torch.float32 and bias.shape == (batch, length), label
        assert torch.equal(kept, want_kept), label
        torch.testing.assert_close(bias, want, rtol=1e-6, atol=1e-6, msg=label)
        assert not bias.isnan().any(), label
        if label == "bool":
            assert not kept[2] and (bias[2, :int(widths[2])] == float("-inf")).all()


def test_a_mask_viewed_with_unit_dims_a_broadcast_row_and_int64_offsets() -> None:
    """``[B, 1, 1, L]`` (Hugging Face's extended mask) reads as its rows; a ``[1, L]`` row
    broadcasts over the batch; a non-contiguous mask reads through its strides."""
    gen = fresh_generator()
    batch, length = 5, 12
    offsets = _offsets(_widths(gen, batch, length))
    mask = torch.randn(batch, length, generator=gen).masked_fill(
        torch.rand(batch, length, generator=gen) < 0.3, float("-inf"))
    want, _ = old_formula(mask, True, offsets)
    got, _ = rep_key_bias(mask[:, None, None, :], offsets, True)
    torch.testing.assert_close(got, want)
    strided = torch.randn(length, batch, generator=gen).t()
    torch.testing.assert_close(rep_key_bias(strided, offsets, True)[0],
                               old_formula(strided, True, offsets)[0])
    row = mask[:1]
    torch.testing.assert_close(rep_key_bias(row, offsets, True)[0],
                               old_formula(row.expand(batch, length), True, offsets)[0])


def test_rows_over_several_programs_the_last_one_partial() -> None:
    """70 rows of 100 slots: 16 rows a program (``ROW_ELEMENTS``), five programs, the last
    holding 6 rows; every row's bias and flag as the old formula gives them."""
    gen = fresh_generator()
    batch, length = 70, 100
    offsets = _offsets(_widths(gen, batch, length))
    for label, mask, additive in _masks(gen, batch, length)[:2]:
        bias, kept = rep_key_bias(mask, offsets, additive)
        want, want_kept = old_formula(mask, additive, offsets)
        assert torch.equal(kept, want_kept), label
        torch.testing.assert_close(bias, want, rtol=1e-6, atol=1e-6, msg=label)


def test_a_mask_of_no_keys_keeps_no_row() -> None:
    """The kept flags are not zero-filled before the kernel (it stores every row's); a mask
    of no keys launches no kernel, so its flags are zeros, not whatever the memory held."""
    for _ in range(3):  # fresh allocations: stale memory would show in one of them
        bias, kept = rep_key_bias(torch.zeros(4, 0, dtype=torch.bool), torch.zeros(5).long(),
                                  False)
        assert bias.shape == (4, 0) and kept.dtype == torch.bool
        assert not kept.any()


def test_a_mask_of_the_wrong_batch_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"rep_key_bias: the key mask must be \[B, L\]"):
        rep_key_bias(torch.zeros(3, 4), torch.tensor([0, 2, 4]), True)


def test_the_op_passes_opcheck() -> None:
    """Schema, fake, autograd registration and AOT tracing (on rows keeping some key: the
    check compares outputs without ``equal_nan``)."""
    gen = fresh_generator()
    offsets = _offsets(_widths(gen, 6, 6))
    keep = torch.rand(6, 6, generator=gen) < 0.5
    keep[:, 0] = True
    additive = torch.randn(6, 6, generator=gen).masked_fill(~keep, float("-inf"))
    for mask, is_additive in ((keep, False), (additive, True)):
        torch.library.opcheck(torch.ops.gemc.rep_key_bias.default,
                              (mask, offsets, is_additive),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor", "test_aot_dispatch_static"))


def test_on_a_gpu_the_op_decomposes_into_its_kernel_under_torch_compile(monkeypatch) -> None:
    """The op as a GPU registers it (``triton_op``): AOTAutograd's forward graph launches
    the kernel as a Triton kernel node (Inductor compiles and launches it from its own
    code, no Python op call a step) and holds no ``gemc`` op. Registered under a test
    name, the kernel re-wrapped as a JIT function; the graph is captured, not run."""
    from gemc.backends.triton import rep_key_bias as module

    as_jit_kernels(module, monkeypatch)
    if not hasattr(torch.ops.gemc, "test_rep_key_bias_traced"):
        module._op("test_rep_key_bias_traced", interpreted=False)

    def fn(mask: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.gemc.test_rep_key_bias_traced(mask, offsets, True)

    targets = forward_graph_targets(fn, torch.zeros(4, 10), torch.tensor([0, 3, 5, 15, 16]))
    assert targets.count("triton_kernel_wrapper_functional") == 1, targets
    assert not [t for t in targets if "gemc" in t], targets


def _rep_layout(lengths: torch.Tensor, length: int) -> pt.TokenLayout:
    return pt.with_rep_weights(pt.TokenLayout(pt.rep_offsets(lengths, length),
                                              int((lengths + 1).clamp(max=length).sum()),
                                              int(lengths.numel()), length))


def test_rep_attention_is_eager_padded_sdpa_with_a_row_keeping_no_key() -> None:
    """Forward and every operand's gradient equal padded SDPA on the values the
    representatives scatter to, a row keeping no key included: 0 and no gradient there, as
    SDPA gives it (where the old ``torch.where`` guard gave NaN)."""
    gen = fresh_generator()
    b, length, heads, dim = 5, 7, 2, 8
    lengths = torch.tensor([0, 7, 3, 5, 2])
    layout = _rep_layout(lengths, length)
    dims = ((0, 2),) * 4
    q, k, v = (torch.randn(1, heads, layout.total, dim, generator=gen).requires_grad_(True)
               for _ in range(3))
    drop = torch.arange(length)[None, :] >= lengths[:, None]
    drop |= torch.rand(b, length, generator=gen) < 0.3
    drop[:, 0] = False
    drop[3] = True  # keeps no key
    for additive in (True, False):
        mask = torch.zeros(b, length).masked_fill(drop, float("-inf")) if additive else ~drop
        out = pt.rep_attention(q, k, v, dims, layout, mask, additive, None)
        padded = [pt.scatter(x, (0, 2), layout) for x in (q, k, v)]
        ref = pt.gather(torch.nn.functional.scaled_dot_product_attention(
            *padded, attn_mask=mask[:, None, None, :]), (0, 2), 4, layout)
        empty = layout.index("row") == 3
        assert (out[:, :, empty] == 0).all() and (ref[:, :, empty] == 0).all()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        grad = torch.randn(out.shape, generator=gen)
        got = torch.autograd.grad(out, (q, k, v), grad)
        want = torch.autograd.grad(ref, (q, k, v), grad)
        for g, w in zip(got, want):
            assert (g[:, :, empty] == 0).all()
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


_HOPPER = HOPPER_DRIVER + textwrap.dedent("""
    import sys
    from gemc.backends.triton import warm as W
    from gemc.backends.triton.rep_key_bias import rep_key_bias
    offsets = torch.empty(4097, dtype=torch.int64, device="meta")
    with W.dry_launches() as launches:
        for dtype, additive in ((torch.float32, True), (torch.bfloat16, True),
                                (torch.bool, False)):
            rep_key_bias(torch.empty(4096, 100, dtype=dtype, device="meta"), offsets,
                         additive)
    errors = [r for r in map(W.compile_launch, launches) if r["error"]]
    print(len(launches), "launches;", errors)
    sys.exit(1 if errors or len(launches) != 3 else 0)
""")


def test_the_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    """The interpreter runs what the GPU compiler refuses: each mask kind's launch
    (additive fp32 and bf16, a bool keep-mask) at TransAct's h200 shape compiles for sm_90,
    no GPU needed."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _HOPPER], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
