"""Launch-config choice of gemc's hand-written kernels (backends/triton/config_choice.py):
configs too big for shared memory are dropped before compiling, a cold run takes one
heuristic config per key, ``--autotune`` times every config that fits, and what it picked
is recorded for later runs. The figures are the H200's (issue 16's first-step log)."""

from __future__ import annotations

import ast
import importlib
import json

import pytest
import torch
import triton
import triton.language as tl
from gemc.backends.triton import config_choice as cc
from gemc.backends.triton.config_choice import H200_SHARED_MEMORY, Tiles

ja = importlib.import_module("gemc.backends.triton.jagged_attention")


def _cfg(bm: int, bn: int, warps: int, stages: int, maxnreg: int | None = None
         ) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages,
                         maxnreg=maxnreg)


# The GPU lists as written in jagged_attention.py (the interpreter's lists hold one config).
FWD = [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 4), _cfg(128, 128, 8, 3),
       _cfg(64, 32, 4, 2), _cfg(64, 32, 4, 2, 96)]
DQ = [_cfg(128, 32, 4, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 4),
      _cfg(64, 32, 4, 2)]
DKDV = [_cfg(32, 128, 4, 3), _cfg(64, 128, 8, 3), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 4),
        _cfg(32, 32, 4, 1)]


def _hstu_args() -> dict:
    """HSTU's launch on the H200: bf16 q, head dim 128, an fp32 relative bias, silu."""
    return {"Q": torch.empty(1, dtype=torch.bfloat16), "BIAS": torch.empty(1),
            "HEAD_DIM": 128, "BLOCK_D": 128, "CAUSAL": True, "SILU": True, "HAS_BIAS": True}


def _gem_args(max_len: int = 200) -> dict:
    return {"Q": torch.empty(1, dtype=torch.bfloat16), "BIAS": torch.empty(1, dtype=torch.bfloat16),
            "HEAD_DIM": 64, "BLOCK_D": 64, "CAUSAL": False, "SILU": False, "HAS_BIAS": False,
            "inv_max_len": 1.0 / max_len}


def _transact_args(max_len: int = 100) -> dict:
    """TransAct's encoder on the H100: bf16, head dim 48 (tiles of 64), rows of <= 100."""
    return {**_gem_args(max_len), "HEAD_DIM": 48}


def _hook(name: str, tiles, prefer, keys=("HEAD_DIM", "CAUSAL", "SILU")) -> cc.ConfigChoice:
    return cc.ConfigChoice(name, list(keys), tiles, prefer,
                           arg_names=["Q", "BIAS", "HEAD_DIM", "BLOCK_D", "CAUSAL", "SILU",
                                      "HAS_BIAS"], source_key="src-1")


@pytest.fixture
def cold(monkeypatch, tmp_path):
    """No autotuning asked, an empty Triton cache directory of the run's own."""
    monkeypatch.delenv(cc.AUTOTUNE_ENV, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_limit_without_cuda_is_the_h200s():
    if torch.cuda.is_available():
        pytest.skip("the device answers itself")
    assert cc.shared_memory_limit() == H200_SHARED_MEMORY == 232448


@pytest.mark.parametrize("tiles, configs, failed, kept", [
    # Triton 3.6 on the H200: "out of resource: shared memory, Required: N" for exactly these
    (ja._fwd_tiles, FWD, [(128, 128, 8, 3, 360448)], [0, 1, 2, 4, 5]),
    (ja._dq_tiles, DQ, [(128, 64, 8, 3, 262144)], [0, 2, 3, 4]),
    (ja._dkdv_tiles, DKDV, [(64, 128, 8, 3, 245760)], [0, 2, 3, 4]),
])
def test_estimate_drops_exactly_the_configs_that_failed_on_the_h200(tiles, configs, failed, kept):
    args = _hstu_args()
    for bm, bn, warps, stages, required in failed:
        est = cc.shared_memory_bytes(stages, tiles(_cfg(bm, bn, warps, stages), args))
        assert est >= required > H200_SHARED_MEMORY
    fits = [i for i, c in enumerate(configs)
            if cc.shared_memory_bytes(c.num_stages, tiles(c, args)) <= H200_SHARED_MEMORY]
    assert fits == kept
    # head dim 64 without a bias (the GEM example): every config compiled there
    assert all(cc.shared_memory_bytes(c.num_stages, tiles(c, _gem_args())) <= H200_SHARED_MEMORY
               for c in configs)


@pytest.mark.parametrize("args, tiles, prefer, configs, want", [
    (_hstu_args(), ja._fwd_tiles, ja._fwd_prefer, FWD, (128, 64, 8, 3)),
    (_hstu_args(), ja._dq_tiles, ja._dq_prefer, DQ, (64, 32, 4, 4)),
    (_hstu_args(), ja._dkdv_tiles, ja._dkdv_prefer, DKDV, (32, 64, 4, 4)),
    (_gem_args(), ja._fwd_tiles, ja._fwd_prefer, FWD, (64, 64, 4, 4)),
    (_gem_args(), ja._dq_tiles, ja._dq_prefer, DQ, (64, 32, 4, 4)),
    (_gem_args(), ja._dkdv_tiles, ja._dkdv_prefer, DKDV, (64, 64, 4, 3)),
    # short rows (jagged_attention.SHORT_ROWS): the configs the H100 sweep timed fastest
    (_transact_args(), ja._fwd_tiles, ja._fwd_prefer, FWD, (64, 32, 4, 2, 96)),
    (_transact_args(), ja._dq_tiles, ja._dq_prefer, DQ, (64, 32, 4, 2)),
    (_transact_args(), ja._dkdv_tiles, ja._dkdv_prefer, DKDV, (32, 32, 4, 1)),
    (_transact_args(128), ja._dkdv_tiles, ja._dkdv_prefer, DKDV, (32, 32, 4, 1)),
    # one token longer, or no length known: the long-row pick
    (_transact_args(129), ja._dkdv_tiles, ja._dkdv_prefer, DKDV, (64, 64, 4, 3)),
    ({**_transact_args(), "inv_max_len": None}, ja._fwd_tiles, ja._fwd_prefer, FWD,
     (64, 64, 4, 4)),
    # short rows at head dim 128 keep HSTU's picks
    ({**_hstu_args(), "inv_max_len": 0.01}, ja._fwd_tiles, ja._fwd_prefer, FWD,
     (128, 64, 8, 3)),
])
def test_cold_run_takes_the_h200_pick_alone(cold, args, tiles, prefer, configs, want):
    hook = _hook("k", tiles, prefer)
    got = hook(configs, args)
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages,
             *([c.maxnreg] if c.maxnreg else [])) for c in got] == [want]
    (how, cfg), = hook.chosen.values()
    assert how == "heuristic" and cfg == cc.describe(got[0])


def test_heuristic_pick_that_does_not_fit_falls_to_one_that_does(cold):
    # a preference for the config too big for the H200 is passed over, loudly in the report
    hook = _hook("k", ja._fwd_tiles, lambda a: [({"BLOCK_M": 128, "BLOCK_N": 128}, 8, 3)])
    got = hook(FWD, _hstu_args())
    assert got == [FWD[0]]
    assert list(hook.pruned.values()) == [[cc.describe(FWD[3])]]


def test_a_register_cap_is_picked_only_by_name_and_named_in_the_record(cold):
    """A config capped at ``maxnreg`` registers a thread (the row kernel's) and the same
    config uncapped are two choices: a 3-element pick takes the uncapped one, a 4-element
    pick the one with that cap, and the record's string tells them apart."""
    plain, capped = _cfg(32, 32, 4, 1), _cfg(32, 32, 4, 1)
    capped.maxnreg = 128
    configs = [capped, plain]
    for want, expected in ((({"BLOCK_M": 32, "BLOCK_N": 32}, 4, 1), plain),
                           (({"BLOCK_M": 32, "BLOCK_N": 32}, 4, 1, 128), capped),
                           (({"BLOCK_M": 32, "BLOCK_N": 32}, 4, None, 128), capped)):
        hook = _hook("k", ja._dkdv_tiles, lambda a, w=want: [w])
        assert hook(configs, _transact_args()) == [expected]
    assert not cc._matches(capped, ({"BLOCK_M": 32, "BLOCK_N": 32}, 4, 1, 96))
    assert cc.describe(capped) == cc.describe(plain) + ", maxnreg=128"


def test_autotune_times_every_config_that_fits(cold, monkeypatch):
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "1")
    hook = _hook("k", ja._dkdv_tiles, ja._dkdv_prefer)
    got = hook(DKDV, _hstu_args())
    assert got == [DKDV[0], DKDV[2], DKDV[3], DKDV[4]]
    assert list(hook.chosen.values()) == [("autotuned", None)]


def test_a_cheap_kernel_tunes_on_a_cold_run_too(cold):
    """``tune_cold`` (the pooled embedding bag): every config that fits is timed without
    ``--autotune``; the same hook without it runs its one heuristic pick."""
    from gemc.backends.triton import embedding_bag as eb

    choice, _ = cc._KERNELS["embedding_bag._pooled_forward_kernel"]
    assert choice.tune_cold
    bags = [triton.Config({"BLOCK_L": b}, num_warps=w) for b, w in ((16, 2), (32, 4), (8, 1))]
    args = {"BLOCK_D": 128}
    tuned = cc.ConfigChoice("bag", ["BLOCK_D"], eb._gather_tiles, eb._gather_prefer,
                            arg_names=["BLOCK_D"], tune_cold=True)
    assert tuned(bags, args) == bags and list(tuned.chosen.values()) == [("autotuned", None)]
    once = cc.ConfigChoice("bag", ["BLOCK_D"], eb._gather_tiles, eb._gather_prefer,
                           arg_names=["BLOCK_D"])
    assert once(bags, args) == [bags[2]]
    assert list(once.chosen.values())[0][0] == "heuristic"


class _Tuner:
    """What record_tuned reads of a triton Autotuner: its per-key best config."""

    def __init__(self) -> None:
        self.cache: dict = {}


def test_autotuned_winner_is_recorded_and_used_by_the_next_cold_run(cold, monkeypatch):
    args = _hstu_args()
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "1")
    hook, tuner = _hook("test.k", ja._dq_tiles, ja._dq_prefer), _Tuner()
    monkeypatch.setitem(cc._KERNELS, "test.k", (hook, tuner))
    hook(DQ, args)
    key = next(iter(hook.chosen))
    tuner.cache[ast.literal_eval(key)] = DQ[2]  # what triton.autotune timed fastest
    assert cc.record_tuned() == 1
    saved = json.loads((cold / cc.RECORD_NAME).read_text())
    assert saved["test.k"] == {"source": "src-1", "configs": {key: cc.describe(DQ[2])}}
    assert cc.report()["test.k"][key]["source"] == "autotuned"

    monkeypatch.delenv(cc.AUTOTUNE_ENV)
    again = _hook("test.k", ja._dq_tiles, ja._dq_prefer)
    assert again(DQ, args) == [DQ[2]]  # not the heuristic's (64, 32, 4, 4)
    assert list(again.chosen.values()) == [("recorded", cc.describe(DQ[2]))]
    # a record of other kernel source is not trusted
    other = _hook("test.k", ja._dq_tiles, ja._dq_prefer)
    other.source_key = "src-2"
    assert other(DQ, args) == [DQ[3]]
    assert list(other.chosen.values())[0][0] == "heuristic"


def test_no_cache_directory_records_nothing(monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert cc.record_tuned() == 0


@triton.jit
def _scale_kernel(x, y, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * FACTOR, mask=offs < n)


def test_hook_inside_triton_autotune_runs_one_config_and_keys_as_triton_does(cold):
    """Through triton.autotune itself (interpreter): the hook's key is the autotuner's, and
    the one config it returns is what runs, with no timing of the others."""
    configs = [triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 16})]
    kernel = cc.autotune(configs, ["n"], name="test._scale_kernel",
                         tiles=lambda c, a: Tiles(streamed=c.kwargs["BLOCK"] * 4),
                         prefer=lambda a: [({"BLOCK": 16}, configs[1].num_warps, None)]
                         )(_scale_kernel)
    try:
        x = torch.randn(40)
        y = torch.empty_like(x)
        kernel[lambda m: (triton.cdiv(40, m["BLOCK"]),)](x, y, 40, FACTOR=3.0)
        torch.testing.assert_close(y, x * 3.0)
        hook, tuner = cc._KERNELS["test._scale_kernel"]
        assert {str(k) for k in tuner.cache} == set(hook.chosen)
        assert list(tuner.cache.values()) == [configs[1]]
        assert cc.report()["test._scale_kernel"] == {
            next(iter(hook.chosen)): {"source": "heuristic",
                                      "config": cc.describe(configs[1]), "too_big": []}}
    finally:
        cc._KERNELS.pop("test._scale_kernel", None)


@triton.jit
def _add_into_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(y + offs, mask=offs < n) + tl.load(x + offs, mask=offs < n),
             mask=offs < n)


def _add_into(name: str, **options):  # noqa: ANN202 - triton.autotune's object
    configs = [triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 16})]
    return cc.autotune(configs, ["n"], name=name,
                       tiles=lambda c, a: Tiles(streamed=c.kwargs["BLOCK"] * 4),
                       prefer=lambda a: [({"BLOCK": 16}, configs[1].num_warps, None)],
                       **options)(_add_into_kernel)


def _never(*_: object) -> None:
    raise AssertionError("the timer ran the kernel with one config left")


def test_one_config_is_launched_once_and_never_timed(cold):
    """The hook leaves one config: the launch adds into ``y`` once, and the autotuner's
    timer (which Triton 3.6 still calls for a lone pruned config, running the kernel a few
    hundred times: the H200's wrong fused silu dq) runs nothing for it."""
    kernel = _add_into("test._add_into_kernel")
    try:
        hook, tuner = cc._KERNELS["test._add_into_kernel"]
        assert tuner is kernel and tuner.do_bench == hook.bench
        x, y = torch.randn(40), torch.ones(40)
        kernel[lambda m: (triton.cdiv(40, m["BLOCK"]),)](x, y, 40)
        torch.testing.assert_close(y, x + 1.0)
        assert list(tuner.cache.values()) == [tuner.configs[1]] and hook.left == 1
        assert tuner.do_bench(_never, quantiles=(0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]
    finally:
        cc._KERNELS.pop("test._add_into_kernel", None)


def test_the_interpreter_times_nothing_and_ties_every_config():
    """Under the interpreter (every CPU test) there is no driver to time with: the timer
    runs nothing and gives each config the same time, so the first that fits runs (the
    row kernel keeps two configs there for its tests to force)."""
    ran = []
    timer = cc._triton_timer()
    assert timer(lambda: ran.append(1), quantiles=(0.5, 0.2)) == [0.0, 0.0]
    assert timer(lambda: ran.append(1)) == 0.0 and ran == []


def test_several_configs_left_are_timed_by_triton(cold, monkeypatch):
    """With autotuning asked the hook leaves every config that fits, and Triton's own timer
    times each (the kernel runs)."""
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "1")
    timed = []
    monkeypatch.setattr(cc, "_triton_timer",
                        lambda: lambda fn, quantiles: timed.append(fn()) or [1.0] * 3)
    _add_into("test._add_into_kernel")
    try:
        hook, tuner = cc._KERNELS["test._add_into_kernel"]
        assert len(hook(tuner.configs, {"x": torch.randn(8), "y": torch.zeros(8), "n": 8})) == 2
        assert hook.left == 2
        assert tuner.do_bench(lambda: "ran", quantiles=(0.5, 0.2, 0.8)) == [1.0] * 3
        assert timed == ["ran"]
    finally:
        cc._KERNELS.pop("test._add_into_kernel", None)


def test_an_accumulating_output_is_zeroed_before_each_timed_run_only_when_it_accumulates(cold):
    kernel = _add_into("test._add_into_kernel",
                       accumulates=lambda a: ("y",) if a.get("ADDS") else ())
    try:
        _, tuner = cc._KERNELS["test._add_into_kernel"]
        y = torch.ones(4)
        tuner.pre_hook({"y": y, "ADDS": False})
        assert torch.equal(y, torch.ones(4))
        tuner.pre_hook({"y": y, "ADDS": True}, reset_only=True)
        assert torch.equal(y, torch.zeros(4))
        assert kernel is tuner
    finally:
        cc._KERNELS.pop("test._add_into_kernel", None)


def test_fused_silu_dkdv_kernel_zeroes_dq_only_when_it_adds_into_it():
    """The one-kernel silu backward adds dq with atomics: timed runs start from zeros; the
    two-kernel path's dq (written by the dq kernel before dk/dv runs) is left alone."""
    _, tuner = cc._KERNELS["jagged_attention._bwd_dkdv_kernel"]
    dq = torch.ones(3)
    tuner.pre_hook({"DQ": dq, "FUSED_DQ": False})
    assert torch.equal(dq, torch.ones(3))
    tuner.pre_hook({"DQ": dq, "FUSED_DQ": True})
    assert torch.equal(dq, torch.zeros(3))


def test_a_cold_tuned_kernel_times_briefly_unless_autotuning_was_asked(cold, monkeypatch):
    """``tune_cold`` kernels tune inside the cold first step: their timer takes
    ``COLD_BENCH_MS``; ``--autotune`` gets Triton's full timing."""
    import triton.testing
    seen = []
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, **kw: seen.append(kw) or [1.0, 1.0, 1.0])
    monkeypatch.setattr(cc, "_triton_timer",
                        lambda: lambda fn, **kw: seen.append({"triton": kw}) or [1.0] * 3)
    kernel = _add_into("test._add_into_kernel", tune_cold=True)
    try:
        hook, _ = cc._KERNELS["test._add_into_kernel"]
        assert len(hook(kernel.configs, {"x": torch.randn(8), "y": torch.zeros(8), "n": 8})) == 2
        kernel.do_bench(lambda: None, quantiles=(0.5,))
        monkeypatch.setenv(cc.AUTOTUNE_ENV, "1")
        kernel.do_bench(lambda: None, quantiles=(0.5,))
        warmup, rep = cc.COLD_BENCH_MS
        assert seen == [{"warmup": warmup, "rep": rep, "quantiles": (0.5,)},
                        {"triton": {"quantiles": (0.5,)}}]
    finally:
        cc._KERNELS.pop("test._add_into_kernel", None)
