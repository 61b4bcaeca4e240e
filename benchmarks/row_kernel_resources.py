"""Registers, spills, shared memory and layout round trips of the attention's one-program-per-
row softmax backward at each of its configs, compiled for sm_90 offline (no GPU).

    python benchmarks/row_kernel_resources.py [--configs all|pick] [--out res.json]

Why: the row kernel (``backends/triton/softmax_row_backward.py``) is latency-bound at
TransAct's shape, and how many of its programs an SM holds is set by its registers a thread
(65,536 an SM); its tile orientations differ in how many tiles go through shared memory to
be transposed. Both are read here from what Triton compiles for an H100/H200 on the CPU box,
where the GPU is lent for minutes a session: registers and stack from ``cuobjdump
-res-usage`` of the cubin, shared memory from the compile's metadata, and from the TTGIR the
count of Hopper MMAs (``warp_group_dot``), Ampere-style ones (``tt.dot``: tiles under 64
rows), and shared-memory loads into an MMA operand (``local_load``: a transposed operand's
round trip). The launch is TransAct's region attention (head dim 48, rows up to 100, a
per-key bias), made on meta tensors through the same host code a run uses, each config
forced as the GPU tests force it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gemc.atomic_write import write_json_atomic  # noqa: E402
from tests.hopper_target import HOPPER_DRIVER  # noqa: E402

_COMPILE = HOPPER_DRIVER + textwrap.dedent("""
    import importlib, json, os, sys
    from gemc.backends.triton import config_choice as cc, ops, warm as W
    from gemc.backends.triton import softmax_row_backward as R
    J = importlib.import_module("gemc.backends.triton.jagged_attention")
    J.FUSED_SOFTMAX_SHORT_ROWS = True
    B, L, H, D = 8, 100, 2, 48
    offsets = torch.empty(B + 1, dtype=torch.int64, device="meta")
    key_bias = torch.empty(B, L, dtype=torch.float32, device="meta")
    x = [torch.empty(B * L, H, D, dtype=torch.bfloat16, device="meta") for _ in range(3)]
    lse = torch.empty(H, B * L, dtype=torch.float32, device="meta")
    meta, bias = ops._values_meta(x[0], offsets, False, key_bias, L)
    hook, tuner = cc._KERNELS["jagged_attention._bwd_softmax_row_kernel"]
    configs = [*tuner.configs, *R.KEY_MAJOR_CANDIDATES] if sys.argv[1] == "all" else [None]
    tuner.configs[:] = [c for c in configs if c is not None] or tuner.configs
    for config in configs:
        if config is not None:  # forced, as the GPU tests force it
            want = (config.kwargs, config.num_warps, config.num_stages, config.maxnreg)
            hook.prefer = lambda args, want=want: [want]
            cc.forget("jagged_attention.")
        with W.dry_launches() as launches:
            J._attention_backward(*x, x[0], lse, x[0], offsets, L, 0.1, meta, bias=bias)
        before = set(os.listdir(os.environ["TRITON_CACHE_DIR"]))
        for result in map(W.compile_launch, launches):
            if result["error"]:
                print("ERROR", result["error"])
                sys.exit(1)
        chosen = [c for _, c in hook.chosen.values()]  # the config the compile took
        new = sorted(set(os.listdir(os.environ["TRITON_CACHE_DIR"])) - before)
        print("CONFIG", json.dumps({"config": chosen[-1], "dirs": new}))
""")


def _cuobjdump() -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise SystemExit(f"row_kernel_resources: no cuobjdump at {path}; this Triton wheel "
                         "has no NVIDIA backend binaries")
    return path


def _variant(config: str, directory: Path, cuobjdump: Path) -> dict[str, Any] | None:
    """The row kernel's variant compiled into cache ``directory`` for ``config`` (the
    tuner's string of it), or None (another kernel's directory)."""
    meta_path = directory / "_bwd_softmax_row_kernel.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    ttgir = next(directory.glob("*.ttgir")).read_text()
    cubin = next(directory.glob("*.cubin"))
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    regs, stack = (re.search(rf"{k}:(\d+)", usage) for k in ("REG", "STACK"))
    return {"config": config, "registers": int(regs.group(1)) if regs else None,
            "stack_bytes": int(stack.group(1)) if stack else None,
            "shared_bytes": meta.get("shared"),
            "hopper_mma": ttgir.count("ttng.warp_group_dot "),
            "ampere_mma": ttgir.count("tt.dot "),
            "operand_round_trips": ttgir.count("ttg.local_load")}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", choices=("all", "pick"), default="all",
                    help="every config of the row kernel's tuner and its key-major "
                    "candidates, or its pick alone")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    cuobjdump = _cuobjdump()
    with tempfile.TemporaryDirectory(prefix="row_kernel_resources_") as cache:
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": cache}
        proc = subprocess.run([sys.executable, "-c", _COMPILE, args.configs], env=env,
                              cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit("row_kernel_resources: the sm_90 compile failed:\n"
                             + (proc.stdout + proc.stderr)[-3000:])
        rows = []
        for line in proc.stdout.splitlines():
            if line.startswith("CONFIG "):
                got = json.loads(line.removeprefix("CONFIG "))
                rows += [v for d in got["dirs"]
                         if (v := _variant(got["config"], Path(cache) / d, cuobjdump))]
    print("config | registers, stack bytes, shared bytes | Hopper / Ampere MMAs, operand "
          "round trips (over the kernel's code paths)")
    for r in rows:
        print(f"{r['config']} | {r['registers']}, {r['stack_bytes']}, {r['shared_bytes']} | "
              f"{r['hopper_mma']} / {r['ampere_mma']}, {r['operand_round_trips']}")
    if args.out:
        write_json_atomic(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
