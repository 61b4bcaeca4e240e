"""BatchedEmbeddingBag with bf16 / fp8 (row-scaled e4m3) storage: lookups exact to the
dequantised weights, updates equal to the fp32 optimizer within one step of the storage grid,
and stochastic rounding unbiased (statistical tests with fixed seeds and bounds that a
round-to-nearest implementation fails)."""

from __future__ import annotations

import math

import pytest
import torch
from gemc.backends.triton.embedding_bag import BatchedEmbeddingBag
from gemc.backends.triton.embedding_bag_reference import (
    lazy_adam_step_,
    pooled_lookup_reference,
    rounding_bound,
    rowwise_adagrad_step_,
    touched_rows,
)
from kernel_helpers import fresh_generator, offsets_of, randn

from gemc.table_precision import weight_bytes
from gemc.table_quant import dequantize_rows, grid_step, quantize_rows, stochastic_round

TABLES = [(10, 8), (7, 20), (13, 16)]
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _batch(gen, batch=4, max_bag=4):
    """Drawn on the CPU (the generator's device), moved to the test device."""
    cpu = {"generator": gen, "device": "cpu"}
    lengths = torch.randint(0, max_bag + 1, (len(TABLES) * batch,), **cpu).tolist()
    ids = [torch.randint(0, TABLES[i // batch][0], (n,), **cpu) for i, n in enumerate(lengths)]
    return torch.cat(ids).to(torch.get_default_device()), offsets_of(lengths)


def _fp32_step(module, weights, state, ids, offsets, grad):
    """The optimizer's exact fp32 step from the module's current (dequantised) weights."""
    leaves = [w.clone().requires_grad_() for w in weights]
    pooled_lookup_reference(leaves, ids, offsets, None, module.pooling).backward(grad)
    exact = [w.clone() for w in weights]
    for w, leaf, s, rows in zip(exact, leaves, state, touched_rows(ids, offsets, len(TABLES))):
        if module.optimizer == "rowwise_adagrad":
            rowwise_adagrad_step_(w, leaf.grad, s["sum"], rows, module.lr, module.eps,
                                  module.weight_decay)
        else:
            lazy_adam_step_(w, leaf.grad, s["exp_avg"], s["exp_avg_sq"], rows, module.step,
                            module.lr, module.eps, module.betas, module.weight_decay)
    return exact


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_lookup_exact_and_update_within_rounding(precision, optimizer):
    gen = fresh_generator()
    module = BatchedEmbeddingBag(TABLES, optimizer=optimizer, lr=0.05, weight_decay=0.01,
                                 precision=precision, seed=3)
    assert module.weights.element_size() == (2 if precision == "bf16" else 1)
    for _ in range(3):
        ids, offsets = _batch(gen)
        weights = module.dequantized_weights()
        stored = [w.clone() for w in module.split_weights()]
        state = [{k: v.clone() for k, v in s.items()} for s in module.split_optimizer_state()]
        out = module(ids, offsets)
        torch.testing.assert_close(
            out, pooled_lookup_reference(weights, ids, offsets, None, module.pooling), **TOL)
        grad = randn(*out.shape, gen=gen)
        out.backward(grad)
        exact = _fp32_step(module, weights, state, ids, offsets, grad)
        for s, ms in zip(state, module.split_optimizer_state()):  # the fp32 state
            for key in s:
                torch.testing.assert_close(ms[key], s[key], **TOL)
        for t, (new, ref, old, now, rows) in enumerate(zip(
                module.dequantized_weights(), exact, stored, module.split_weights(),
                touched_rows(ids, offsets, len(TABLES)))):
            err = (new[rows] - ref[rows]).abs()
            bound = rounding_bound(ref[rows], precision)
            assert (err <= bound).all(), (
                f"table {t}: stored row off the exact update by {(err - bound).max():.3g} "
                "more than one grid step")
            untouched = torch.ones(new.shape[0], dtype=torch.bool)
            untouched[rows] = False
            assert torch.equal(now[untouched].view(torch.uint8), old[untouched].view(torch.uint8))


def test_rounding_is_unbiased_in_the_torch_reference():
    """E[round(x)] = x: the mean of 40k roundings of values between grid points lies within
    5 standard errors of x. Rounding to nearest misses by up to half a step (> 100 SE)."""
    gen = torch.Generator().manual_seed(1234)
    n = 40_000
    for precision, x in (("bf16", 1.0 - 0.0013), ("bf16", -3.3e-3), ("fp8", 100.7),
                         ("fp8", -0.0061), ("fp8", 0.0013)):  # the last: an e4m3 subnormal
        values = torch.full((n,), x, device="cpu")  # the reference: on the CPU
        step = float(grid_step(values[:1], precision))
        rounded = stochastic_round(values, precision, gen)
        assert set(torch.unique(rounded).tolist()) <= {
            math.floor(abs(x) / step) * step * math.copysign(1, x),
            math.ceil(abs(x) / step) * step * math.copysign(1, x)}
        assert torch.equal(rounded.to(_dtype(precision)).float(), rounded)  # on the grid
        se = step / 2 / math.sqrt(n)
        assert abs(rounded.mean().item() - x) < 5 * se, (precision, x)
        nearest = values.to(_dtype(precision)).float().mean().item()
        assert abs(nearest - x) > 5 * se  # the test can tell the two rules apart


def test_kernel_rounding_is_unbiased_for_updates_below_half_a_step():
    """Rows of one value per column parity and one gradient sign per parity: row-wise
    Adagrad's first step moves each element by exactly ``-lr * sign(g)``, about a quarter
    of the storage grid's step there (bf16 below 1.0; fp8 at 320/448 of the row's amax,
    which grows by ``lr`` and so rescales the row). Round-to-nearest would keep the bf16
    weights and land the fp8 ones a quarter step off; the mean over the ~8k independently
    rounded elements of a parity must be the exact update within 5 standard errors (one
    step / 2 / sqrt(n) bounds the standard error)."""
    rows, dim = 64, 256
    parity = torch.arange(dim) % 2 == 0
    for precision, w0, lr in (("bf16", 1.0, 1.0e-3), ("fp8", 320.0 / 448.0, 0.018)):
        module = BatchedEmbeddingBag([(rows, dim)], lr=lr, eps=0.0, precision=precision,
                                     seed=11)
        start = torch.full((rows, dim), w0)
        start[:, 0] = 1.0  # fp8: the row's amax (scale 1/448; w0 is then on the grid)
        module.load_weights([start])
        assert torch.equal(module.dequantized_weights()[0], start)
        out = module(torch.arange(rows), torch.arange(rows + 1))
        sign = torch.where(parity, 1.0, -1.0)
        sign[0] = -1.0  # the amax column grows: 1 + lr
        out.backward(sign.expand(rows, dim).contiguous())
        exact = start - lr * sign
        got = module.dequantized_weights()[0]
        step = rounding_bound(exact, precision)
        for cols in (parity.clone(), ~parity):
            cols[0] = False
            n = rows * int(cols.sum())
            se = float(step[:, cols].max()) / 2 / math.sqrt(n)
            bias = float((got[:, cols] - exact[:, cols]).mean())
            assert abs(bias) < 5 * se, (precision, bias / se)
        moved = (got != start).float().mean()
        assert moved > 0.01, f"{precision}: nothing moved (round to nearest?)"


def test_fp8_rows_take_a_fresh_scale_and_zero_rows_stay_finite():
    rows = torch.tensor([[0.0, 0.0, 0.0], [3.0, -0.5, 1e-4], [-900.0, 2.0, 0.0]], device="cpu")
    stored, scale = quantize_rows(rows, "fp8", torch.Generator().manual_seed(0))
    assert stored.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(scale, torch.tensor([1.0, 3.0 / 448, 900.0 / 448], device="cpu"))
    back = dequantize_rows(stored, scale)
    assert torch.isfinite(back).all()
    assert back[0].eq(0).all() and back[1, 0] == 3.0 and back[2, 0] == -900.0
    assert weight_bytes("fp8", 10, 8) == 10 * 8 + 40 and weight_bytes("bf16", 10, 8) == 160


def test_state_dict_round_trip_keeps_storage_and_scales():
    module = BatchedEmbeddingBag(TABLES, precision="fp8", seed=5)
    ids, offsets = _batch(torch.Generator().manual_seed(0))
    module(ids, offsets).sum().backward()
    copy = BatchedEmbeddingBag(TABLES, precision="fp8", seed=5)
    copy.load_state_dict(module.state_dict())
    for a, b in zip(copy.dequantized_weights(), module.dequantized_weights()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="table precision"):
        BatchedEmbeddingBag(TABLES, precision="int4")


def _dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float8_e4m3fn


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_initial_values_are_one_uniform_draw_per_table_and_fp32_is_never_copied(
        precision, monkeypatch):
    """The initialisation draws each table's Uniform(+-sqrt(1/rows)) in table order (what a
    seeded run starts from), rounded to nearest in the storage; fp32 tables are drawn and
    loaded in place, never through a table-sized temporary (a second copy of a 19-GiB
    shard ran the H100 out of memory in the eighteenth session)."""
    import gemc.backends.triton.embedding_bag as eb

    torch.manual_seed(3)
    drawn = [torch.empty(r, d).uniform_(-math.sqrt(1 / r), math.sqrt(1 / r)) for r, d in TABLES]
    if precision == "fp32":  # the fp32 path must not round-trip through quantize_rows
        monkeypatch.setattr(eb, "quantize_rows", lambda *a, **k: pytest.fail("copied"))
    torch.manual_seed(3)
    bag = BatchedEmbeddingBag(TABLES, precision=precision, device="cpu")
    for t, values in enumerate(drawn):
        expected, scale = quantize_rows(values, precision, stochastic=False) \
            if precision != "fp32" else (values, None)
        torch.testing.assert_close(bag.split_weights()[t], expected, rtol=0, atol=0)
        if scale is not None:
            torch.testing.assert_close(bag.split_row_scales()[t], scale, rtol=0, atol=0)
    again = BatchedEmbeddingBag(TABLES, precision=precision, device="cpu")
    again.load_weights(bag.dequantized_weights())  # stored values load back unchanged
    torch.testing.assert_close(again.weights.float(), bag.weights.float(), rtol=0, atol=0)
