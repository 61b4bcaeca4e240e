"""Topology: spec strings, files, round-trips and one clear error per bad field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gemc.cost_model.hardware import GPUS, get_gpu
from gemc.cost_model.topology import Topology, parse_topology
from hypothesis import given, settings
from hypothesis import strategies as st

from gemc.errors import TopologyError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"


def test_get_gpu_is_case_insensitive_and_knows_device_names() -> None:
    assert get_gpu("H200") is GPUS["h200"]
    assert get_gpu("NVIDIA H100 80GB HBM3").name == "h100"
    assert get_gpu("NVIDIA A100-SXM4-80GB").name == "a100"
    with pytest.raises(TopologyError) as info:
        get_gpu("v100")
    assert "h200" in info.value.fix and "b200" in info.value.fix


def test_specs_are_dense_and_ordered_as_datasheets_say() -> None:
    for spec in GPUS.values():
        assert spec.fp32_flops < spec.tf32_flops < spec.bf16_flops
        assert spec.bf16_flops == spec.fp16_flops
        assert spec.source
    assert get_gpu("h200").bf16_flops == pytest.approx(989.5e12)
    assert get_gpu("h200").hbm_bandwidth == pytest.approx(4.8e12)
    assert get_gpu("a100").peak_flops("fp8") == get_gpu("a100").bf16_flops  # no FP8 cores


def test_spec_string_builds_ranks_and_graph() -> None:
    topo = parse_topology("h200:2x8")
    assert (topo.hosts, topo.gpus_per_host, topo.world_size) == (2, 8, 16)
    assert topo.gpu_node(9) == "gpu:1:1"
    g = topo.graph
    assert g.nodes["gpu:1:1"]["rank"] == 9
    assert g.edges["gpu:0:3", "nvswitch:0"]["bandwidth"] == pytest.approx(450e9)
    assert g.edges["nic:0:3", "leaf:0:3"]["bandwidth"] == pytest.approx(50e9)
    assert topo.tier_latency["intra_host"] < topo.tier_latency["inter_host"]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ("h200", None), ("h200:2x", None), ("h200:0x8", "hosts"), ("foo:1x8", "gpu"),
        ("h200:1x9", "gpus_per_host"), ("h200:1x0", "gpus_per_host"), ("", None),
    ],
)
def test_malformed_specs_raise_one_named_error(spec: str, field: str | None) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(spec)
    assert info.value.fix
    if field:
        assert f"field '{field}'" in info.value.where


BAD_FILES = [
    ({"hosts": 1, "gpus_per_host": 8}, "gpu"),
    ({"gpu": "h200", "gpus_per_host": 8}, "hosts"),
    ({"gpu": "h200", "hosts": 1}, "gpus_per_host"),
    ({"gpu": "x9000", "hosts": 1, "gpus_per_host": 8}, "gpu"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 16}, "gpus_per_host"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 8, "nvlink_gbyte_s": 0}, "nvlink_gbyte_s"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 8, "network": {"nic_gbit_s": -400}},
     "network.nic_gbit_s"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 8, "network": {"nics_per_host": 0}},
     "network.nics_per_host"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 8, "network": {"oversubscription": 0.5}},
     "network.oversubscription"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 8, "network": {"nic_speed": 400}},
     "network.nic_speed"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 8, "latency_us": {"nic": -1}},
     "latency_us.nic"),
    ({"gpu": "h200", "hosts": "two", "gpus_per_host": 8}, "hosts"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 8, "world_size": 9}, "world_size"),
    ({"gpu": "h200", "hosts": 1, "gpus_per_host": 8, "bogus": 1}, "bogus"),
]


@pytest.mark.parametrize(("doc", "field"), BAD_FILES)
def test_bad_topology_files_name_the_field(tmp_path: Path, doc: dict, field: str) -> None:
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TopologyError) as info:
        parse_topology(str(path))
    assert f"field '{field}'" in info.value.where, info.value.render()
    assert str(path) in info.value.where


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read"):
        parse_topology(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(TopologyError, match="invalid JSON"):
        parse_topology(str(bad))


def test_example_json_file_parses() -> None:
    topo = parse_topology(str(EXAMPLES / "h100_2x8.json"))
    assert topo.spec == "h100:2x8"
    assert topo == parse_topology("h100:2x8")


def test_example_yaml_file_parses_or_asks_for_pyyaml() -> None:
    path = str(EXAMPLES / "a100_64x8_oversubscribed.yaml")
    try:
        import yaml  # noqa: F401
    except ImportError:
        with pytest.raises(TopologyError, match="pyyaml"):
            parse_topology(path)
        return
    topo = parse_topology(path)
    assert topo.network.oversubscription == 2.0 and topo.world_size == 512


topologies = st.builds(
    lambda gpu, hosts, gph, nics, gbit, rail, hpl, over: Topology.from_dict({
        "gpu": gpu, "hosts": hosts, "gpus_per_host": gph,
        "network": {"nics_per_host": nics, "nic_gbit_s": gbit, "rail_optimized": rail,
                    "hosts_per_leaf": hpl, "oversubscription": over},
    }),
    st.sampled_from(sorted(GPUS)), st.integers(1, 12), st.integers(1, 8),
    st.integers(1, 8), st.sampled_from([100.0, 200.0, 400.0, 800.0]), st.booleans(),
    st.integers(1, 6), st.sampled_from([1.0, 1.5, 2.0, 4.0]),
)


@settings(max_examples=40, deadline=None)
@given(topologies)
def test_topology_round_trips_through_its_dict(topo: Topology) -> None:
    d = topo.to_dict()
    assert json.loads(json.dumps(d, sort_keys=True)) == d
    again = Topology.from_dict(json.loads(json.dumps(d)))
    assert again == topo and again.to_dict() == d
    assert sum(1 for _, k in topo.graph.nodes(data="kind") if k == "gpu") == topo.world_size
