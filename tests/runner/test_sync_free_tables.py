"""The sparse optimizer on one rank without a host sync (issue 16, item 3), both table routes.

``sparse``: a local lookup with a padding row keeps the padding ids in its sparse gradient
(no ``nonzero`` in the backward) and the optimizer sums the gradient's rows by sort and
segment (no ``coalesce``); ``dense_grad``: one masked pass over the table-sized gradient
(no ``abs().sum(1)``, no ``nonzero``). Checked: (a) weights and optimizer state equal the
reference's reading (:func:`coalesced_rows`, which syncs) after a few steps; (b) no op that
makes the host wait on the device runs in the backward and the optimizer step, with a
detector that does flag the reference's reading.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.torch.embedding import ShardedEmbedding
from gemc.backends.torch.sparse_optim import (
    EmbeddingOptimConfig,
    EmbeddingOptimizer,
    RowState,
    coalesced_rows,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROWS, DIM, PAD = 40, 6, 3

# ATen ops whose output shape or value the host must read from the device (a blocking sync
# on CUDA) unless given a static size
SYNCING_OPS = {"nonzero", "nonzero_numpy", "_unique", "_unique2", "unique_dim",
               "unique_consecutive", "coalesce", "_coalesce", "_local_scalar_dense", "item",
               "masked_select", "is_nonzero", "equal", "bincount"}


class SyncOps(TorchDispatchMode):
    """Records the ops run under it that would make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        overload = func._overloadpacket.__name__
        if name in SYNCING_OPS or overload in SYNCING_OPS:
            self.found.append(str(func))
        elif overload in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.found.append(f"{func} with a boolean mask")
        elif overload == "repeat_interleave" and kwargs.get("output_size") is None \
                and (len(args) < 4 or args[3] is None) and isinstance(args[0], torch.Tensor) \
                and args[0].dtype != torch.bool and len(args) >= 1 and func.__name__ == "Tensor":
            self.found.append(f"{func} without output_size")
        return func(*args, **kwargs)


def _table(source: nn.Module) -> ShardedEmbedding:
    """A one-rank table-wise shard of ``source``, holding its weights."""
    plan_table = {"fqn": "t.weight", "rows": ROWS, "dim": DIM, "sharding": "table_wise",
                  "shards": [{"rank": 0, "row_offset": 0, "rows": ROWS, "col_offset": 0,
                              "cols": DIM}]}
    table = ShardedEmbedding(source, plan_table, rank=0, world_size=1, seed=0)
    table.to_empty(device="cpu")
    with torch.no_grad():
        table.weight.copy_(source.weight)
    return table


def _batches(steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Ids with repeats, the padding id among them, and rows never looked up (ids < 20)."""
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 20, (4, 5), generator=gen)
        ids[0, :3] = PAD
        out.append(ids)
    out.append(torch.full((4, 5), PAD))  # a step of padding only: nothing may move
    return out


def _source(kind: str, gen: torch.Generator) -> nn.Module:
    if kind == "embedding":
        m = nn.Embedding(ROWS, DIM, padding_idx=PAD)
    else:
        m = nn.EmbeddingBag(ROWS, DIM, mode=kind, padding_idx=PAD)
    with torch.no_grad():
        m.weight.copy_(torch.randn(ROWS, DIM, generator=gen))
    return m


def _loss(out: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    return (out * probe[: out.numel()].reshape(out.shape)).sum()


def _lookups(kind: str, lookup, ids: torch.Tensor, psw: torch.Tensor):  # noqa: ANN001
    """Two calls a step (the gradient adds up over lookups, as HSTU's three)."""
    if kind == "embedding":
        return [lookup(ids), lookup(ids.flip(0))]
    flat = ids.reshape(-1)
    offsets = torch.tensor([0, 4, 4, 11])  # an empty bag, and the last runs to the end
    weights = psw if kind == "sum" else None
    return [lookup(flat, offsets, weights), lookup(ids)]


def _reference_step(weight: nn.Parameter, state: RowState, cfg: EmbeddingOptimConfig,
                    step: int) -> None:
    """The single-process reference's step (backends/torch/reference.py), which syncs."""
    rows, g = coalesced_rows(weight.grad)
    if rows.numel():
        state.apply(weight.data, rows, g, cfg, step, DIM)
    weight.grad = None


def _assert_same(opt: EmbeddingOptimizer, table: ShardedEmbedding, ref: nn.Module,
                 ref_state: RowState) -> None:
    torch.testing.assert_close(table.weight.data, ref.weight.data)
    for name, tensor in ref_state.tensors.items():
        torch.testing.assert_close(opt.state["t.weight"].tensors[name], tensor)


CASES = [(kind, opt, wd) for kind in ("embedding", "sum", "mean")
         for opt in ("rowwise_adagrad", "adam") for wd in (0.0, 0.01)]


@pytest.mark.parametrize("kind,optimizer,weight_decay", CASES)
def test_sparse_route_equals_the_reference_without_a_sync(kind: str, optimizer: str,
                                                          weight_decay: float) -> None:
    gen = torch.Generator().manual_seed(1)
    ref = _source(kind, gen)
    ref.sparse = True
    table = _table(_source(kind, torch.Generator().manual_seed(1)))
    cfg = EmbeddingOptimConfig(kind=optimizer, lr=0.05, weight_decay=weight_decay)
    ref_state = RowState(ref.weight.data, optimizer)
    opt = EmbeddingOptimizer({"t.weight": table}, cfg, world_size=1)
    probe = torch.randn(256, generator=gen)
    psw = torch.rand(20, generator=gen)
    for step, ids in enumerate(_batches(3, gen), start=1):
        expected = _lookups(kind, ref, ids, psw)
        outs = _lookups(kind, table, ids, psw)
        for o, expect in zip(outs, expected):
            torch.testing.assert_close(o, expect)  # the forward is torch's
        sum(_loss(o, probe) for o in expected).backward()
        _reference_step(ref.weight, ref_state, cfg, step)

        syncs = SyncOps()
        with syncs:
            sum(_loss(o, probe) for o in outs).backward()
            opt.step()
        opt.zero_grad()
        assert not syncs.found, syncs.found
        _assert_same(opt, table, ref, ref_state)
    assert torch.equal(table.weight.data[20:], ref.weight.data[20:])  # never looked up
    assert torch.equal(table.weight.data[PAD], _source(kind, torch.Generator().manual_seed(1))
                       .weight.data[PAD])  # the padding row is never updated


@pytest.mark.parametrize("optimizer,weight_decay",
                         [(o, wd) for o in ("rowwise_adagrad", "adam") for wd in (0.0, 0.01)])
def test_dense_gradient_route_equals_the_reference_without_a_sync(optimizer: str,
                                                                  weight_decay: float) -> None:
    """The graph's own lookup (``sparse=False``) leaves a table-sized gradient; rows whose
    gradient is zero (never looked up, or the padding row) keep their values and state."""
    gen = torch.Generator().manual_seed(2)
    ref = _source("embedding", gen)
    table = _table(_source("embedding", torch.Generator().manual_seed(2)))
    cfg = EmbeddingOptimConfig(kind=optimizer, lr=0.05, weight_decay=weight_decay)
    ref_state = RowState(ref.weight.data, optimizer)
    opt = EmbeddingOptimizer({"t.weight": table}, cfg, world_size=1)
    probe = torch.randn(256, generator=gen)
    for step, ids in enumerate(_batches(3, gen), start=1):
        _loss(ref(ids), probe).backward()
        _reference_step(ref.weight, ref_state, cfg, step)

        syncs = SyncOps()
        with syncs:
            _loss(F.embedding(ids, table.weight, PAD), probe).backward()
            assert not table.weight.grad.is_sparse
            opt.step()
        opt.zero_grad()
        assert not syncs.found, syncs.found
        _assert_same(opt, table, ref, ref_state)
    assert torch.equal(table.weight.data[20:], ref.weight.data[20:])


def test_the_detector_flags_the_syncing_reading() -> None:
    """Today's reference reading of both gradients (torch's sparse backward with a padding
    row, ``coalesce``; the dense scan's ``nonzero``) is what the tests above rule out."""
    weight = torch.randn(ROWS, DIM, requires_grad=True)
    ids = torch.tensor([[1, PAD, 2, 1]])
    for sparse in (True, False):
        syncs = SyncOps()
        with syncs:
            F.embedding(ids, weight, PAD, sparse=sparse).sum().backward()
            coalesced_rows(weight.grad)
        weight.grad = None
        names = " ".join(syncs.found)
        if sparse:  # the padding ids dropped by a mask, then the coalesce
            assert "boolean mask" in names and "coalesce" in names, names
        else:
            assert "nonzero" in names and "coalesce" not in names, names


@pytest.mark.parametrize("n,rows,skip", [(100, 8, None), (100, 8, 2), (5, 50, 1), (6, 9, 4)])
def test_summed_rows_are_coalesces_rows_in_static_shape(n: int, rows: int,
                                                        skip: int | None) -> None:
    """More ids than rows (slots capped at one a row), fewer, and a skipped (padding) row;
    the last case looks up the skipped row only: nothing is live."""
    from gemc.backends.torch.sparse_optim import summed_rows

    gen = torch.Generator().manual_seed(n + rows)
    ids = torch.randint(0, rows, (n,), generator=gen) if n != 6 else torch.full((n,), skip)
    values = torch.randn(n, 3, generator=gen)
    got = summed_rows(ids, values, rows, skip)
    assert got is not None and got.rows.numel() == min(n, rows)
    keep = ids != skip if skip is not None else torch.ones(n, dtype=torch.bool)
    ref = torch.sparse_coo_tensor(ids[keep].unsqueeze(0), values[keep], (rows, 3),
                                  check_invariants=True).coalesce()
    distinct = ref.indices()[0]
    assert bool(got.live) == bool(distinct.numel())
    if distinct.numel():
        k = distinct.numel()
        assert torch.equal(got.rows[:k], distinct)
        torch.testing.assert_close(got.grads[:k], ref.values())
        # the slots past the distinct rows repeat the last one, with its gradient
        assert torch.equal(got.rows[k:], distinct[-1].expand(got.rows.numel() - k))
        assert torch.equal(got.grads[k:], got.grads[k - 1].expand(got.rows.numel() - k, 3))
    assert summed_rows(ids[:0], values[:0], rows, skip) is None


@pytest.mark.parametrize("optimizer,weight_decay,flags",
                         [(o, wd, f) for o in ("rowwise_adagrad", "adam") for wd in (0.0, 0.01)
                          for f in (False, True)])
def test_masked_update_in_aten_equals_the_kernel(optimizer: str, weight_decay: float,
                                                 flags: bool) -> None:
    """The masked pass's CPU form (ATen, where Triton's interpreter is off) and its kernel
    update the same rows alike; a row with a NaN gradient counts as used, one of -0.0 not.
    With ``flags`` (a replica's used rows): exactly the flagged rows, zero gradient or not."""
    from gemc.backends.triton import masked_row_update as masked

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 5, generator=gen)
    grad = torch.randn(50, 5, generator=gen)
    grad[::3] = 0.0
    grad[1] = -0.0
    grad[2, 1] = float("nan")
    used = None
    if flags:  # every 4th row unused; zero-gradient rows among the used ones
        used = torch.ones(50)
        used[::4] = 0.0
        grad[2, 1] = 0.0
    args = dict(optimizer=optimizer, lr=0.05, eps=1e-8, betas=(0.9, 0.999),
                weight_decay=weight_decay, step_size=0.02, used=used)
    results = []
    for aten in (False, True):
        w = weight.clone()
        state = ({"sum": torch.rand(50, generator=torch.Generator().manual_seed(4))}
                 if optimizer == "rowwise_adagrad" else
                 {"exp_avg": torch.zeros(50, 5), "exp_avg_sq": torch.zeros(50, 5)})
        if aten:
            s1 = state.get("sum", state.get("exp_avg"))
            s2 = state.get("exp_avg_sq", s1)
            masked._masked_row_update_aten(w, grad, s1, s2, optimizer == "adam", 0.05, 1e-8,
                                           (0.9, 0.999), weight_decay, 0.02, used)
        else:
            masked.masked_row_update_(w, grad, state, **args)
        results.append((w, state))
    (w_kernel, s_kernel), (w_aten, s_aten) = results
    torch.testing.assert_close(w_kernel, w_aten, equal_nan=True)
    for name in s_kernel:
        torch.testing.assert_close(s_kernel[name], s_aten[name], equal_nan=True)
    if flags:
        unused = list(range(0, 50, 4))
        assert torch.equal(w_kernel[unused], weight[unused])
        assert not torch.isnan(w_kernel).any()  # (row 2's NaN cleared above)
        if weight_decay:  # the flagged zero-gradient rows were updated: decay moved them
            zero_used = [i for i in range(3, 50, 3) if i % 4]
            assert not torch.equal(w_kernel[zero_used], weight[zero_used])
        return
    unused = [i for i in range(50) if i % 3 == 0 and i != 0] + [1]
    assert torch.equal(w_kernel[unused], weight[unused])
    assert torch.isnan(w_kernel[2]).any()  # the NaN row was updated (and poisoned)


def _replica(seed: int, padding: bool) -> tuple[nn.Embedding, ShardedEmbedding]:
    """(a reference nn.Embedding, this rank's data-parallel replica of it, one of two)."""
    from gemc.sharding import make_shards

    ref = nn.Embedding(ROWS, DIM, padding_idx=PAD if padding else None, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed)))
    plan_table = {"fqn": f"t{seed}.weight", "rows": ROWS, "dim": DIM,
                  "sharding": "data_parallel",
                  "shards": make_shards("data_parallel", [0, 1], ROWS, DIM)}
    table = ShardedEmbedding(ref, plan_table, rank=0, world_size=2, seed=0)
    table.to_empty(device="cpu")
    with torch.no_grad():
        table.weight.copy_(ref.weight)
    return ref, table


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_replicas_reduce_in_one_all_reduce_without_a_sync(optimizer: str,
                                                          one_process_group) -> None:  # noqa: ANN001
    """Two data-parallel tables (a padding row in one) step in ONE all-reduce and masked
    updates, no host sync, equal to the reference; a row whose summed gradient is exactly
    zero (two lookups that cancel) is still updated, as the reference's sparse gradient
    lists it (lazy Adam moves it by its moments: the masked update's own rule, a gradient
    not all zero, would leave it)."""
    from gemc.backends.torch.comm import count_calls

    pairs = {f"t{s}.weight": _replica(s, padding=s == 1) for s in (1, 2)}
    cfg = EmbeddingOptimConfig(kind=optimizer, lr=0.05)
    ref_states = {f: RowState(ref.weight.data, optimizer) for f, (ref, _) in pairs.items()}
    opt = EmbeddingOptimizer({f: table for f, (_, table) in pairs.items()}, cfg, world_size=2)
    reduces = count_calls("all_reduce")
    gen = torch.Generator().manual_seed(3)
    ids = [torch.tensor([[5, 7, PAD, 5]]), torch.tensor([[5, 5, 9, PAD]])]
    probes = [torch.randn(1, 4, DIM, generator=gen) for _ in ids]
    probes[1][0, 1] = -probes[1][0, 0]  # step 2: row 5's two gradients cancel exactly
    for step, (x, probe) in enumerate(zip(ids, probes), start=1):
        reduces[0] = 0
        syncs = SyncOps()
        with syncs:
            for _, table in pairs.values():
                (table(x) * probe).sum().backward()
            opt.step()
        opt.zero_grad()
        assert not syncs.found, syncs.found
        assert reduces[0] == 1  # both replicas in one collective
        for fqn, (ref, table) in pairs.items():
            (ref(x) * probe).sum().backward()
            ref.weight.grad = ref.weight.grad * 0.5  # the mean over the two ranks
            _reference_step(ref.weight, ref_states[fqn], cfg, step)
            torch.testing.assert_close(table.weight.data, ref.weight.data)
            for name, tensor in ref_states[fqn].tensors.items():
                torch.testing.assert_close(opt.state[fqn].tensors[name], tensor)
        if step == 1:
            before = {f: table.weight.data.clone() for f, (_, table) in pairs.items()}
    # row 5's step-2 gradient summed to zero: lazy Adam still moved it (its moments),
    # row-wise Adagrad left it (a zero step); the padding row never moved
    moved = not torch.equal(before["t2.weight"][5], pairs["t2.weight"][1].weight.data[5])
    assert moved == (optimizer == "adam")
    assert torch.equal(pairs["t1.weight"][1].weight.data[PAD],
                       _replica(1, padding=True)[1].weight.data[PAD])


@pytest.mark.parametrize("grouped", [True, False])
def test_the_replicas_masked_update_is_warmed_as_it_launches(grouped: bool,
                                                             one_process_group) -> None:  # noqa: ANN001
    """The warm-up's derivation (graph mode's first step) of the replicas' masked pass:
    the launch a real step makes (used-row flags given), and none on one rank's list: one
    for the two replicas' group (replica_groups), one a replica on their own."""
    from gemc.backends.triton import warm as W

    tables = {f"t{s}.weight": _replica(s, padding=False)[1] for s in (1, 2)}
    opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(kind="adam"), world_size=2,
                             batched_replicas=grouped)
    with W.dry_launches() as derived:
        opt.warm_dense([])
    for table in tables.values():
        table(torch.tensor([[1, 2, 2]])).sum().backward()
    with W.record_launches() as launched:
        opt.step()
    assert len(launched) == (1 if grouped else len(tables)) == len(derived)
    assert {W.signature(x) for x in derived} == {W.signature(x) for x in launched}


def test_a_replica_of_a_bf16_model_table_steps_as_the_reference(one_process_group) -> None:  # noqa: ANN001
    """A model whose table is bf16 itself (plan precision "fp32": the model's own dtype)
    has no fp32 weight for the masked pass: its replica steps through the rows, as the
    reference does, and rows no rank used stay as they are."""
    ref, table = _replica(3, padding=False)
    ref.to(torch.bfloat16)
    table.weight.data = table.weight.data.to(torch.bfloat16)
    cfg = EmbeddingOptimConfig(kind="rowwise_adagrad", lr=0.05)
    ref_state = RowState(ref.weight.data, cfg.kind)
    opt = EmbeddingOptimizer({"t3.weight": table}, cfg, world_size=2)
    ids = torch.tensor([[1, 2, 2, 5]])
    probe = torch.randn(1, 4, DIM, generator=torch.Generator().manual_seed(3)).to(
        torch.bfloat16)
    (table(ids) * probe).sum().backward()
    opt.step()
    (ref(ids) * probe).sum().backward()
    ref.weight.grad = ref.weight.grad * 0.5
    _reference_step(ref.weight, ref_state, cfg, 1)
    assert table.weight.dtype == torch.bfloat16
    torch.testing.assert_close(table.weight.data, ref.weight.data)
    # the reference sums the duplicated row's bf16 gradients in bf16 (coalesce), the
    # bucket in fp32 (as summed_rows did): the summed gradient differs by up to bf16's
    # relative rounding (2^-8), its square in the accumulator by twice that
    torch.testing.assert_close(opt.state["t3.weight"].tensors["sum"], ref_state.tensors["sum"],
                               rtol=2 * 2**-8, atol=1e-5)
    assert torch.equal(table.weight.data[6:], ref.weight.data[6:])  # never looked up
