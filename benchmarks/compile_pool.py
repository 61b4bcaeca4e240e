"""How long a plan's generated Triton kernels take to compile for Hopper, serially and in a
pool: is a parallel warm-up before the first step worth building? (issue 16, item 4)

    python benchmarks/compile_pool.py --plan gem.plan.json --workers 2 --limit 12
    python benchmarks/compile_pool.py --plan gem.plan.json --workers 16       # the H200 box

No GPU is needed: each kernel is compiled with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` (ptxas ships with the Triton wheel), once serially, once in a
process pool and once in a thread pool, each into a fresh ``TRITON_CACHE_DIR``. The kernels
are the plan's generated groups (``kernels[*].code``), every ``@triton.jit`` function with
the first config of its GPU list. The specialisation is an approximation of a launch's
(pointers fp32 and 16-byte aligned, integers i32, flags at their common values): it times
the compiles, it does not fill a cache a launch would hit. Prints one line per mode and
writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

_FLAGS = {"IEEE": False, "INTERP": False, "STAGES": 2, "HAS_DB": True, "COMPUTE_DX": True,
          "GROUP_M": 8}
_INT = re.compile(r"^(M|N|K|ITERS|ROWS_PER_SPLIT)$|_s[mn]$|_l\d+$|^s[a-z][a-z]$|^c\d+_d\d+$")
"""Sizes, strides and class extents (the emitters' names: ``M``, ``s0_sm``, ``sxk``,
``c0_d1``); the other arguments are pointers."""
_JIT = re.compile(r"@triton\.autotune\(configs=(\w+), key=.*?\)\n@triton\.jit\ndef (\w+)\(",
                  re.S)


def _module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def jobs_of(plan: dict[str, Any], src_dir: Path, limit: int | None) -> list[tuple]:
    """(module file, kernel name, constexprs, num_warps, num_stages) per generated kernel."""
    out = []
    for k in plan["kernels"]:
        code = k.get("code")
        if not code:
            continue
        path = src_dir / f"k_{k['sha256'][:16]}.py"
        path.write_text(code)
        mod = _module(str(path))
        for configs, name in _JIT.findall(code):
            cfg = getattr(mod, configs)[0]
            fn = getattr(mod, name).fn
            cons = {}
            for a in fn.arg_names:
                p = fn.params[fn.arg_names.index(a)]
                if not p.is_constexpr:
                    continue
                if a in cfg.kwargs:
                    cons[a] = cfg.kwargs[a]
                elif a.endswith("_FLAT"):
                    cons[a] = False
                elif a.startswith("NEED"):
                    cons[a] = True
                elif a.startswith("BLOCK_"):
                    cons[a] = 64
                else:
                    cons[a] = _FLAGS.get(a, False)
            out.append((str(path), name, cons, cfg.num_warps, cfg.num_stages))
    return out[:limit] if limit else out


def compile_one(job: tuple) -> float:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path, name, cons, warps, stages = job
    fn = getattr(_module(path), name).fn
    sig = {a: "constexpr" if a in cons else ("i32" if _INT.search(a) else "*fp32")
           for a in fn.arg_names}
    t = time.perf_counter()
    triton.compile(ASTSource(fn, sig, cons, {}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, "num_stages": stages})
    return time.perf_counter() - t


def _timed(jobs: list[tuple], pool: Executor | None) -> float:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        t = time.perf_counter()
        if pool is None:
            for j in jobs:
                compile_one(j)
        else:
            with pool:
                list(pool.map(compile_one, jobs))
        return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="a plan JSON (gemc compile's output)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--limit", type=int, default=None, help="only the first N kernels")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # compiled, not interpreted: the generated modules decorate their kernels when imported
    # here (and in the pool's workers, which inherit it), and read the GPU config lists
    os.environ["TRITON_INTERPRET"] = "0"
    plan = json.loads(Path(args.plan).read_text())
    with tempfile.TemporaryDirectory() as src:
        jobs = jobs_of(plan, Path(src), args.limit)
        compile_one(jobs[0])  # imports and Triton's own first-use costs, outside the timing
        res = {"kernels": len(jobs), "workers": args.workers, "cpus": os.cpu_count(),
               "serial_s": _timed(jobs, None),
               "processes_s": _timed(jobs, ProcessPoolExecutor(args.workers)),
               "threads_s": _timed(jobs, ThreadPoolExecutor(args.workers))}
    for mode in ("serial", "processes", "threads"):
        s = res[f"{mode}_s"]
        print(f"{mode:>10}: {s:7.1f} s  ({res['serial_s'] / s:.2f}x serial)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
