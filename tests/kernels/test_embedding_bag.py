"""BatchedEmbeddingBag: pooled forward against F.embedding_bag, and the update fused into
backward against the optimizers written out in PyTorch (and against torch.optim.SparseAdam)."""

from __future__ import annotations

import pytest
import torch
from gemc.backends.triton.embedding_bag import BatchedEmbeddingBag
from gemc.backends.triton.embedding_bag_reference import (
    lazy_adam_step_,
    pooled_lookup_reference,
    rowwise_adagrad_step_,
    touched_rows,
)
from hypothesis import given
from hypothesis import strategies as st
from kernel_helpers import KERNEL_SETTINGS, SEEDS, fresh_generator, offsets_of, randn

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _batch(tables, batch, max_bag, gen, *, id_dtype=torch.int64, offset_dtype=torch.int64,
           weighted=False):
    """Random KJT-style input: table-major bags of 0..max_bag ids."""
    cpu = {"generator": gen, "device": "cpu"}
    lengths = torch.randint(0, max_bag + 1, (len(tables) * batch,), **cpu).tolist()
    ids = [torch.randint(0, tables[i // batch][0], (n,), **cpu) for i, n in enumerate(lengths)]
    ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device="cpu")
    psw = torch.rand(ids.numel(), **cpu) if weighted else None
    dev = torch.get_default_device()
    return (ids.to(dev, id_dtype), offsets_of(lengths, offset_dtype),
            None if psw is None else psw.to(dev))


class _Reference:
    """Per-table dense weights + the written-out optimizer, stepped like the module."""

    def __init__(self, module: BatchedEmbeddingBag):
        self.m = module
        self.weights = [w.detach().clone() for w in module.split_weights()]
        self.state = [{k: v.clone() for k, v in s.items()} for s in module.split_optimizer_state()]
        self.step = 0

    def forward_backward(self, ids, offsets, psw, grad):
        weights = [w.clone().requires_grad_() for w in self.weights]
        out = pooled_lookup_reference(weights, ids, offsets, psw, self.m.pooling)
        out.backward(grad)
        self.step += 1
        m = self.m
        for w, wg, s, rows in zip(self.weights, weights, self.state,
                                  touched_rows(ids, offsets, m.num_tables)):
            if m.optimizer == "rowwise_adagrad":
                rowwise_adagrad_step_(w, wg.grad, s["sum"], rows, m.lr, m.eps, m.weight_decay)
            else:
                lazy_adam_step_(w, wg.grad, s["exp_avg"], s["exp_avg_sq"], rows, self.step,
                                m.lr, m.eps, m.betas, m.weight_decay)
        return out.detach()

    def assert_matches(self, module):
        for t, (w, mw) in enumerate(zip(self.weights, module.split_weights())):
            torch.testing.assert_close(mw, w, **TOL, msg=lambda msg, t=t: f"table {t}: {msg}")
        for s, ms in zip(self.state, module.split_optimizer_state()):
            for key in s:
                torch.testing.assert_close(ms[key], s[key], **TOL)


def _output_grad(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """A random upstream gradient with one sign per column.

    Each element of a table's gradient then sums terms of one sign (per-sample weights are
    >= 0), so fp32 summation order moves it by a few ulps relative. With mixed signs a row
    used by several bags can cancel to ~1e-6, and Adam's update near its eps
    (step 1: g / (|g| + eps / sqrt(1 - beta2))) amplifies that rounding ~1e3-fold: the fused
    kernel and the reference then differ by 3e-5 on summation order alone (seen in CI).
    """
    sign = torch.where(torch.rand(shape[1], generator=gen) < 0.5, -1.0, 1.0)
    return randn(*shape, gen=gen).abs() * sign.to(torch.get_default_device())


def _train_and_compare(module, tables, batch, max_bag, gen, steps, **batch_kw):
    ref = _Reference(module)
    for _ in range(steps):
        ids, offsets, psw = _batch(tables, batch, max_bag, gen, **batch_kw)
        before = [w.clone() for w in module.split_weights()]
        out = module(ids, offsets, psw)
        assert out.shape == (batch, sum(d for _, d in tables))
        grad = _output_grad(out.shape, gen)
        out_ref = ref.forward_backward(ids, offsets, psw, grad)
        torch.testing.assert_close(out, out_ref, **TOL)
        out.backward(grad)
        ref.assert_matches(module)
        # Rows the batch did not use are bit-for-bit unchanged.
        for w, w0, rows in zip(module.split_weights(), before,
                               touched_rows(ids, offsets, len(tables))):
            untouched = torch.ones(w.shape[0], dtype=torch.bool)
            untouched[rows] = False
            assert torch.equal(w[untouched], w0[untouched])
    assert module.weights.grad is None and module.step == steps


TABLES = [(10, 8), (7, 20), (13, 16), (5, 3)]  # different dims, one not a power of two


def test_column_shards_eight_wide_match_reference():
    """A rank's shards of a 16-way column split of dim-128 tables (gemc.sharding's
    MIN_SHARD_DIM): every table 8 wide, so the tile is 16 lanes with half of them masked."""
    tables = [(40, 8), (25, 8), (9, 8)]
    gen = fresh_generator()
    module = BatchedEmbeddingBag(tables, pooling="sum", optimizer="rowwise_adagrad", lr=0.05)
    assert module.block_d == 16
    _train_and_compare(module, tables, batch=5, max_bag=7, gen=gen, steps=3, weighted=True)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_three_steps_match_reference(optimizer, pooling):
    gen = fresh_generator()
    module = BatchedEmbeddingBag(TABLES, pooling=pooling, optimizer=optimizer, lr=0.05,
                                 weight_decay=0.01 if pooling == "sum" else 0.0)
    _train_and_compare(module, TABLES, batch=4, max_bag=6, gen=gen, steps=3,
                       weighted=pooling == "sum")


@KERNEL_SETTINGS
@given(
    tables=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 32)), min_size=1,
                    max_size=3),
    batch=st.integers(0, 5),
    max_bag=st.integers(0, 6),
    pooling=st.sampled_from(["sum", "mean"]),
    optimizer=st.sampled_from(["rowwise_adagrad", "adam"]),
    weighted=st.booleans(),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
    offset_dtype=st.sampled_from([torch.int32, torch.int64]),
    lr=st.floats(1e-3, 0.5),
    steps=st.integers(1, 2),
    seed=SEEDS,
)
def test_property_matches_reference(tables, batch, max_bag, pooling, optimizer, weighted,
                                    id_dtype, offset_dtype, lr, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    module = BatchedEmbeddingBag(tables, pooling=pooling, optimizer=optimizer, lr=lr)
    _train_and_compare(module, tables, batch, max_bag, gen, steps, id_dtype=id_dtype,
                       offset_dtype=offset_dtype, weighted=weighted and pooling == "sum")


def test_adam_is_sparse_adam():
    """The fused lazy Adam equals nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam."""
    gen = fresh_generator()
    tables = [(9, 16), (6, 12)]
    module = BatchedEmbeddingBag(tables, pooling="mean", optimizer="adam", lr=0.1)
    bags = [torch.nn.EmbeddingBag(r, d, mode="mean", sparse=True) for r, d in tables]
    module.load_from_embedding_bags(bags)
    opt = torch.optim.SparseAdam([b.weight for b in bags], lr=0.1)
    for _ in range(3):
        ids, offsets, _ = _batch(tables, 3, 4, gen)
        out = module(ids, offsets)
        grad = _output_grad(out.shape, gen)
        out.backward(grad)
        opt.zero_grad()
        ref = torch.cat([b(ids[int(offsets[3 * t]):int(offsets[3 * t + 3])],
                           offsets[3 * t:3 * t + 3] - offsets[3 * t]) for t, b in enumerate(bags)],
                        dim=1)
        torch.testing.assert_close(out.detach(), ref.detach(), **TOL)
        ref.backward(grad)
        opt.step()
        for t, (w, b) in enumerate(zip(module.split_weights(), bags)):
            torch.testing.assert_close(w, b.weight.detach(), **TOL)
            st_ref = opt.state[b.weight]
            ms = module.split_optimizer_state()[t]
            torch.testing.assert_close(ms["exp_avg"], st_ref["exp_avg"], **TOL)
            torch.testing.assert_close(ms["exp_avg_sq"], st_ref["exp_avg_sq"], **TOL)


def test_all_bags_empty_gives_zeros_and_no_update():
    module = BatchedEmbeddingBag([(4, 8), (3, 5)], optimizer="adam")
    before = module.weights.clone()
    ids = torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(2 * 3 + 1, dtype=torch.int64)
    out = module(ids, offsets)
    assert out.shape == (3, 13) and torch.all(out == 0)
    out.sum().backward()
    assert torch.equal(module.weights, before) and module.step == 1


def test_duplicate_ids_accumulate_before_one_update():
    """Row-wise Adagrad is not additive: a row used twice gets one update with summed grad."""
    module = BatchedEmbeddingBag([(3, 4)], optimizer="rowwise_adagrad", lr=1.0)
    w0 = module.weights.clone().view(3, 4)
    ids = torch.tensor([1, 1, 1])
    offsets = torch.tensor([0, 2, 3])  # bag 0: row 1 twice; bag 1: row 1 once
    out = module(ids, offsets)
    grad = torch.ones_like(out)
    out.backward(grad)
    g = 3 * torch.ones(4)
    expected = w0[1] - g / (g.pow(2).mean().sqrt() + module.eps)
    torch.testing.assert_close(module.split_weights()[0][1], expected)
    torch.testing.assert_close(module.split_weights()[0][[0, 2]], w0[[0, 2]], atol=0, rtol=0)
    assert module.split_optimizer_state()[0]["sum"][1].item() == pytest.approx(9.0)


def test_no_grad_forward_does_not_update_and_module_has_no_parameters():
    gen = fresh_generator()
    module = BatchedEmbeddingBag(TABLES)
    assert list(module.parameters()) == []
    ids, offsets, _ = _batch(TABLES, 2, 3, gen)
    before = module.weights.clone()
    with torch.no_grad():
        out = module(ids, offsets)
    assert not out.requires_grad and torch.equal(module.weights, before)


def test_state_dict_round_trip_keeps_step_and_state():
    gen = fresh_generator()
    module = BatchedEmbeddingBag(TABLES, optimizer="adam")
    ids, offsets, _ = _batch(TABLES, 3, 4, gen)
    module(ids, offsets).sum().backward()
    clone = BatchedEmbeddingBag(TABLES, optimizer="adam")
    clone.load_state_dict(module.state_dict())
    assert clone.step == 1
    assert torch.equal(clone.weights, module.weights)
    assert torch.equal(clone.momentum2, module.momentum2)


def test_rejects_bad_inputs():
    module = BatchedEmbeddingBag([(4, 8), (3, 5)], pooling="mean")
    with pytest.raises(ValueError):
        module(torch.tensor([0]), torch.tensor([0, 1, 1, 1]))  # 3 bags for 2 tables
    with pytest.raises(ValueError):
        module(torch.tensor([0]), torch.tensor([0, 1, 1]), torch.ones(1))  # psw with mean
    with pytest.raises(ValueError):
        module.load_from_embedding_bags([torch.nn.EmbeddingBag(4, 8)] * 2)
    summed = BatchedEmbeddingBag([(4, 8)])
    with pytest.raises(ValueError):  # no gradient is computed for per-sample weights
        summed(torch.tensor([0]), torch.tensor([0, 1]), torch.ones(1, requires_grad=True))


def test_the_fused_update_compiles_once_for_every_steps_rounding_seed() -> None:
    """The stochastic rounding's seed changes every step; Triton specialises an int argument
    on its divisibility by 16, so without ``do_not_specialize`` the kernel compiled a
    second variant at the first step whose seed changed class (a ~0.3 s second step on
    the H200). Checked on the compiled (not interpreted) kernel object, in a process of its
    own: the interpreter drops the option."""
    import os
    import subprocess
    import sys

    code = ("from gemc.backends.triton import embedding_bag as eb\n"
            "k = eb._fused_update_kernel\n"
            "print(type(k).__name__, sorted(p.name for p in k.params if p.do_not_specialize))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split("\n")[-2]
    assert out == "JITFunction ['seed']"


def test_a_subset_launch_looks_up_and_updates_only_its_tables() -> None:
    """``forward(..., tables=[...])`` (the owners' fused lookup, one launch per bag count):
    the subset's columns of a full launch, and its backward moves only the subset's rows,
    at the caller's step count (``counts_steps`` False) with the gradient scaled
    (``grad_scale``), as a full launch of a gradient scaled by hand would."""
    gen = torch.Generator().manual_seed(3)
    tables = [(7, 8), (5, 16), (9, 8)]
    full = BatchedEmbeddingBag(tables, optimizer="adam", lr=0.1)
    part = BatchedEmbeddingBag(tables, optimizer="adam", lr=0.1)
    part.load_weights([w.clone() for w in full.split_weights()])
    part.counts_steps, part.grad_scale, part.step = False, 0.5, 4
    full.step = 4
    ids = torch.tensor([1, 4, 4, 0, 2, 3])  # table 2: bags [1, 4], [4]; table 0: [0, 2, 3]
    offsets = torch.tensor([0, 2, 3, 6, 6])  # two bags each, table-major, one empty
    before = [w.clone() for w in part.split_weights()]
    out = part(ids, offsets, tables=[2, 0])
    assert out.shape == (2, 16)
    # the full launch: table 1 empty, tables 0 and 2 with the same bags
    full_ids = torch.tensor([0, 2, 3, 1, 4, 4])
    full_offsets = torch.tensor([0, 3, 3, 3, 3, 5, 6])
    ref = full(full_ids, full_offsets)
    torch.testing.assert_close(out, torch.cat([ref[:, 24:32], ref[:, :8]], 1))
    grad = torch.randn(2, 16, generator=gen)
    out.backward(grad)
    full_grad = torch.zeros(2, 32)
    full_grad[:, 24:32], full_grad[:, :8] = grad[:, :8] * 0.5, grad[:, 8:] * 0.5
    ref.backward(full_grad)
    assert part.step == 4 and full.step == 5  # the caller counts the subset's steps
    for a, b in zip(part.split_weights(), full.split_weights()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(part.split_weights()[1], before[1])  # untouched table
    assert not torch.equal(part.split_weights()[0], before[0])
