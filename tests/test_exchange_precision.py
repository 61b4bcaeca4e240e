"""The exchange's wire formats (gemc.exchange_precision, gemc.exchange_codec): exact round trips up to the
rounding, fp8's row scales the same rule as the stored tables', the SQNR the ``auto``
choice checks, and the plan's ``exchange`` block validated."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gemc.errors import PlanError
from gemc.exchange_codec import decode_rows, encode_rows, representative_sqnr_db
from gemc.exchange_precision import (
    CAST_BYTES_PER_ELEMENT,
    CAST_KERNELS,
    MIN_SQNR_DB,
    WirePrecision,
    wire_of_plan,
    wire_row_bytes,
)
from gemc.plan import validate_plan
from gemc.table_quant import dequantize_rows, quantize_rows


def _rows(widths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.tensor(widths, dtype=torch.int64)
    scales = torch.exp(torch.empty(len(widths)).uniform_(-5, 5, generator=gen))
    flat = torch.randn(int(w.sum()), generator=gen) * torch.repeat_interleave(scales, w)
    return flat, w


def test_fp8_rows_round_trip_as_the_tables_rowwise_rule():
    """Rows of mixed widths (a zero row, an empty one) packed in one uint8 tensor decode
    to exactly what quantising each row on its own with the tables' rule gives."""
    widths = [5, 8, 0, 3, 8]
    flat, w = _rows(widths)
    flat[5:13] = 0.0  # the second row all zero: scale 1, decoded exactly
    peers = [(13, 2), (0, 0), (11, 3)]  # (elements, rows) per destination
    wire = encode_rows(flat, w, "fp8", peers)
    assert wire.dtype == torch.uint8 and wire.numel() == sum(widths) + 4 * len(widths)
    # a destination's piece: its rows' e4m3 bytes, then their scales
    first = wire[:13 + 8]
    stored, scale = quantize_rows(flat[:5].view(1, 5), "fp8", stochastic=False)
    assert torch.equal(first[:5], stored.view(-1).view(torch.uint8))
    assert torch.equal(first[13:17].clone().view(torch.float32), scale)
    got = decode_rows(wire, w, "fp8", torch.float32, peers)
    at = 0
    for n in widths:
        if n == 0:  # nothing to compare (the tables' rule needs an element)
            continue
        row = flat[at:at + n].view(1, n)
        stored, scale = quantize_rows(row, "fp8", stochastic=False)
        torch.testing.assert_close(got[at:at + n], dequantize_rows(stored, scale).view(-1),
                                   rtol=0, atol=0)
        at += n
    assert torch.equal(got[5:13], torch.zeros(8))


def test_bf16_and_fp32_wires():
    flat, w = _rows([4, 6])
    assert encode_rows(flat, w, "fp32") is flat
    wire = encode_rows(flat, w, "bf16")
    assert wire.dtype == torch.bfloat16 and wire.numel() == flat.numel()
    back = decode_rows(wire, w, "bf16", torch.float32)
    torch.testing.assert_close(back, flat.to(torch.bfloat16).float(), rtol=0, atol=0)
    torch.testing.assert_close(back, flat, rtol=2 ** -8, atol=0)


def test_representative_sqnr_meets_the_bounds_and_orders_the_formats():
    for dim in (8, 128):
        bf16, fp8 = representative_sqnr_db("bf16", dim), representative_sqnr_db("fp8", dim)
        assert bf16 > MIN_SQNR_DB["bf16"] and fp8 > MIN_SQNR_DB["fp8"]
        assert fp8 < bf16 - 15  # 4 bits fewer, and the heavy-tailed rows lose to the scale


def test_wire_bytes_and_backward_pairing():
    assert wire_row_bytes("fp32", 128, 4) == 512
    assert wire_row_bytes("bf16", 128, 4) == 256
    assert wire_row_bytes("bf16", 128, 2) == 256  # a bf16 model's rows stay as they are
    assert wire_row_bytes("fp8", 128, 4) == 132
    assert WirePrecision.of("fp8") == WirePrecision("fp8", "bf16")
    assert WirePrecision.of("bf16") == WirePrecision("bf16", "bf16")
    with pytest.raises(ValueError, match="fp16"):
        WirePrecision.of("fp16")


def test_plan_records_the_exchange_and_validates_it(tmp_path):
    """A compile with --exchange-precision fp8 (the default planner: fixed, no solver
    needed) records it in the plan, prices it, and a bad block is refused by name."""
    from gemc.api import compile as gemc_compile
    from tests.conftest import TOY

    plan = gemc_compile(f"{TOY}:build", topology="h200:1x2", exchange_precision="fp8")
    assert plan["exchange"] == {"forward": "fp8", "backward": "bf16",
                                "reason": "fp8: fixed by --exchange-precision fp8"}
    assert wire_of_plan(plan) == WirePrecision("fp8", "bf16")
    default = gemc_compile(f"{TOY}:build", topology="h200:1x2")
    assert wire_of_plan(default) == WirePrecision()
    assert default["exchange"]["reason"].startswith("fp32: the default")
    sharded = any(t["sharding"] != "data_parallel" for t in plan["tables"])
    cast = plan["predicted"]["breakdown_ms"]["exchange_cast"]
    assert (cast > 0) == sharded and default["predicted"]["breakdown_ms"]["exchange_cast"] == 0
    del default["exchange"]  # a plan from before the block: fp32
    validate_plan(default)
    assert wire_of_plan(default) == WirePrecision()
    bad = copy.deepcopy(plan)
    bad["exchange"]["backward"] = "int8"
    with pytest.raises(PlanError, match="exchange.backward"):
        validate_plan(bad)


class _Traffic(TorchDispatchMode):
    """Counts the ops a cast runs and the bytes they read and write (eager: every op's
    inputs and outputs go through HBM); views and allocations move nothing."""

    FREE = ("aten.view", "aten.unsqueeze", "aten.reshape", "aten._unsafe_view", "aten.alias",
            "aten.lift_fresh", "aten.detach", "aten.split", "aten.slice", "aten.empty")

    def __init__(self) -> None:
        super().__init__()
        self.kernels, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        out = func(*args, **(kwargs or {}))
        if not str(func).startswith(self.FREE):
            self.kernels += 1
            tensors = [t for t in tree_flatten((args, kwargs, out))[0]
                       if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_cast_costs_the_cost_model_prices_are_what_the_cast_runs(precision):
    """CAST_KERNELS / CAST_BYTES_PER_ELEMENT (what the step model charges a direction of
    the exchange) against the ops encode + decode run on 4 peers' rows of width 128."""
    rows, dim = 1024, 128
    widths = torch.full((rows,), dim)
    flat = torch.randn(rows * dim)
    peers = [(rows * dim // 4, rows // 4)] * 4
    with _Traffic() as enc:
        wire = encode_rows(flat, widths, precision, peers)
    with _Traffic() as dec:
        decode_rows(wire, widths, precision, torch.float32, peers)
    assert enc.kernels + dec.kernels == CAST_KERNELS[precision]
    per_element = (enc.bytes + dec.bytes) / flat.numel()
    assert per_element == pytest.approx(CAST_BYTES_PER_ELEMENT[precision], rel=0.05)
