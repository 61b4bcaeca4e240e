"""The tiny GEM preset, shared by tests/mlir and tests/report: captured once, run eagerly
once on a real batch, compiled once with --dump-dir (each memoised for the session, since
a capture costs seconds and both test folders read the same things)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx

from gemc.api import load_model
from gemc.capture import capture

REPO = Path(__file__).resolve().parents[2]
ENTRY = f"{REPO / 'examples' / 'gem' / 'model.py'}:build"
ARGS = {"preset": "tiny"}


@dataclass
class Tiny:
    gm: fx.GraphModule  # captured on meta, as gemc compiles it
    values: dict[str, Any]  # every node's value from one eager CPU run on make_batch(0)

    def node(self, name: str) -> fx.Node:
        return next(n for n in self.gm.graph.nodes if n.name == name)

    def nodes(self, *names: str) -> list[fx.Node]:
        return [self.node(n) for n in names]


@functools.cache
def tiny() -> Tiny:
    from gemc.backends.mlir.refcheck import record_values

    captured = capture(load_model(ENTRY, ARGS), entrypoint=ENTRY)
    real = load_model(ENTRY, ARGS, device="cpu")
    state = {**dict(real.model.named_parameters()), **dict(real.model.named_buffers())}
    batch = iter(real.make_batch(0, "cpu"))
    args = [
        state[captured.param_fqns[p.name]].detach()
        if p.name in captured.param_fqns
        else next(batch)
        for p in captured.gm.graph.nodes
        if p.op == "placeholder"
    ]
    return Tiny(captured.gm, record_values(captured.gm, args))


@functools.cache
def tiny_dump() -> Path:
    """``gemc compile <tiny> --dump-dir D`` through the CLI, as a user runs it."""
    from gemc.cli import main

    root = Path(tempfile.mkdtemp(prefix="gemc-tiny-dump-"))
    atexit.register(shutil.rmtree, root, True)
    dump = root / "dump"
    rc = main(
        [
            "compile",
            ENTRY,
            "--set",
            "preset=tiny",
            "--topology",
            "h200:1x8",
            "--planner",
            "default",
            "--out",
            str(root / "plan.json"),
            "--dump-dir",
            str(dump),
            "--quiet",
        ]
    )
    assert rc == 0, "gemc compile of the tiny preset failed"
    return dump
