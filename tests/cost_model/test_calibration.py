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
