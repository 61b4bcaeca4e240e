"""``gemc report``: the page renders in headless Chromium with every section present, on a
real compile of the tiny GEM preset; and each section copes with what a dump may lack."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest

from gemc.cli import main
from gemc.report import SECTION_IDS, render_report
from tests.mlir.tiny import tiny_dump
from tests.report.chromium import dump_dom, screenshot

ARTIFACTS = Path(__file__).parent / "artifacts"


def _sections(html: str) -> dict[str, str]:
    parts = re.split(r'(?=<section id=")', html)
    out = {}
    for part in parts:
        m = re.match(r'<section id="([^"]+)"', part)
        if m:
            out[m.group(1)] = part.split("</section>")[0]
    return out


def _runner_style_run(plan: dict) -> dict:
    """A run report shaped like backends/torch/runner.py writes it."""
    per_rank = [
        {
            "rank": r["rank"],
            "step_ms": {"median": 1.3 * r["compute_ms"], "mean": 1.31 * r["compute_ms"]},
            "memory": {
                "kind": "cuda_max_memory_allocated",
                "peak_bytes": int(r["memory_gb"] * 0.9e9),
            },
        }
        for r in plan["predicted"]["per_rank"]
    ]
    step = max(e["step_ms"]["median"] for e in per_rank)
    return {
        "model": dict(plan["model"]),
        "device": "cuda",
        "world_size": len(per_rank),
        "steps": {"run": 20},
        "step_ms": step,
        "per_rank": per_rank,
        "vs_predicted": {"step_ms": {"measured": step, "predicted": plan["predicted"]["step_ms"]}},
    }


@pytest.fixture(scope="module")
def report_page(tmp_path_factory) -> tuple[Path, Path, dict]:
    dump = tmp_path_factory.mktemp("report") / "dump"
    shutil.copytree(tiny_dump(), dump)
    plan = json.loads((dump / "plan.json").read_text())
    (dump / "plan.run.json").write_text(json.dumps(_runner_style_run(plan)))
    page = dump.parent / "report.html"
    assert main(["report", str(dump), "-o", str(page)]) == 0
    return dump, page, plan


def test_report_renders_every_section_in_chromium(report_page):
    dump, page, plan = report_page
    dom = dump_dom(page)
    sections = _sections(dom)
    assert list(sections) == SECTION_IDS
    for sid in ("timeline", "graph", "ranks", "tables", "measured"):
        assert "<svg" in sections[sid], f"section {sid} has no picture"
        assert "failed to render" not in sections[sid]
    manifest = json.loads((dump / "manifest.json").read_text())
    for p in manifest["passes"]:
        assert p["name"] in sections["timeline"]
    assert sections["graph"].count('class="op"') > 100  # every op of the tiny graph drawn
    assert all(f"rank {r['rank']}:" in sections["ranks"] for r in plan["predicted"]["per_rank"])
    for t in plan["tables"]:
        assert t["fqn"] in sections["tables"]
    if any(e.get("target") != "*" for e in plan["precision"]):
        assert 'class="cell"' in sections["precision"]
    elif plan["precision"]:
        assert "only a global default" in sections["precision"]
    else:
        assert "no precision choices" in sections["precision"]
    assert "plan.run.json" in sections["measured"] and "measured" in sections["measured"]
    assert "torch-mlir" in sections["mlir"] and "graph.linalg.mlir" in sections["mlir"]


def test_report_is_one_self_contained_file(report_page):
    _, page, _ = report_page
    html = page.read_text()
    assert "<script" not in html.lower()
    assert not re.search(r'(src|href)="(https?:)?//', html), "the page must fetch nothing"
    assert not re.search(r"url\(", html)
    assert "<link" not in html


def test_screenshot_is_kept_as_an_artifact(report_page):
    _, page, _ = report_page
    png = screenshot(page, ARTIFACTS / "report.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 3000)
    assert len(data) > 50_000, "a blank page compresses to almost nothing"
    shutil.copy(page, ARTIFACTS / "report.html")


def test_same_dump_same_bytes(report_page):
    dump, page, _ = report_page
    assert render_report(dump) == page.read_text()


def _minimal_dump(path: Path, nodes: list[str]) -> Path:
    path.mkdir(parents=True)
    (path / "000_capture.txt").write_text(
        "# gemc dump 000 pass=capture changed=True\n" + "\n".join(nodes) + "\n"
    )
    (path / "manifest.json").write_text(
        json.dumps(
            {
                "status": "ok",
                "dump_mode": "all",
                "disabled": [],
                "passes": [
                    {
                        "index": 0,
                        "name": "capture",
                        "seconds": 0.5,
                        "changed": True,
                        "nodes": len(nodes),
                        "kernels": 0,
                        "verifier": "ok",
                        "dump": "000_capture.txt",
                    }
                ],
            }
        )
    )
    return path


def test_dump_without_plan_run_or_mlir_still_renders(tmp_path):
    dump = _minimal_dump(
        tmp_path / "d",
        [
            "%x = input :: f32[4,8]  {kind=input}",
            "%w = input :: f32[8,8]  {kind=param region=tower}",
            "%mm = aten.mm.default(%x, %w) :: f32[4,8]  {kind=gemm region=tower group=0}",
            "%r = aten.relu.default(%mm) :: f32[4,8]  {kind=pointwise region=tower group=0}",
            "%s = aten.sum.default(%r) :: f32[]  {kind=reduction region=}",
            "return [%s] :: none",
        ],
    )
    html = render_report(dump)
    sections = _sections(html)
    assert list(sections) == SECTION_IDS
    assert "no plan" in sections["ranks"] and "no plan" in sections["tables"]
    assert "no plan" in sections["precision"]
    assert "no run report" in sections["measured"]
    assert "no MLIR" in sections["mlir"]
    assert 'class="group"' in sections["graph"] and "fusion group 0: 2 ops" in sections["graph"]
    assert "pass --plan" in html


def test_big_graph_collapses_to_regions(tmp_path):
    lines = ["%x = input :: f32[4,8]  {kind=input}"]
    prev = "x"
    for t in range(300):
        lines.append(
            f"%e{t} = aten.embedding.default(%x) :: f32[4,8]  {{kind=embedding region=bags.{t}}}"
        )
        lines.append(
            f"%a{t} = aten.add.Tensor(%{prev}, %e{t}) :: f32[4,8]  {{kind=pointwise region=mix group={t % 7}}}"
        )
        prev = f"a{t}"
    html = render_report(_minimal_dump(tmp_path / "d", lines))
    graph = _sections(html)["graph"]
    assert "regions collapsed" in graph and "bags.*" in graph
    assert "bags.17" not in graph.split("<table")[0]


def test_measured_section_reads_other_run_formats(report_page, tmp_path):
    dump, _, plan = report_page
    run = tmp_path / "other.run.json"
    run.write_text(
        json.dumps(
            {
                "measured": {
                    "step_ms": 2.5,
                    "per_rank": [
                        {"rank": 0, "step_ms": 2.5, "memory_gb": 1.5},
                        {"rank": 1, "step_ms": 2.4},
                    ],
                }
            }
        )
    )
    section = _sections(render_report(dump, runs=[run]))["measured"]
    assert "other.run.json" in section and "2.5" in section
    assert "rank 0 memory measured: 1.5 GB" in section


def test_cli_report_on_a_directory_that_is_not_a_dump(tmp_path, capsys):
    rc = main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert rc == 2
    assert "not a gemc dump directory" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def _with_plan(dump: Path, tmp_path: Path, **changes) -> Path:
    plan = json.loads((dump / "plan.json").read_text())
    plan.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_precision_map_empty_and_per_site(report_page, tmp_path):
    dump, _, _ = report_page
    empty = _sections(render_report(dump, plan=_with_plan(dump, tmp_path, precision=[])))[
        "precision"
    ]
    assert "no precision choices" in empty and "<svg" not in empty
    sites = [
        {"target": "*", "dtype": "bf16", "mode": "auto", "source": "choose-precision"},
        {
            "target": "tower.0",
            "dtype": "fp8",
            "sqnr_db": 31.5,
            "gain_ms": 0.2,
            "sites": [
                {"node": "linear", "fwd": "fp8", "dgrad": "fp8", "wgrad": "bf16", "sqnr_db": 31.5}
            ],
        },
        {"target": "head", "dtype": "fp32"},
    ]
    section = _sections(render_report(dump, plan=_with_plan(dump, tmp_path, precision=sites)))[
        "precision"
    ]
    assert "tower.0 (linear) wgrad: bf16" in section and "tower.0 (linear) fwd: fp8" in section
    assert "head fwd: fp32" in section and "SQNR 31.5 dB" in section
