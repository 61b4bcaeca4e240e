"""Where TransAct's region attention spends its GPU time: the forward with and without its
per-key bias, autotuned, and the whole fwd+bwd, with the compiled kernels' registers.

    python3 benchmarks/transact_attention_probe.py        # GPU (~40 s); writes $OUT or /tmp

Why: ``attention_gpu_time.py --models transact`` found the region attention's kernels, not
the host, at 1.87 ms fwd+bwd against padded cuDNN's 0.95 on an H100 (twenty-seventh
session), the forward alone 0.85 ms. This times ``gemc::jagged_attention_values`` on the
region's tokens (``kernels.transact_region``, the model's h200 batch) with its per-key bias
and without it, which separated the bias's load from the rest (0.873 against 0.189 ms before
``KEY_BIAS``; BENCHMARKS.md), then autotuned, then the region's fwd+bwd; it prints each
compiled attention kernel's registers, spills, shared memory, warps and stages.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import attention_gpu_time as agt  # noqa: E402
import kernels as kbench  # noqa: E402


def main() -> list[dict]:
    from gemc.backends.triton import (
        config_choice,
        ops,  # noqa: F401  (registers the gemc:: ops)
    )
    from gemc.backends.triton import packed_tokens as pt

    if not torch.cuda.is_available():
        raise SystemExit("transact_attention_probe.py times GPU kernels: run it on a GPU")
    ja = importlib.import_module("gemc.backends.triton.jagged_attention")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    batch = kbench.transact_batch("h200", gen, dev)
    region = kbench.transact_region(batch, torch.bfloat16, gen, dev)
    q, k, v, g = region.inputs
    lay = region.layout
    qj, kj, vj = (pt.token_major(x.detach(), (0, 2)) for x in (q, k, v))
    bias, _ = pt.rep_key_bias(batch.mask, True, lay)
    scale = float(batch.scale)
    print("q", tuple(qj.shape), qj.stride(), "max_len", lay.max_len, "bias",
          tuple(bias.shape), flush=True)

    def fwd(with_bias: bool):
        def call() -> torch.Tensor:
            with torch.no_grad():
                return torch.ops.gemc.jagged_attention_values(
                    qj, kj, vj, lay.offsets, lay.max_len, scale, False,
                    bias if with_bias else None)
        return call

    rows = [agt.measure("fwd op, key bias", fwd(True), dev),
            agt.measure("fwd op, no bias", fwd(False), dev)]
    os.environ[config_choice.AUTOTUNE_ENV] = "1"
    config_choice.forget("jagged_attention.")
    try:
        rows.append(agt.measure("fwd op, key bias, autotuned", fwd(True), dev))
        print(json.dumps(config_choice.ran("jagged_attention.")), flush=True)
    finally:
        os.environ.pop(config_choice.AUTOTUNE_ENV, None)
        config_choice.forget("jagged_attention.")
    rows.append(agt.measure("region fwd+bwd", lambda: torch.autograd.grad(
        region.fwd(), (q, k, v), g), dev))
    for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        tuner = getattr(ja, name)
        fn = getattr(tuner, "fn", tuner)
        for caches in (getattr(fn, "device_caches", None) or {}).values():
            cache = caches[0] if isinstance(caches, tuple) else caches
            for compiled in cache.values():
                md = getattr(compiled, "metadata", None)
                print(name, "regs", getattr(compiled, "n_regs", None), "spills",
                      getattr(compiled, "n_spills", None), "shared",
                      getattr(md, "shared", None), "warps", getattr(md, "num_warps", None),
                      "stages", getattr(md, "num_stages", None), flush=True)
    out = Path(os.environ.get("OUT", "/tmp")) / "probe_transact.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    tmp.replace(out)
    return rows


if __name__ == "__main__":
    main()
