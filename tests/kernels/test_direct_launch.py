"""A launch of a gemc kernel whose tuning key was already decided skips Triton's
``Autotuner.run`` (backends/triton/direct_launch.py) and launches the config the autotuner
chose, as ``Autotuner.run`` would on its cache hit: same config, same result, the config's
``pre_hook`` run; a key not decided yet, ``forget``, a wrapped ``Autotuner.run`` (the
warm-up's recording) and ``GEMC_DIRECT_LAUNCH=0`` go through the autotuner, and the config
choice's report is the same either way. Calls of ``Autotuner.run`` are counted with
cProfile (the interpreter runs the kernels)."""

from __future__ import annotations

import cProfile
import importlib
import pstats
from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from gemc.backends.triton import config_choice as cc
from gemc.backends.triton import direct_launch as dl
from gemc.backends.triton import warm as W
from gemc.backends.triton.config_choice import Tiles
from kernel_helpers import fresh_generator
from triton.runtime.autotuner import Autotuner

NAME = "test._which_config_kernel"


def autotuner_runs(thunk: Callable[[], Any]) -> int:
    """How many times ``thunk`` entered Triton's ``Autotuner.run``."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        thunk()
    finally:
        prof.disable()
    code = Autotuner.run.__code__
    where = (code.co_filename, code.co_firstlineno, code.co_name)
    return sum(row[0] for fn, row in pstats.Stats(prof).stats.items() if fn == where)


@triton.jit
def _which_config_kernel(x, y, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    # the config's BLOCK is added to the output: the result says which config ran
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * FACTOR + BLOCK, mask=offs < n)


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """A two-config gemc kernel whose heuristic picks BLOCK=16 (a config with a
    ``pre_hook`` that notes each call), no autotuning asked, direct launches on."""
    monkeypatch.delenv(cc.AUTOTUNE_ENV, raising=False)
    monkeypatch.delenv(dl.DIRECT_LAUNCH_ENV, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    hooked: list[dict] = []
    configs = [triton.Config({"BLOCK": 64}),
               triton.Config({"BLOCK": 16}, pre_hook=lambda nargs: hooked.append(nargs))]
    k = cc.autotune(configs, ["n"], name=NAME,
                    tiles=lambda c, a: Tiles(streamed=c.kwargs["BLOCK"] * 4),
                    prefer=lambda a: [({"BLOCK": 16}, configs[1].num_warps, None)]
                    )(_which_config_kernel)
    k.hooked = hooked
    yield k
    cc._KERNELS.pop(NAME, None)


def _launch(k: Any, x: torch.Tensor, factor: float = 3.0) -> torch.Tensor:
    y = torch.full_like(x, float("nan"))
    k[lambda m: (triton.cdiv(x.numel(), m["BLOCK"]),)](x, y, x.numel(), FACTOR=factor)
    return y


def test_a_decided_key_launches_the_autotuners_config_past_it(kernel):
    gen = fresh_generator()
    x = torch.randn(40, generator=gen)
    # another key of the same specialisation first: its launch compiles the kernel outside
    # the counts (on a GPU, cProfile loses the Autotuner.run frame of a launch that
    # compiles: the test's first form counted 0 there)
    _launch(kernel, torch.randn(24, generator=gen))
    assert autotuner_runs(lambda: _launch(kernel, x)) == 1  # a new key: tuned (pruned)
    by_autotuner, hooks = kernel.hooked[-1], len(kernel.hooked)
    first = _launch(kernel, x)  # decided: launched directly
    assert len(kernel.hooked) == hooks + 1  # the config's pre_hook ran once for it
    assert autotuner_runs(lambda: _launch(kernel, x)) == 0
    torch.testing.assert_close(first, x * 3.0 + 16)  # BLOCK=16, the autotuner's pick
    _, tuner = cc._KERNELS[NAME]
    assert isinstance(tuner, dl.DirectAutotuner) and tuner.best_config is tuner.configs[1]
    assert len(tuner.cache) == 2 and tuner.nargs is None
    assert all(c is tuner.configs[1] for c in tuner.cache.values())
    # the config's pre_hook ran on the direct launch with the arguments Autotuner.run gives it
    direct = kernel.hooked[-1]
    assert by_autotuner.keys() == direct.keys() and direct["BLOCK"] == 16
    assert direct["n"] == 40 and direct["FACTOR"] == 3.0


def test_a_new_key_goes_through_the_autotuner(kernel):
    gen = fresh_generator()
    x, z = torch.randn(40, generator=gen), torch.randn(24, generator=gen)
    _launch(kernel, x)
    assert autotuner_runs(lambda: _launch(kernel, z)) == 1  # key n=24: not decided yet
    assert autotuner_runs(lambda: _launch(kernel, z)) == 0
    hook, tuner = cc._KERNELS[NAME]
    assert len(hook.chosen) == 2 and len(tuner.cache) == 2
    torch.testing.assert_close(_launch(kernel, z, 2.0), z * 2.0 + 16)


def test_forget_sends_the_next_launch_through_the_autotuner(kernel):
    x = torch.randn(40, generator=fresh_generator())
    _launch(kernel, x)
    assert cc.forget("test._which") == [NAME]
    hook, tuner = cc._KERNELS[NAME]
    assert not hook.chosen and not tuner.cache
    assert autotuner_runs(lambda: _launch(kernel, x)) == 1
    assert len(hook.chosen) == 1 and autotuner_runs(lambda: _launch(kernel, x)) == 0


def test_switched_off_every_launch_takes_the_autotuner_and_the_report_is_the_same(
        kernel, monkeypatch):
    gen = fresh_generator()
    x, z = torch.randn(40, generator=gen), torch.randn(24, generator=gen)

    def session() -> tuple[int, list[torch.Tensor], dict]:
        cc.forget(NAME)
        outs: list[torch.Tensor] = []
        runs = autotuner_runs(lambda: outs.extend(_launch(kernel, t) for t in (x, x, z, x)))
        return runs, outs, cc.report()[NAME]

    direct = session()
    monkeypatch.setenv(dl.DIRECT_LAUNCH_ENV, "0")
    through = session()
    assert (direct[0], through[0]) == (2, 4)
    for a, b in zip(direct[1], through[1]):
        assert torch.equal(a, b)
    assert direct[2] == through[2] and len(direct[2]) == 2


def test_a_bad_switch_value_is_refused_by_name(kernel, monkeypatch):
    monkeypatch.setenv(dl.DIRECT_LAUNCH_ENV, "yes")
    with pytest.raises(ValueError, match="GEMC_DIRECT_LAUNCH='yes'"):
        _launch(kernel, torch.randn(8))


def test_a_recorded_launch_is_still_seen_at_the_autotuner():
    """While :mod:`.warm` wraps ``Autotuner.run`` (recording launches for the warm-up),
    a decided config's launch goes through it: each attention kernel is recorded once, at
    its autotuner, with no config keyword among its arguments (what the warm-up's compile
    passes to ``Autotuner.warmup``), and it still runs."""
    ja = importlib.import_module("gemc.backends.triton.jagged_attention")
    gen = fresh_generator()
    offsets = torch.tensor([0, 5, 12])
    q = torch.randn(12, 2, 16, generator=gen)
    want = ja.jagged_attention(q, q, q, offsets, 8, kind="silu")  # decided: direct
    with W.record_launches() as seen:
        got = ja.jagged_attention(q, q, q, offsets, 8, kind="silu")
    assert torch.equal(got, want)
    assert [s.kernel for s in seen] == ["jagged_attention._fwd_kernel"]
    assert not {"BLOCK_M", "BLOCK_N", "num_warps"} & set(dict(seen[0].kwargs))


def test_the_key_is_the_autotuners_for_every_attention_launch():
    """The key formed past ``Autotuner.run`` (``launch_key``) is the one Triton forms
    (``config_choice.tuning_key`` spells Triton's formation) for each launch of a silu
    fwd+bwd with a bias and of a softmax fwd+bwd, their constexprs passed by keyword."""
    ja = importlib.import_module("gemc.backends.triton.jagged_attention")
    gen = fresh_generator()
    offsets = torch.tensor([0, 5, 12])
    bias = torch.randn(2, 1, 8, 8, generator=gen).requires_grad_()
    with W.record_launches() as seen:
        for kind, b in (("silu", bias), ("softmax", None)):
            q, k, v = (torch.randn(12, 2, 16, generator=gen).requires_grad_()
                       for _ in range(3))
            out = ja.jagged_attention(q, k, v, offsets, 8, causal=True, kind=kind, bias=b)
            out.sum().backward()
    assert len(seen) >= 5
    for s in seen:
        tuner = getattr(importlib.import_module(s.module), s.name)
        assert isinstance(tuner, dl.DirectAutotuner), s.kernel
        kwargs = dict(s.kwargs)
        named = {**dict(zip(tuner.arg_names, s.args)), **kwargs}
        got = dl.launch_key(tuner, s.args, kwargs)
        assert str(got) == cc.tuning_key(tuner.arg_names, tuner.keys, named), s.kernel


def test_an_attention_fwd_bwd_skips_the_autotuner_with_the_same_result(monkeypatch):
    """Under the interpreter each attention kernel has one config (``Autotuner.run``
    would launch it without looking at the key): every launch goes direct, and the
    output and gradients equal those through the autotuner."""
    ja = importlib.import_module("gemc.backends.triton.jagged_attention")
    gen = fresh_generator()
    offsets = torch.tensor([0, 5, 5, 16])
    x = [torch.randn(16, 2, 16, generator=gen) for _ in range(4)]
    bias = torch.randn(3, 1, 11, 11, generator=gen)

    def fwd_bwd() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (*x[:3], bias)]
        out = ja.jagged_attention(*leaves[:3], offsets, 11, causal=True, kind="silu",
                                  bias=leaves[3])
        return [out.detach(), *torch.autograd.grad(out, leaves, x[3])]

    results: list[list[torch.Tensor]] = []
    runs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(dl.DIRECT_LAUNCH_ENV, switch)
        runs.append(autotuner_runs(lambda: results.append(fwd_bwd())))
    assert runs[0] == 0 and runs[1] >= 3
    for a, b in zip(*results):
        assert torch.equal(a, b)
