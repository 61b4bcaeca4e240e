"""The one-kernel softmax backward of short rows (``FUSED_SOFTMAX_SHORT_ROWS``:
``softmax_row_backward``, one program per (sequence, head) computing delta, then dq, dk and
dv from each tile pair once, dq's sums over key blocks in an fp32 scratch; the dq and dk/dv
kernels do not run) computes what the two-kernel backward computes, and
both what padded SDPA computes in fp32 with a key-padding mask: forward, dq, dk, dv and the
bias's gradient, on fresh random rows of lengths 0..L (an empty row and a row of exactly L
always among them), causal or not, without a bias, with a per-key bias (``KEY_BIAS``, a
packed region's mask: ``-inf`` entries, a row whose every key is hidden) and with a full
bias that takes a gradient. And the rule: one kernel for softmax at ``max_len <= 128`` and
head dim <= 64, two otherwise, through each entry point that threads ``max_len``."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.triton import config_choice as cc
from gemc.backends.triton import ops as _ops  # noqa: F401  (registers the gemc:: ops)
from gemc.backends.triton import softmax_row_backward as _row  # its tuner, candidates
from gemc.backends.triton import warm as W
from gemc.backends.triton.jagged import jagged_to_padded_reference, padded_to_jagged_reference
from kernel_helpers import fresh_generator

kernel = importlib.import_module("gemc.backends.triton.jagged_attention")
# Rows over several blocks of the configs that run, the last ragged: the interpreter's 16-row
# blocks at L = 40, the GPU's 64-row ones (the row kernel's pick) at L = 100
# (GEMC_TEST_DEVICE=cuda). The row
# kernel's dq sums through its scratch happen only where a row has two key blocks: at
# L = 40 on the GPU no row had (thirtieth session's GPU run). Head dim 24 pads to 32 (a
# masked column tail).
ON_GPU = os.environ.get("GEMC_TEST_DEVICE", "cpu") != "cpu"
B, L, H, D = 5, (100 if ON_GPU else 40), 2, 24
BLOCK = 64 if ON_GPU else 16
ROW_TUNER = "jagged_attention._bwd_softmax_row_kernel"
ROW_CONFIGS = list(cc._KERNELS[ROW_TUNER][1].configs) + (_row.KEY_MAJOR_CANDIDATES
                                                         if ON_GPU else [])
"""The row kernel's configs, each one forced: on the GPU every config ``GEMC_AUTOTUNE=1``
may take and a pick may name (at L = 100, 32-row blocks give rows of four key blocks, dq
summed three times through the scratch; a cap on the registers spills) and the key-major
candidates not yet in the tuner's list; the interpreter's two, one per orientation of the
tiles (``KEY_MAJOR``)."""
SCALE = D ** -0.5
FWD, DQ, DKDV = (f"jagged_attention.{n}" for n in ("_fwd_kernel", "_bwd_dq_kernel",
                                                     "_bwd_dkdv_kernel"))
ROW = "softmax_row_backward._bwd_softmax_row_kernel"


def _inputs(gen: torch.Generator, bias_kind: str, block: int = BLOCK):
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    lengths[0], lengths[1] = 0, L
    # row 2 ends inside its second key block (a ragged one: the key bias hides all of it)
    lengths[2] = int(torch.randint(block + 1, min(2 * block, L), (1,), generator=gen))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    q, k, v, g = (torch.randn(int(lengths.sum()), H, D, generator=gen) for _ in range(4))
    bias = None
    if bias_kind == "key":  # [B, L] fp32 by key position, no gradient (a mask)
        bias = 2 * torch.randn(B, L, generator=gen)
        bias[torch.rand(B, L, generator=gen) < 0.3] = float("-inf")
        bias[2] = float("-inf")  # a row none of whose keys any query sees
    elif bias_kind == "full":  # shared by the heads: they add into one gradient block
        bias = 0.5 * torch.randn(B, 1, L, L, generator=gen)
    return lengths, offsets, (q, k, v), g, bias


def _kernels(x, g, offsets, causal, bias_kind, bias, fused, monkeypatch):  # noqa: ANN001, ANN202
    """out, dq, dk, dv (and the bias's gradient) by the kernels, and the kernels launched."""
    monkeypatch.setattr(kernel, "FUSED_SOFTMAX_SHORT_ROWS", fused)
    leaves = [t.clone().requires_grad_() for t in x]
    with W.record_launches() as seen:
        if bias_kind == "key":  # a packed region's attention with its key bias
            out, _ = torch.ops.gemc.jagged_attention_values(*leaves, offsets, L, SCALE, causal,
                                                            bias)
        else:
            if bias is not None:
                bias = bias.clone().requires_grad_()
                leaves.append(bias)
            out = kernel.jagged_attention(*leaves[:3], offsets, L, scale=SCALE, causal=causal,
                                          bias=bias)
        grads = torch.autograd.grad(out, leaves, g)
    return [out.detach(), *grads], [launch.kernel for launch in seen]


def _sdpa(x, g, lengths, offsets, causal, bias_kind, bias):  # noqa: ANN001, ANN202
    """Padded SDPA in fp32 with a key-padding (and causal) mask and the bias; a query that
    sees no key gives 0 (what the kernels define), so its row's mask is made finite and
    its output zeroed."""
    leaves = [t.clone().requires_grad_() for t in x]
    qp, kp, vp = (jagged_to_padded_reference(t, offsets, L).transpose(1, 2) for t in leaves)
    pos = torch.arange(L)
    visible = (pos[None, None, :] < lengths[:, None, None]).expand(B, L, L)[:, None]
    if causal:
        visible = visible & (pos[:, None] >= pos[None, :])
    add = torch.zeros(())
    if bias_kind == "key":
        add = bias[:, None, None, :]
        visible = visible & (add > float("-inf"))
    elif bias_kind == "full":
        add = bias.clone().requires_grad_()
        leaves.append(add)
    alive = visible.any(-1, keepdim=True)
    mask = torch.where(alive, torch.where(visible, add, float("-inf")), 0.0)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=SCALE) * alive
    out = padded_to_jagged_reference(out.transpose(1, 2), offsets, int(lengths.sum()))
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


@pytest.fixture
def forced_row_config(request, monkeypatch):  # noqa: ANN001, ANN201
    """The row kernel's pick made config ``request.param``, and every attention pick
    forgotten after the test, so no later test runs it."""
    config = request.param
    want = (config.kwargs, config.num_warps, config.num_stages, config.maxnreg)
    hook, tuner = cc._KERNELS[ROW_TUNER]
    if config not in tuner.configs:  # a candidate: in the tuner's list for this test only
        monkeypatch.setattr(tuner, "configs", [*tuner.configs, config])
    monkeypatch.setattr(hook, "prefer", lambda args: [want])
    cc.forget("jagged_attention.")
    yield config
    cc.forget("jagged_attention.")


@pytest.mark.parametrize("forced_row_config", ROW_CONFIGS, indirect=True,
                         ids=lambda c: f"row{c.kwargs['BLOCK']}-{c.num_warps}w-"
                         f"{c.num_stages}s" + (f"-{c.maxnreg}r" if c.maxnreg else "")
                         + ("-keys" if c.kwargs["KEY_MAJOR"] else ""))
@pytest.mark.parametrize("bias_kind", ["none", "key", "full"])
@pytest.mark.parametrize("causal", [False, True])
def test_one_kernel_equals_the_two_kernels_and_padded_sdpa(causal, bias_kind,
                                                          forced_row_config, monkeypatch):
    row_config = forced_row_config
    block = row_config.kwargs["BLOCK"]
    lengths, offsets, x, g, bias = _inputs(fresh_generator(), bias_kind, block)
    one, launched_one = _kernels(x, g, offsets, causal, bias_kind, bias, True, monkeypatch)
    ran = list(cc.ran(ROW_TUNER)[ROW_TUNER].values())  # the forced config ran
    assert ran == [cc.describe(row_config)], ran
    two, launched_two = _kernels(x, g, offsets, causal, bias_kind, bias, False, monkeypatch)
    ref = _sdpa(x, g, lengths, offsets, causal, bias_kind, bias)
    assert launched_one == [FWD, ROW] and launched_two == [FWD, DQ, DKDV]
    assert len(one) == len(two) == len(ref) == (5 if bias_kind == "full" else 4)
    for name, a, b, r in zip(("out", "dq", "dk", "dv", "dbias"), one, two, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}, one kernel vs two: {m}")
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, n=name: f"{n}, one kernel vs SDPA: {m}")
    # the row of exactly L has a dq (not an all-zero buffer that matched by luck)
    assert one[1][int(offsets[1]):int(offsets[2])].abs().max() > 0


def _fused(kind: str, max_len: int, head_dim: int) -> bool:
    q = torch.zeros(1, 2, head_dim, dtype=torch.bfloat16)
    return kernel._meta(q, False, kind, "max_len", max_len)["FUSED_DQ"]


def test_the_rule_picks_one_kernel_for_short_softmax_rows(monkeypatch):
    """One kernel at ``max_len <= 128`` and head dim <= 64 (TransAct's 100 and 48
    included), not at 129, not at head dim 128 (or 65: padded to 128), not for an empty
    call, not for silu (its own switch, ``FUSED_SILU_BACKWARD``, off), nowhere with the
    switch off."""
    monkeypatch.setattr(kernel, "FUSED_SOFTMAX_SHORT_ROWS", True)
    assert _fused("softmax", 128, 64) and _fused("softmax", 100, 48) and _fused("softmax", 1, 8)
    assert not _fused("softmax", 129, 64) and not _fused("softmax", 128, 128)
    assert not _fused("softmax", 64, 65) and not _fused("softmax", 0, 48)
    assert not _fused("silu", 64, 48)
    monkeypatch.setattr(kernel, "FUSED_SOFTMAX_SHORT_ROWS", False)
    assert not _fused("softmax", 100, 48)


def test_the_key_major_pick_reaches_only_the_rows_its_gpu_tests_ran():
    """The row kernel's GPU pick is key-major 64-row blocks (the faster at TransAct's
    shape) for rows without causality and with no bias or a per-key one, the kinds its GPU
    tests have passed; a causal row, a full bias tile or a bias gradient keeps query-major
    64-row blocks. The interpreter picks the same orientation, so the CPU tests that run
    the pick (the uncovered rows') run what a GPU would."""
    def first(**flags):
        prefs = _row._prefer({"CAUSAL": False, "HAS_BIAS": False, "KEY_BIAS": False,
                              "BIAS_GRAD": False, **flags})
        # the interpreter's pick (its one-warp config) has the GPU pick's orientation
        assert prefs[-1][0]["KEY_MAJOR"] == prefs[0][0]["KEY_MAJOR"], prefs
        return prefs[0][0]

    assert first() == first(HAS_BIAS=True, KEY_BIAS=True) == {"BLOCK": 64, "KEY_MAJOR": 1}
    for flags in ({"CAUSAL": True}, {"HAS_BIAS": True}, {"HAS_BIAS": True, "BIAS_GRAD": True},
                  {"CAUSAL": True, "HAS_BIAS": True, "KEY_BIAS": True}):
        assert first(**flags) == {"BLOCK": 64, "KEY_MAJOR": 0}, flags


@pytest.mark.parametrize("max_len, launched", [(128, [FWD, ROW]), (129, [FWD, DQ, DKDV])])
def test_each_entry_point_threads_max_len_to_the_rule(max_len, launched, monkeypatch):
    """The public function, the packed-values op (with and without a key bias) and the
    padded op each decide by their own ``max_len``: one row of 3 tokens, the grid sized by
    ``max_len``, launches the one-program-per-row kernel at 128 and the two at 129."""
    monkeypatch.setattr(kernel, "FUSED_SOFTMAX_SHORT_ROWS", True)
    gen = fresh_generator()
    offsets = torch.tensor([0, 3])
    q, k, v = (torch.randn(3, H, 8, generator=gen, requires_grad=True) for _ in range(3))
    padded = [torch.randn(1, H, 3, 8, generator=gen, requires_grad=True) for _ in range(3)]
    key_bias = torch.zeros(1, max_len)
    calls = [
        lambda: kernel.jagged_attention(q, k, v, offsets, max_len),
        lambda: torch.ops.gemc.jagged_attention_values(q, k, v, offsets, max_len, 0.3)[0],
        lambda: torch.ops.gemc.jagged_attention_values(q, k, v, offsets, max_len, 0.3, False,
                                                       key_bias)[0],
        lambda: torch.ops.gemc.jagged_attention(*padded, offsets, 1, max_len, 0.3)[0],
    ]
    for call in calls:
        with W.record_launches() as seen:
            call().sum().backward()
        assert [launch.kernel for launch in seen] == launched


def test_a_timed_run_of_the_row_kernel_zeroes_only_the_shared_bias_gradient():
    """Autotuning runs the row kernel several times: the heads' programs add into a bias
    gradient they share, so it is zeroed before each timed run; dq is not (its scratch is
    stored before it is read, and dq itself is stored once), nor an unshared bias gradient
    (stored once per tile)."""
    _, tuner = cc._KERNELS["jagged_attention._bwd_softmax_row_kernel"]
    dq, dbias = torch.ones(3), torch.ones(2)
    tuner.pre_hook({"BIAS_GRAD": True, "BIAS_GRAD_ADD": False, "DQ": dq, "DBIAS": dbias},
                   reset_only=True)
    assert torch.equal(dq, torch.ones(3)) and torch.equal(dbias, torch.ones(2))
    tuner.pre_hook({"BIAS_GRAD": True, "BIAS_GRAD_ADD": True, "DQ": dq, "DBIAS": dbias},
                   reset_only=True)
    assert torch.equal(dq, torch.ones(3)) and torch.equal(dbias, torch.zeros(2))


def test_the_switch_reads_1_or_0_and_refuses_anything_else(monkeypatch):
    monkeypatch.delenv(kernel.FUSED_SOFTMAX_ENV, raising=False)
    assert kernel._fused_softmax_from_env() is True  # on since its GPU tests passed
    for value, on in (("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv(kernel.FUSED_SOFTMAX_ENV, value)
        assert kernel._fused_softmax_from_env() is on
    monkeypatch.setenv(kernel.FUSED_SOFTMAX_ENV, "yes")
    with pytest.raises(ValueError, match="GEMC_FUSED_SOFTMAX_SHORT_ROWS='yes'"):
        kernel._fused_softmax_from_env()
