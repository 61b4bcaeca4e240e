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

Arguments are specialized as Triton's launcher specializes them at the H200 sizes, since
that decides the code: an integer equal to 1 becomes a constant, a multiple of 16 and a
16-byte-aligned pointer carry ``tt.divisibility = 16`` (which decides the vector width of
loads and stores, hence the layout and the registers). The operands' strides, shape-class
sizes, ``M``/``N``/``R``, ``ITERS`` and gradient buffers are the host's own launch arguments
built on meta tensors (:func:`launch_values`); what those do not cover (a GEMM's ``x``,
``w`` and their strides, ``K``) is typed by name (contiguous operands, sizes multiples of
16). The launch-time block sizes the host chooses (``BLOCK_N`` from N, ``BLOCK_M`` of the
looping backward passes) are those of the H200 sizes; the looping passes' tile, programs
and pipelining depth follow ``GEMC_LOOP_TILE`` / ``GEMC_ROW_PROGRAMS`` /
``GEMC_LOOP_STAGES`` (see ``codegen.host``), so a bigger tile's cost can be read here before
the GPU sweep (``benchmarks/bwd_sweep.py``) times it.
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


_PTR_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
              torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*i1"}
_DIV16 = [["tt.divisibility", 16]]
_SIZES = re.compile(r"[MNKR]|sxm|swn")  # by name: multiples of 16 at the H200 sizes
_UNIT = re.compile(r".*_sn|sxk|swk")  # by name: unit strides of contiguous operands


def _int_type(name: str) -> str:
    return "i64" if re.search(r"_(sm|sn|l\d+)$", name) else "i32"


def signature(kernel: Any, constants: dict[str, Any], values: dict[str, Any] | None = None
              ) -> tuple[Any, dict, dict, dict]:
    """(jit function, Triton signature, constexprs, attributes) of a generated kernel's
    parameters, specialized as the launcher would at ``values`` (see the module doc)."""
    values = values or {}
    fn = kernel
    while not hasattr(fn, "params"):  # through the autotuner to the JITFunction
        fn = fn.fn
    sig: dict[str, str] = {}
    const: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values.get(name)
        if param.is_constexpr:
            sig[name] = "constexpr"
            if name in constants:
                const[name] = constants[name]
            elif value is not None:
                const[name] = value
            elif name.startswith("NEED") or name.endswith("_FLAT") or name == "HAS_DB" \
                    or name == "COMPUTE_DX":
                const[name] = True
            elif name in ("IEEE", "INTERP"):
                const[name] = False
            else:
                raise ValueError(f"no value for constexpr {name}")
        elif isinstance(value, torch.Tensor):
            sig[name] = _PTR_TYPES[value.dtype]
            attrs[(i,)] = _DIV16
        elif isinstance(value, int) and not isinstance(value, bool):
            if value == 1:
                sig[name], const[name] = "constexpr", 1
            else:
                sig[name] = _int_type(name)
                if value % 16 == 0:
                    attrs[(i,)] = _DIV16
        elif _UNIT.fullmatch(name):
            sig[name], const[name] = "constexpr", 1
        elif _POINTERS.fullmatch(name):
            sig[name] = "*bf16"
            attrs[(i,)] = _DIV16
        else:
            sig[name] = _int_type(name)
            if _SIZES.fullmatch(name):
                attrs[(i,)] = _DIV16
    return fn, sig, const, attrs


def launch_values(module: Any, binding: dict[str, Any]) -> dict[str, Any]:
    """The launch arguments the kernels of ``module`` share at the binding's sizes: operand
    pointers, strides and FLAT flags, the output gradients (a reduction's expanded over the
    reduced dim, as its backward passes it), shape-class sizes, ``M``/``N``/``R``, and the
    looping backward passes' ``ITERS`` and gradient buffers, by the host's own code on meta
    tensors (each operand contiguous at its broadcast shape)."""
    from gemc.backends.triton.codegen import host
    from gemc.backends.triton.codegen.spec import reduced_value

    st = json.loads(module.STRUCTURE)
    impl = host._IMPLS[st["kind"]](module, binding)
    bf16 = {"dtype": torch.bfloat16, "device": "meta"}
    inputs = [torch.empty((), **bf16) for _ in range(st["inputs"])]
    for j, slot in enumerate(st["slots"]):
        shape = [1 if b else s for s, b in zip(impl.consumer_shape(j), slot["bcast"])]
        inputs[slot["input"]] = torch.empty(shape, **bf16)
    red = reduced_value(st)
    arg = st["ops"][red]["args"][0][1] if red is not None else None

    def shape_of(j: int, k: int) -> tuple[int, ...]:
        return impl.shapes[arg] if k == red else impl.shapes[k]

    grads = []
    for j, k in enumerate(st["outputs"]):
        g = torch.empty(impl.shapes[k], **bf16)
        grads.append(g.unsqueeze(-2).expand(shape_of(j, k)) if k == red else g)
    outs = [torch.empty(impl.shapes[k], **bf16) for k in st["outputs"]]
    values = {**impl.slot_args(inputs), **impl.class_args(False), **impl.class_args(True),
              **impl.grad_args(grads, inputs[0], shape_of),
              **impl.reloaded_args(impl.saved(inputs, outs))}
    if red is not None:
        r = impl.shapes[arg][-2]
        m, n = host._mn(impl.shapes[arg])
        values["R"] = r
    else:
        m, n = host._mn(impl.shapes[st["outputs"][0]])
    bn = host.next_pow2(n, 16) if st["kind"] == "norm" else host._tile_n(n)
    programs, iters = host._row_programs(m, host._loop_rows(bn))
    dargs, _ = impl.slot_grad_buffers(inputs, [True] * len(inputs), partial_rows=programs,
                                      partial_cols=triton.cdiv(n, bn))
    values.update(dargs, M=m, N=n, ITERS=iters)
    return values


def resources(kernel: Any, constants: dict[str, Any], num_warps: int,
              num_stages: int, values: dict[str, Any] | None = None) -> dict[str, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, const, attrs = signature(kernel, constants, values)
    compiled = triton.compile(ASTSource(fn, signature=sig, constexprs=const, attrs=attrs),
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
        return {"BLOCK_N": bn, "BLOCK_M": host._loop_rows(bn), "STAGES": host.LOOP_STAGES}
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
    values = launch_values(module, entry["binding"])
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
                row.update(resources(kernel, consts, warps, stages, values))
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
