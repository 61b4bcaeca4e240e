"""Registers and spills of gemc's generated kernels on Hopper, found offline (no GPU).

    python benchmarks/kernel_resources.py [--cases pointwise,norm,...] [--out res.json]

Each case of ``benchmarks/fusion.py`` (the groups of the GEM h200 preset) is compiled by
gemc's passes into its generated module; every kernel of it (``fwd``, ``bwd``, ``epi``,
``dz``, ``dgrad``, ``wgrad``) is compiled by Triton for ``sm_90`` at each of its autotune
configs, and ``ptxas -v`` reports registers per thread and spill bytes. From those, the
warps one SM can hold (65,536 registers; at most 64 warps) — a memory-bound kernel needs
many to hide latency. Why offline: the H200 is lent for minutes per session, and a kernel
that needs 220 registers a thread (8 warps per SM) or spills is slow for a reason this
finds on the CPU box.

Approximations: integer arguments are typed i32 (strides i64), a unit column stride is
specialized as Triton does at run time, pointers are bf16 (gradients' partial sums fp32
where the host allocates fp32 doesn't change register counts materially). The launch-time
block sizes the host chooses (``BLOCK_N`` from N, ``BLOCK_M`` of the looping backward
passes) are those of the H200 sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU target, never interpret

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
KERNELS = ("fwd", "bwd", "epi", "dz", "dgrad", "wgrad")
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
_POINTERS = re.compile(r"(s|g|d|o)\d+|zs|x|w|b|dx|dw|db|dzo|dbp|zin")


def ptxas() -> Path:
    """The ptxas Triton ships that accepts its PTX (the Blackwell-era build reads newer
    PTX versions than the plain one in some wheels)."""
    base = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (base / name).exists():
            return base / name
    raise SystemExit(f"kernel_resources: no ptxas under {base}; this Triton wheel has no "
                     "NVIDIA backend binaries")


def signature(kernel: Any, constants: dict[str, Any]) -> tuple[Any, dict, dict]:
    """(jit function, Triton signature, constexprs) of a generated kernel's parameters."""
    fn = kernel
    while not hasattr(fn, "params"):  # through the autotuner to the JITFunction
        fn = fn.fn
    sig: dict[str, str] = {}
    const: dict[str, Any] = {}
    for name, param in zip(fn.arg_names, fn.params):
        if param.is_constexpr:
            sig[name] = "constexpr"
            if name in constants:
                const[name] = constants[name]
            elif name.startswith("NEED") or name.endswith("_FLAT") or name == "HAS_DB" \
                    or name == "COMPUTE_DX":
                const[name] = True
            elif name in ("IEEE", "INTERP"):
                const[name] = False
            else:
                raise ValueError(f"no value for constexpr {name}")
        elif name.endswith("_sn"):
            sig[name], const[name] = "constexpr", 1
        elif _POINTERS.fullmatch(name):
            sig[name] = "*bf16"
        else:
            sig[name] = "i64" if re.search(r"_(sm|l\d+)$", name) else "i32"
    return fn, sig, const


def resources(kernel: Any, constants: dict[str, Any], num_warps: int,
              num_stages: int) -> dict[str, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, const = signature(kernel, constants)
    compiled = triton.compile(ASTSource(fn, signature=sig, constexprs=const),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([str(ptxas()), "-arch=sm_90a", "-v", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=False)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if out.returncode != 0 or regs is None:
        raise RuntimeError(f"ptxas failed: {text.strip()[-300:]}")
    r = int(regs.group(1))
    blocks = REGISTERS_PER_SM // max(1, r * 32 * num_warps)
    return {"registers": r, "spill_store_bytes": int(spill.group(1)) if spill else 0,
            "spill_load_bytes": int(spill.group(2)) if spill else 0,
            "warps_per_sm": min(MAX_WARPS_PER_SM, blocks * num_warps)}


def launch_constants(kernel_name: str, n: int, module: Any) -> dict[str, Any]:
    """The block sizes the host passes at launch for an operand of N columns (the host's
    own rules, so the counts follow them)."""
    from gemc.backends.triton.codegen import host

    kind = json.loads(module.STRUCTURE)["kind"]
    bn = host.next_pow2(n, 16) if kind == "norm" else host._tile_n(n)  # norm: whole rows
    if kernel_name in ("bwd", "dz"):
        return {"BLOCK_N": bn, "BLOCK_M": host._loop_rows(bn)}
    if kernel_name == "fwd" and kind == "norm":
        bm, bn = host._Norm.blocks(n)
        return {"BLOCK_N": bn, "BLOCK_M": bm}
    if kernel_name in ("fwd", "epi"):
        return {"BLOCK_N": min(bn, 128) if kind == "reduction" else bn, "GROUP_M": 8}
    return {"GROUP_M": 8}


def case_rows(case: Any) -> list[dict[str, Any]]:
    import fusion
    from gemc.backends.triton.codegen.host import load_source

    _, entry = fusion.gemc_kernel(case, torch.bfloat16)
    module = load_source(entry["code"])
    n = int(entry["binding"]["shapes"][0][-1])
    rows = []
    for name in KERNELS:
        kernel = getattr(module, name, None)
        if kernel is None:
            continue
        for cfg in getattr(kernel, "configs", None) or [None]:
            consts = {**launch_constants(name, n, module), **(cfg.kwargs if cfg else {})}
            warps = cfg.num_warps if cfg else 4
            stages = cfg.num_stages if cfg else 3
            row = {"case": case.name, "kernel": name, "num_warps": warps,
                   "blocks": {k: v for k, v in consts.items() if k.startswith("BLOCK")}}
            try:
                row.update(resources(kernel, consts, warps, stages))
            except Exception as exc:  # noqa: BLE001 - a failed config is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'case':34} {'kernel':7} {'blocks':34} {'warps':>5} {'regs':>5} {'spill B':>8} " \
           f"{'warps/SM':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        blocks = " ".join(f"{k[6:]}={v}" for k, v in r["blocks"].items())
        if "error" in r:
            print(f"{r['case'][:34]:34} {r['kernel']:7} {blocks:34} {r['num_warps']:>5}  "
                  f"{r['error']}")
            continue
        print(f"{r['case'][:34]:34} {r['kernel']:7} {blocks:34} {r['num_warps']:>5} "
              f"{r['registers']:>5} {r['spill_store_bytes']:>8} {r['warps_per_sm']:>8}")


def main(argv: list[str] | None = None) -> int:
    import fusion

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="gemm_gelu,gemm_residual,norm,pointwise,reduction")
    ap.add_argument("--first", action="store_true", help="only the first size of each case")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    table = fusion.cases(False)
    rows: list[dict[str, Any]] = []
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        if name not in table:
            ap.error(f"unknown case {name!r}; known: {', '.join(sorted(table))}")
        for case in table[name][:1] if args.first else table[name]:
            rows += case_rows(case)
    print_table(rows)
    if args.out is not None:
        args.out.write_text(json.dumps({"triton": triton.__version__, "target": "sm_90a",
                                        "ptxas": str(ptxas()), "rows": rows}, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
