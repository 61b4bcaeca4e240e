"""The pass manager: run named passes in order, verify, time and dump each one.

Modelled on MLIR's pass instrumentation (print-ir-after-all, tree dir) and TVM's DumpIR:
a pipeline is a list of small passes; after each, the graph is verified, the pass is
timed, and, by ``dump_mode``, the graph is written as ``NNN_<pass>.txt`` beside a
``manifest.json``. A pass can be disabled by name to bisect a problem.

An interrupt (Ctrl-C, SIGTERM) leaves the dump directory complete up to the stop rather
than removing it: every file is written whole (temporary name, then rename), and the
manifest lists the passes dumped and says ``interrupted in pass NAME``, so the work done
before the stop can still be read.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import fx

from gemc import ir
from gemc.atomic_write import write_atomic, write_json_atomic
from gemc.context import PassContext
from gemc.dump import format_graph
from gemc.errors import GemcUserError, PassFailure

DUMP_MODES = ("all", "changed", "failure")


class Pass(Protocol):
    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, bool]: ...


def verify_graph(gm: fx.GraphModule) -> None:
    """The invariants every pass must keep; raises AssertionError naming the broken node."""
    gm.graph.lint()
    kinds = {k.value for k in ir.OpKind}
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    assert len(outputs) == 1, f"graph has {len(outputs)} output nodes"
    for node in gm.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            raise AssertionError(f"node {node.name} ({node.target}) has no 'val': shape unknown")
        kind = node.meta.get(ir.KIND)
        if kind is not None and kind not in kinds:
            raise AssertionError(f"node {node.name} has unknown kind {kind!r}")
        for key in (ir.FLOPS, ir.BYTES):
            value = node.meta.get(key)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise AssertionError(f"node {node.name} has {key}={value!r}, not an int >= 0")
    result = outputs[0].args[0]
    result = result[0] if isinstance(result, (list, tuple)) and len(result) == 1 else result
    val = result.meta.get("val") if isinstance(result, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.dim() == 0):
        raise AssertionError("the graph no longer returns a scalar loss")


@dataclass
class PassRecord:
    index: int
    name: str
    seconds: float
    changed: bool
    nodes: int
    kernels: int
    verifier: str
    dump: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "seconds": round(self.seconds, 4),
            "changed": self.changed,
            "nodes": self.nodes,
            "kernels": self.kernels,
            "verifier": self.verifier,
            "dump": self.dump,
        }


@dataclass
class PassManager:
    passes: Sequence[Pass]
    disabled: Sequence[str] = ()
    dump_dir: Path | None = None
    dump_mode: str = "all"
    progress: Callable[[str], None] | None = None
    records: list[PassRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.dump_mode not in DUMP_MODES:
            raise GemcUserError(
                f"unknown dump mode '{self.dump_mode}'",
                where="--dump-mode",
                fix=f"use one of: {', '.join(DUMP_MODES)}",
            )
        names = [p.name for p in self.passes]
        unknown = [d for d in self.disabled if d not in names]
        if unknown:
            raise GemcUserError(
                f"no pass named {', '.join(repr(u) for u in unknown)} in the pipeline",
                where="--disable-pass",
                fix=f"disable one of: {', '.join(names)}",
            )
        for p in self.passes:
            if p.name in self.disabled:
                continue
            needed = [r for r in p.requires if r in self.disabled]
            if needed:
                raise GemcUserError(
                    f"pass '{p.name}' needs {', '.join(needed)}, which is disabled",
                    where="--disable-pass",
                    fix=f"also disable '{p.name}', or keep {', '.join(needed)}",
                )

    def run(
        self, gm: fx.GraphModule, ctx: PassContext, *, capture_seconds: float = 0.0
    ) -> fx.GraphModule:
        self._record(0, "capture", capture_seconds, True, gm, "ok", always=True)
        index = 0
        for p in self.passes:
            if p.name in self.disabled:
                continue
            index += 1
            if self.progress:
                self.progress(p.name)
            before = (
                format_graph(gm, f"input of pass {index:03d} {p.name}")
                if self.dump_mode == "failure" and self.dump_dir
                else None
            )
            start = time.perf_counter()
            try:
                gm, changed = p.run(gm, ctx)
            except KeyboardInterrupt:
                # the dumps so far are complete files; the manifest says where it stopped
                self.interrupted(f"pass {p.name}")
                raise
            except GemcUserError:
                raise
            except Exception as exc:
                self._on_failure(index, p.name, gm, before, time.perf_counter() - start, exc)
                raise PassFailure(p.name, f"{type(exc).__name__}: {exc}") from exc
            seconds = time.perf_counter() - start
            try:
                verify_graph(gm)
            except AssertionError as exc:
                self._on_failure(index, p.name, gm, before, seconds, exc)
                raise PassFailure(p.name, f"verifier: {exc}") from exc
            try:
                self._record(index, p.name, seconds, bool(changed), gm, "ok")
            except KeyboardInterrupt:
                self.interrupted(f"the dump of pass {p.name}")
                raise
        self._write_manifest("ok")
        return gm

    def interrupted(self, where: str) -> None:
        """Ctrl-C or SIGTERM stopped the compile at ``where``: the dump directory stays
        complete up to there (every file was written whole), and its manifest says so."""
        self._write_manifest(f"interrupted in {where}")

    def _record(
        self,
        index: int,
        name: str,
        seconds: float,
        changed: bool,
        gm: fx.GraphModule,
        verifier: str,
        always: bool = False,
    ) -> None:
        dump = None
        if self.dump_dir is not None and (
            self.dump_mode == "all" or (self.dump_mode == "changed" and (changed or always))
        ):
            dump = f"{index:03d}_{name}.txt"
            header = (
                f"gemc dump {index:03d} pass={name} changed={changed} nodes={len(gm.graph.nodes)}"
            )
            write_atomic(self.dump_dir / dump, format_graph(gm, header))
        self.records.append(
            PassRecord(
                index,
                name,
                seconds,
                changed,
                len(gm.graph.nodes),
                _kernel_count(gm),
                verifier,
                dump,
            )
        )

    def _on_failure(
        self,
        index: int,
        name: str,
        gm: fx.GraphModule,
        before: str | None,
        seconds: float,
        exc: BaseException,
    ) -> None:
        if self.dump_dir is None:
            return
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if before is not None:
            write_atomic(self.dump_dir / f"{index:03d}_{name}.input.txt", before)
        write_atomic(self.dump_dir / f"{index:03d}_{name}.failure.txt", detail)
        self.records.append(
            PassRecord(
                index,
                name,
                seconds,
                False,
                len(gm.graph.nodes),
                _kernel_count(gm),
                f"failed: {exc}",
                f"{index:03d}_{name}.failure.txt",
            )
        )
        self._write_manifest(f"failed in {name}")

    def _write_manifest(self, status: str) -> None:
        if self.dump_dir is None:
            return
        write_json_atomic(
            self.dump_dir / "manifest.json",
            {
                "status": status,
                "dump_mode": self.dump_mode,
                "disabled": list(self.disabled),
                "passes": [r.to_json() for r in self.records],
            },
        )


def _kernel_count(gm: fx.GraphModule) -> int:
    return len({n.meta[ir.GROUP] for n in gm.graph.nodes if ir.GROUP in n.meta})
