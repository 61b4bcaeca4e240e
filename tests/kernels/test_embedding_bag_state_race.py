"""The fused embedding update's row-wise Adagrad accumulator, as the GPU runs it.

The accumulator of a row is one fp32 scalar: every thread of the row's program loads it,
and Triton writes a scalar back from thread 0 alone. Threads of other warps that load it
after that store read the new value and add the squares a second time; their columns of
the row then move by 1/sqrt(2) of the step. GPUs did this in the two-phase update of a
column shard (``split_rows``), whose second phase has no reduction to hold the warps
together: on an H100, 0.3-1% of the rows a batch of 409,600 ids touched, whatever their
number of ids, were off by up to 0.29 x lr x |g| / rms(g) (0.012 at lr 0.01) while the
accumulators themselves were right; on an H200 the benchmark's check (narrow_split) failed
with 0.013, in columns 34 and 115 (the second warp's). The one-pass update had the same
order, only a narrower window (its loads come right after the squares' reduction barrier).

Triton's interpreter runs a program's lanes as one, so the CPU tests cannot see this. This
test compiles the kernel for Hopper (no GPU needed: ptxas ships with Triton) and checks the
order in the machine code: a CTA barrier between the last load of an address and a store
to it made by thread 0 alone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Compiles the fused update for sm_90 as ``_launch_update`` launches it (BLOCK_L 8, the
# warps it asks for) and writes each variant's PTX to the folder in argv[1].
_COMPILE = r"""
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gemc.backends.triton import embedding_bag as eb

kernel = eb._fused_update_kernel
ints = {"sorted_keys": "*i32", "run_end": "*i64", "sorted_bag": "*i64", "row_base": "*i64",
        "weight_offset": "*i64", "table_dim": "*i32", "table_column": "*i32",
        "squares_dim": "*i32", "grad_stride": "i32", "batch": "i32", "seed": "i32"}
scalars = {"lr", "eps", "beta1", "beta2", "step_size", "weight_decay"}
for phase, storage, block_d in [(0, 0, 128), (2, 0, 128), (2, 0, 32), (2, 2, 128)]:
    const = dict(OPTIMIZER=0, HAS_WEIGHT_DECAY=False, STORAGE=storage, BLOCK_D=block_d,
                 BLOCK_L=8, PHASE=phase)
    sig = {n: "constexpr" if n in const else ints.get(n, "fp32" if n in scalars else "*fp32")
           for n in inspect.signature(kernel.fn).parameters}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=const),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": max(1, min(8, 8 * block_d // 512))})
    with open(f"{sys.argv[1]}/phase{phase}_storage{storage}_d{block_d}.ptx", "w") as f:
        f.write(compiled.asm["ptx"])
"""


def _single_thread_stores(ptx: str) -> tuple[int, list[str]]:
    """(how many stores thread 0 alone makes to an address loaded before, those of them
    with no barrier since the last load of that address)."""
    lines = [line.split("//")[0].strip() for line in ptx.splitlines()]
    tid = set()  # %tid.x and the lane id taken from it (``and`` with 31: one warp)
    for line in lines:
        if (m := re.match(r"mov\.u32\s+(%r\d+),\s*%tid\.x;", line)) or (
                (m := re.match(r"and\.b32\s+(%r\d+),\s*(%r\d+),\s*31;", line))
                and m.group(2) in tid):
            tid.add(m.group(1))
    thread0 = {m.group(1) for line in lines
               if (m := re.match(r"setp\.eq\.[bsu]32\s+(%p\d+),\s*(%r\d+),\s*0;", line))
               and m.group(2) in tid}
    loaded: set[str] = set()  # addresses loaded since the last barrier
    ever: set[str] = set()
    stores, unordered = 0, []
    for line in lines:
        if line.startswith(("bar.sync", "barrier.sync")):
            loaded.clear()
        elif m := re.search(r"ld\.global\S*\s+\{?\s*%r\d+\s*\}?,\s*\[\s*(%rd\d+)\s*\+\s*0\s*\]",
                            line):
            loaded.add(m.group(1))
            ever.add(m.group(1))
        elif (m := re.match(r"@(%p\d+)\s+st\.global\S*\s+\[\s*(%rd\d+)\s*\+\s*0\s*\]", line)) \
                and m.group(1) in thread0 and m.group(2) in ever:
            stores += 1
            if m.group(2) in loaded:
                unordered.append(line)
    return stores, unordered


@pytest.fixture(scope="module")
def hopper_ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("ptx")
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton_cache"))}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {p.stem: p.read_text() for p in sorted(out.glob("*.ptx"))}


@pytest.mark.parametrize("variant", ["phase0_storage0_d128", "phase2_storage0_d128",
                                     "phase2_storage0_d32", "phase2_storage2_d128"])
def test_every_thread_reads_the_accumulator_before_thread_0_writes_it(
        hopper_ptx: dict[str, str], variant: str) -> None:
    """The one-pass (phase 0) and the summed (phase 2) update, fp32 and fp8 storage, two
    warps and one: the accumulator's store is found, and a barrier separates it from the
    accumulator's load."""
    stores, unordered = _single_thread_stores(hopper_ptx[variant])
    assert stores >= 1, f"{variant}: no store of thread 0 alone found in the PTX"
    assert unordered == [], (f"{variant}: thread 0 writes an address the other warps may "
                             f"not have read yet: {unordered}")


def test_the_check_finds_a_store_with_no_barrier_after_the_load() -> None:
    """The checker itself, on the order the kernel had: load, add, store by thread 0."""
    ptx = "\n".join([
        "mov.u32 %r3, %tid.x;",
        "ld.global.b32 { %r95 }, [ %rd107 + 0 ];",
        "add.f32 %r96, %r100, %r95;",
        "setp.eq.b32 %p41, %r3, 0;",
        "@%p41 st.global.b32 [ %rd107 + 0 ], { %r96 };",
    ])
    assert _single_thread_stores(ptx) == (1, ["@%p41 st.global.b32 [ %rd107 + 0 ], { %r96 };"])
    fenced = ptx.replace("add.f32", "bar.sync 0;\nadd.f32")
    assert _single_thread_stores(fenced) == (1, [])
