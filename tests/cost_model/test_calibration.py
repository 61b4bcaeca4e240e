"""Calibration files: validation names the bad field; missing sections fall back."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from gemc.cost_model.calibration import (
    Calibration,
    CalibrationError,
    default_calibration,
    load_calibration,
)

from tests.cost_model.conftest import synthetic_calibration_dict


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(synthetic_calibration_dict()))
    cal = load_calibration(path)
    assert cal.gpu.name == "h200"
    assert 0 < cal.gemm_efficiency(4096, 4096, 4096, "bf16") <= 1
    assert cal.gemm_efficiency(4096, 4096, 4096, "fp8") is None  # not measured
    assert cal.collective_bus_bandwidth("all_reduce", 1e6, 8) is None
    assert cal.summary()["gpu"] == "h200"


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda d: d.pop("date"), "date"),
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d["gpu"].update(name="tpu"), "gpu.name"),
    (lambda d: d["launch"].update(kernel_s=-1), "launch.kernel_s"),
    (lambda d: d["gemm"]["bf16"].__setitem__(0, [1, 2]), "bf16[0]"),
    (lambda d: d["gemm"].update(int4=[]), "gemm.int4"),
    (lambda d: d["embedding_bag"][0].pop("rows"), "embedding_bag[0].rows"),
    (lambda d: d["attention"][1].update(q_len=0), "attention[1].q_len"),
])
def test_validation_names_the_field(mutate, field: str) -> None:
    d = copy.deepcopy(synthetic_calibration_dict())
    mutate(d)
    with pytest.raises(CalibrationError) as info:
        Calibration(d, source="cal.json")
    assert field in info.value.where, info.value.render()


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="cannot read"):
        load_calibration(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CalibrationError, match="invalid JSON"):
        load_calibration(tmp_path / "bad.json")


def test_default_calibration_is_none_or_valid() -> None:
    for name in ("a100", "h100", "h200", "b200", "unknown-gpu"):
        cal = default_calibration(name)
        assert cal is None or cal.gpu.name == name


def test_measured_collectives_are_used_inside_a_host() -> None:
    from gemc.cost_model.collectives import collective_time
    from gemc.cost_model.topology import parse_topology
    d = synthetic_calibration_dict()
    d["collectives"] = {"ranks": 8, "all_reduce": [[1e6, 50e-6], [1e9, 5e-3]]}
    cal = Calibration(d)
    topo = parse_topology("h200:2x8")
    t = collective_time("all_reduce", 1e9, 8, topo, calibration=cal)
    assert t == pytest.approx(5e-3, rel=1e-6)
    across = collective_time("all_reduce", 1e9, range(16), topo, calibration=cal)
    assert across == pytest.approx(collective_time("all_reduce", 1e9, range(16), topo))


def _with_eager_components(d: dict) -> dict:
    """The sections calibrate's eager_components adds: slower bf16 AdamW, masked SDPA,
    bf16 memory curves, skewed embedding bags."""
    d = copy.deepcopy(d)
    d["optimizer"]["adamw_foreach_bf16"] = [[b, 2 * t] for b, t in d["optimizer"]["adamw_foreach"]]
    d["attention_masked"] = [dict(r, masked=True, fwd_s=3 * r["fwd_s"], bwd_s=3 * r["bwd_s"])
                             for r in d["attention"]]
    d["pointwise_bf16"] = [[b, 2 * t] for b, t in d["pointwise"]]
    d["norm_bf16"] = [[b, 2 * f, 2 * g] for b, f, g in d["norm"]]
    d["embedding_bag_skewed"] = [dict(r, ids="skewed") for r in d["embedding_bag"]]
    return d


def test_eager_component_sections_are_validated() -> None:
    d = _with_eager_components(synthetic_calibration_dict())
    Calibration(d)
    d["embedding_bag_skewed"][0].pop("rows")
    with pytest.raises(CalibrationError) as info:
        Calibration(d)
    assert "embedding_bag_skewed[0].rows" in info.value.where
    d = _with_eager_components(synthetic_calibration_dict())
    d["norm_bf16"][0] = [1, 2]
    with pytest.raises(CalibrationError, match="3 positive numbers"):
        Calibration(d)


def test_dtype_and_mask_specific_measurements_are_used_where_present() -> None:
    from gemc.cost_model.hardware import get_gpu
    from gemc.cost_model.op_cost import attention_time, memory_time, optimizer_time
    gpu = get_gpu("h200")
    base = Calibration(synthetic_calibration_dict())
    more = Calibration(_with_eager_components(synthetic_calibration_dict()))
    # bf16 AdamW: its own curve (2x slower here) instead of the fp32 one
    t_base, _ = optimizer_time("adamw", 1e9, "bf16", gpu, base, tensors=16)
    t_more, _ = optimizer_time("adamw", 1e9, "bf16", gpu, more, tensors=16)
    assert t_more > 1.5 * t_base
    assert optimizer_time("adamw", 1e9, "fp32", gpu, more, tensors=16) == \
        optimizer_time("adamw", 1e9, "fp32", gpu, base, tensors=16)
    # masked attention: a masked node only; a bf16 one is priced by the fitted law
    # (cost_model.attention_fit) unless the calibration measured its very shape
    args = (64, 4, 512, 512, 64, False, "bf16", gpu)
    assert attention_time(*args, more) == attention_time(*args, base)
    law = attention_time(*args, base, masked=True)
    assert law[2] == "fitted" and law[0] > attention_time(*args, base)[0]
    rec = next(r for r in more.data["attention_masked"]
               if (r["batch"], r["q_len"]) != (64, 512))
    shape = (rec["batch"], rec["heads"], rec["q_len"], rec["kv_len"], rec["head_dim"])
    fwd, bwd, source = attention_time(*shape, False, rec["dtype"], gpu, more, masked=True)
    assert source == "calibrated" and fwd + bwd == pytest.approx(rec["fwd_s"] + rec["bwd_s"])
    assert attention_time(*shape, False, rec["dtype"], gpu, base, masked=True)[2] == "fitted"
    # bf16 pointwise and norm curves for bf16 ops, fp32 ones for fp32 ops
    assert memory_time(1e9, gpu, more, "pointwise", dtype="bf16")[0] > \
        1.5 * memory_time(1e9, gpu, base, "pointwise", dtype="bf16")[0]
    assert memory_time(1e9, gpu, more, "norm_bwd", dtype="fp32") == \
        memory_time(1e9, gpu, base, "norm_bwd", dtype="fp32")


def test_embedding_curves_by_dtype_are_a_switch(monkeypatch) -> None:
    d = synthetic_calibration_dict()
    d["embedding_bag"] += [dict(r, dtype="bf16", bwd_s=5 * r["bwd_s"]) for r in
                           d["embedding_bag"]]
    args = (256, 20.0, 1_000_000, 81920, "bwd")
    per_dtype = Calibration(d).embedding_efficiency(*args, "bf16")  # on by default
    monkeypatch.setattr(Calibration, "EMBEDDING_BY_DTYPE", False)
    pooled = Calibration(d).embedding_efficiency(*args, "bf16")
    assert Calibration(d).embedding_efficiency(*args) == pooled
    assert per_dtype < pooled
    monkeypatch.setattr(Calibration, "EMBEDDING_BY_DTYPE", True)
    assert Calibration(d).embedding_efficiency(*args, "fp8") == pooled  # none measured


def test_at_shape_embedding_measurements_replace_the_uniform_sweep() -> None:
    """With an embedding_bag_skewed section the curves come from it alone (3x slower
    here, so 3x less efficient); without one, from the uniform sweep."""
    d = synthetic_calibration_dict()
    args = (512, 10.0, 1_000_000, 81920, "fwd", "fp32")
    uniform = Calibration(d).embedding_efficiency(*args)
    d["embedding_bag_skewed"] = [dict(r, ids="skewed", fwd_s=3 * r["fwd_s"],
                                      bwd_s=3 * r["bwd_s"]) for r in d["embedding_bag"]]
    skewed = Calibration(d).embedding_efficiency(*args)
    assert skewed == pytest.approx(uniform / 3, rel=0.1)  # less the launch gap


def test_embedding_dispatch_is_read_off_launch_bound_measurements() -> None:
    """The CPU cost of an eager EmbeddingBag call: the median of the measurements far
    above their traffic at peak bandwidth; big, GPU-bound ones do not count; none: None."""
    d = synthetic_calibration_dict()
    d["embedding_bag"] = []
    assert Calibration(d).embedding_dispatch_s("bwd") is None
    small = {"rows": 1000, "dim": 32, "bags": 1024, "bag_size": 1, "dtype": "fp32"}
    d["embedding_bag_skewed"] = [
        dict(small, fwd_s=f, bwd_s=b) for f, b in ((15e-6, 200e-6), (20e-6, 300e-6),
                                                  (25e-6, 400e-6))]
    d["embedding_bag_skewed"].append({"rows": 50_000_000, "dim": 128, "bags": 65536,
                                      "bag_size": 100, "dtype": "fp32", "fwd_s": 5e-3,
                                      "bwd_s": 20e-3})  # GPU-bound: ignored
    cal = Calibration(d)
    assert cal.embedding_dispatch_s("bwd") == pytest.approx(300e-6)
    assert cal.embedding_dispatch_s("fwd") == pytest.approx(20e-6)


def test_eager_dispatch_prices_an_embedding_backward_as_many_kernels() -> None:
    from gemc.cost_model.eager import EMBEDDING_BWD_KERNELS, dispatch_costs
    d = synthetic_calibration_dict()
    d["embedding_bag"] = []
    disp = dispatch_costs(Calibration(d))  # nothing dispatch-bound measured
    assert disp["embedding_bwd_s"] == pytest.approx(EMBEDDING_BWD_KERNELS *
                                                    disp["eager_bwd_op_s"])
    assert dispatch_costs(None)["embedding_bwd_s"] > 10 * dispatch_costs(None)["eager_bwd_op_s"]
    d["embedding_bag_skewed"] = [{"rows": 1000, "dim": 32, "bags": 1024, "bag_size": 1,
                                  "dtype": "fp32", "fwd_s": 1e-6, "bwd_s": 400e-6}]
    disp = dispatch_costs(Calibration(d))
    assert disp["embedding_bwd_s"] == pytest.approx(400e-6)
    assert disp["embedding_fwd_s"] == disp["eager_op_s"]  # never below a plain op


def test_host_syncing_ops_are_recognised() -> None:
    import torch
    from gemc.cost_model.eager import syncs_host
    from torch import fx
    g = fx.Graph()
    x = g.placeholder("x")
    rep = g.call_function(torch.ops.aten.repeat_interleave.self_Tensor, (x, x),
                          {"output_size": 8})
    nz = g.call_function(torch.ops.aten.nonzero.default, (x,))
    add = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    rep_int = g.call_function(torch.ops.aten.repeat_interleave.self_int, (x, 2))
    assert syncs_host(rep) and syncs_host(nz)
    assert not syncs_host(add) and not syncs_host(rep_int)
