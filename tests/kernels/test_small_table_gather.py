"""``gemc::gather_rows``: a gather from a small table by many ids whose backward adds up per
block instead of one atomic per id, and the graph-mode rewrite that routes such gathers to
it (backends/torch/contended_gathers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gemc.backends.torch.contended_gathers import MIN_IDS_PER_ROW, route_contended_gathers
from gemc.backends.triton.small_table_gather import CHUNK, WIDE_ROWS, RowSumsLaunch, row_sums
from torch import nn

from gemc import ir
from tests.hopper_target import HOPPER_DRIVER

REPO = Path(__file__).resolve().parents[2]

STATIC = ("test_schema", "test_autograd_registration", "test_faketensor",
          "test_aot_dispatch_static")


@pytest.mark.parametrize("row_shape", [(), (3,)])
def test_row_sums_equal_index_add_with_ids_piled_on_one_row(row_shape) -> None:
    g = torch.Generator().manual_seed(0)
    n_rows, n = 37, CHUNK + 1000  # two programs, the second partial
    ids = torch.randint(0, n_rows, (n,), generator=g)
    ids[: n // 2] = 5  # half the ids on one row: the case atomics serialise on
    values = torch.randn(n, *row_shape, generator=g, dtype=torch.bfloat16)
    want = torch.zeros(n_rows, *row_shape).index_add_(0, ids, values.float())
    torch.testing.assert_close(row_sums(ids, values, n_rows), want, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(row_sums(ids.view(2, -1), values.view(2, n // 2, *row_shape),
                                        n_rows), want, rtol=1e-4, atol=1e-3)


def test_row_sums_of_relative_positions_visit_only_each_chunks_rows() -> None:
    """HSTU's position ids ``j - i + n - 1`` over a 1023-row table: each program's ids span
    a window of the rows (and the last one ends mid-table), the case the kernel narrows
    its row tiles to; a wrong window would drop sums."""
    n = 512
    i = torch.arange(n)
    ids = (i[None, :] - i[:, None] + n - 1).flatten()[: 3 * CHUNK + 77]
    g = torch.Generator().manual_seed(2)
    values = torch.randn(ids.numel(), generator=g)
    want = torch.zeros(2 * n - 1).index_add_(0, ids, values)
    torch.testing.assert_close(row_sums(ids, values, 2 * n - 1), want, rtol=1e-5, atol=1e-4)
    shifted = ids % 300 + 700  # every id in the table's last third, ending at its last row
    want = torch.zeros(1000).index_add_(0, shifted, values)
    torch.testing.assert_close(row_sums(shifted, values, 1000), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("wide", [False, True])
def test_row_sums_skip_zero_values_exactly(wide) -> None:
    """A bias's gradient over padded scores: whole runs of exact zeros (padding pairs),
    whose ids lie far from the live ones (HSTU's padding pairs have the largest time
    buckets). Skipping them gives index_add's sums: a ``-0.0`` changes nothing, a NaN
    still reaches its row, a row of only zeros stays 0; on both paths (``wide``: the live
    ids span more than ``WIDE_ROWS`` rows)."""
    g = torch.Generator().manual_seed(3)
    n_rows, n = (2 * WIDE_ROWS + 9, 2 * CHUNK + 300) if wide else (90, 2 * CHUNK + 300)
    live_rows = n_rows - 1 if wide else 40
    ids = torch.randint(0, live_rows, (n,), generator=g)
    values = torch.randn(n, generator=g)
    dead = torch.zeros(n, dtype=torch.bool)
    for start in range(0, n, 512):  # a query row's keys past its length: a run of zeros
        dead[start + int(torch.randint(100, 512, (1,), generator=g)): start + 512] = True
    dead[CHUNK: CHUNK + 700] = True  # whole blocks of zeros
    ids[dead] = n_rows - 1  # the padding pairs' bucket, far from the live ids
    values[dead] = 0.0
    values[dead.nonzero()[::7, 0]] = -0.0
    values[5] = float("nan")
    want = torch.zeros(n_rows).index_add_(0, ids, values)
    got = row_sums(ids, values, n_rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, equal_nan=True)
    assert got[ids[5]].isnan() and got[n_rows - 1] == 0.0


@pytest.mark.parametrize("launch", [RowSumsLaunch(), RowSumsLaunch(chunk=1024, block=256,
                                                                    warps=8)], ids=str)
def test_row_sums_both_paths_under_any_launch(launch) -> None:
    """A chunk spanning at most ``WIDE_ROWS`` rows sums in row tiles (from a tile that does
    not start at row 0, over several tiles); a wider one adds one atomic per id. Both, at
    the default launch and another one, equal index_add."""
    g = torch.Generator().manual_seed(3)
    n = 2 * CHUNK + 333
    narrow = torch.randint(600, 600 + WIDE_ROWS - 40, (n,), generator=g)
    wide = torch.randint(0, 1000, (n,), generator=g)
    values = torch.randn(n, 2, generator=g)
    for ids in (narrow, wide):
        want = torch.zeros(1000, 2).index_add_(0, ids, values)
        torch.testing.assert_close(row_sums(ids, values, 1000, launch), want,
                                   rtol=1e-5, atol=1e-4)


def test_gather_rows_op_matches_indexing_with_negative_ids_and_passes_opcheck() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(11, 2, generator=g, requires_grad=True)
    index = torch.randint(-11, 11, (6, 40), generator=g)
    torch.library.opcheck(torch.ops.gemc.gather_rows.default, (weight, index),
                          test_utils=STATIC)
    out = torch.ops.gemc.gather_rows(weight, index)
    ref = weight[index]
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, weight, w)[0],
                               torch.autograd.grad(ref, weight, w)[0])


class _RelativeBias(nn.Module):
    """HSTU-style relative bias: position and time-bucket tables, one id per token pair."""

    def __init__(self, n: int, buckets: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(2 * n - 1))
        self.ts = nn.Parameter(torch.randn(buckets + 1))
        self.proj = nn.Linear(4, 4)
        self.n, self.buckets = n, buckets

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(self.n)
        pos_bias = self.pos[idx[None, :] - idx[:, None] + self.n - 1]
        dt = (t[:, :, None] - t[:, None, :]).abs().clamp(min=1).float()
        bucket = (torch.log(dt) / 0.301).long().clamp(0, self.buckets)
        ts_bias = torch.index_select(self.ts, 0, bucket.view(-1)).view(dt.shape)
        scores = self.proj(x) @ x.transpose(1, 2) + pos_bias + ts_bias
        return torch.nn.functional.silu(scores).sum()


def test_the_rewrite_takes_small_table_gathers_by_semantics_and_keeps_gradients() -> None:
    n, buckets, batch = 128, 20, 3
    model = _RelativeBias(n, buckets)
    t = torch.cumsum(torch.randint(0, 500, (batch, n)), 1)
    t[0, n // 2:] = 0  # padding: every padding pair in bucket 0
    x = torch.randn(batch, n, 4)
    ep = torch.export.export(model, (t, x), strict=False)
    gm = ep.graph_module  # parameters are placeholders, as in the runner's captured graph
    fqns = ep.graph_signature.inputs_to_parameters
    order = [p.name for p in gm.graph.nodes if p.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.name in fqns:
            node.meta[ir.PARAM] = fqns[node.name]
    taken = route_contended_gathers(gm, tables=())
    assert sorted(r["param"] for r in taken) == ["pos", "ts"]
    assert all(r["ids"] >= MIN_IDS_PER_ROW * r["rows"] for r in taken)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    loss = gm(*[params[fqns[n]] for n in order if n in fqns], t, x)[0]
    loss.backward()
    ref = model(t, x)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-4, atol=1e-4)


def test_tables_and_big_weights_are_left_alone() -> None:
    model = nn.Embedding(100_000, 4)
    ids = torch.randint(0, 100_000, (64,))
    ep = torch.export.export(model, (ids,), strict=False)
    gm = ep.graph_module
    for node in gm.graph.nodes:
        if node.name in ep.graph_signature.inputs_to_parameters:
            node.meta[ir.PARAM] = "weight"
    assert route_contended_gathers(gm, tables=()) == []  # many rows, few ids per row


@pytest.mark.parametrize("span", ["narrow", "wide"])
def test_row_sums_wrap_negative_ids_in_the_kernel(span) -> None:
    """Ids in ``[-n, n)`` count from the end as ``weight[index]`` reads them, on both of the
    kernel's paths (row tiles and one atomic per id), a chunk's last partial block included."""
    g = torch.Generator().manual_seed(5)
    n_rows, n = 1000, CHUNK + 77
    if span == "narrow":  # every id within WIDE_ROWS rows at the table's end, half negative
        ids = torch.randint(n_rows - WIDE_ROWS + 40, n_rows, (n,), generator=g)
        ids = torch.where(torch.rand(n, generator=g) < 0.5, ids - n_rows, ids)
    else:
        ids = torch.randint(-n_rows, n_rows, (n,), generator=g)
    values = torch.randn(n, 3, generator=g)
    want = torch.zeros(n_rows, 3).index_add_(0, ids % n_rows, values)
    torch.testing.assert_close(row_sums(ids, values, n_rows), want, rtol=1e-5, atol=1e-4)


def test_gather_rows_passes_over_the_ids_once_forward_and_none_backward() -> None:
    """The op's forward gathers as the model wrote it (one ATen op reading the ids) and its
    backward hands the ids to the kernel as they are: no elementwise pass wraps negative
    ids first (three passes over ``B * L * L`` int64 ids, ~9 ms of HSTU's H100 step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.reading_ids: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            flat = [a for a in args if isinstance(a, torch.Tensor)]
            flat += [x for a in args if isinstance(a, (list, tuple)) for x in a
                     if isinstance(x, torch.Tensor)]
            if any(t is index or (t.dtype == index.dtype and t.shape == index.shape)
                   for t in flat):
                self.reading_ids.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(2)
    weight = torch.randn(37, 4, generator=g, requires_grad=True)
    index = torch.randint(-37, 37, (3, 5, 5), generator=g)
    from gemc.backends.triton import small_table_gather as stg

    seen = Seen()
    with seen:  # the ops' own implementations (a mode sees a custom op as one call)
        out = stg.gather_rows._init_fn(weight, index)
        grad = stg.gather_rows_backward._init_fn(torch.ones_like(out), index, 37,
                                                 weight.dtype)
    torch.testing.assert_close(out, weight[index])
    torch.testing.assert_close(grad, torch.zeros(37, 4).index_add_(
        0, index.reshape(-1) % 37, torch.ones(index.numel(), 4)))
    wrapping = [op for op in seen.reading_ids if op in ("aten.where", "aten.lt", "aten.add")]
    assert wrapping == [], seen.reading_ids
    assert seen.reading_ids.count("aten.index") == 1, seen.reading_ids


_HOPPER_ROW_SUMS = HOPPER_DRIVER + textwrap.dedent("""
    import sys
    from gemc.backends.triton import warm as W
    from gemc.backends.triton.small_table_gather import row_sums
    with W.dry_launches() as launches:
        for dtype in (torch.bfloat16, torch.float32):
            row_sums(torch.empty(3, 64, 64, dtype=torch.int64, device="meta"),
                     torch.empty(3, 64, 64, 4, dtype=dtype, device="meta"), 1023)
    errors = [r for r in map(W.compile_launch, launches) if r["error"]]
    print(len(launches), "launches", errors)
    sys.exit(1 if errors or len(launches) != 2 else 0)
""")


def test_the_row_sums_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    """The row-sums kernel (with its in-kernel wrap of negative ids) compiles for sm_90, no
    GPU needed: the interpreter runs what the GPU compiler may refuse."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _HOPPER_ROW_SUMS], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
