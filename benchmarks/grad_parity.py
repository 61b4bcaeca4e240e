"""One training step of a model through gemc's rewritten graph against eager, parameter by
parameter: where does a compiled run's update differ?

Why: a loss curve that departs from eager's after step 1 says only that some update differs.
This runs the step both ways on the same batch and prints, per parameter, the relative L2
error of gemc's gradient against eager's (dense parameters) or of the fused optimizer's table
update against the reference row-wise Adagrad step on eager's gradient (tables), and how many
elements are exactly zero on one side only (a structural difference: a first Adam step moves
an element by ``lr`` whatever its gradient's size, so such elements move differently).
Then each attention kernel the plan uses against padded SDPA at the model's shapes.

    python3 benchmarks/grad_parity.py examples/gem/model.py:build --set preset=h200 \\
        --device cuda --autocast bf16 --out results.json

Runs on the CPU too (Triton interpreted; use a tiny preset there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GENERATED_KINDS = ("gemm_epilogue", "norm", "pointwise", "reduction")
"""Inductor's code by default (no measured win): leaving them out changes nothing."""


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("entry", help="model entrypoint, path.py:function")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model argument (repeatable)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--autocast", choices=("bf16", "none"), default="bf16")
    p.add_argument("--seed", type=int, default=0, help="batch seed (the batch of step 0)")
    p.add_argument("--top", type=int, default=25, help="parameters listed (worst first)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--bisect-compiled", action="store_true",
                   help="instead: the compiled step with every kernel, then with each kind "
                   "left out: the loss and the worst gradient against eager's")
    p.add_argument("--bisect", action="store_true",
                   help="instead: the forward loss through gemc's interpreter (no compile) "
                   "with every kernel, then with each kind left out, against eager's")
    return p.parse_args(argv)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _compare(name: str, got: Any, want: Any) -> dict[str, Any]:
    import torch

    got, want = got.float(), want.float()
    diff = (got - want).norm().item()
    scale = want.norm().item()
    zero_one_side = ((got == 0) != (want == 0)).sum().item()
    return {"name": name, "rel_l2": diff / scale if scale else (0.0 if diff == 0 else math.inf),
            "max_abs": (got - want).abs().max().item() if got.numel() else 0.0,
            "norm": scale, "zero_on_one_side": int(zero_one_side), "numel": got.numel(),
            "nonfinite": int((~torch.isfinite(got)).sum().item())}


def _rewritten(entry: str, model_args: dict[str, Any]) -> tuple[Any, list[Any], Any]:
    """The model (CPU, real weights), its graph after gemc's kernel passes and the plan's
    kernel entries."""
    from gemc.cost_model.topology import parse_topology
    from gemc.passes.predict_time import PredictTime

    from gemc.api import load_model, pass_context
    from gemc.capture import capture
    from gemc.pass_manager import PassManager
    from gemc.pipeline import annotation_passes, kernel_passes
    from gemc.plan_builder import kernel_entries

    spec = load_model(entry, dict(model_args), device="cpu")
    captured = capture(spec, entrypoint=entry)
    ctx = pass_context(entry, dict(model_args), captured, parse_topology("h200:1x1"))
    gm = PassManager([*annotation_passes(), PredictTime(), *kernel_passes()]).run(
        captured.gm, ctx)
    return spec, gm, kernel_entries(gm, ctx)


def bisect(entry: str, model_args: dict[str, Any], device: Any, seed: int
           ) -> list[dict[str, Any]]:
    """Eager's fp32 forward loss, then gemc's interpreter's with all kernels and with each
    kind left out (the kind whose removal restores eager's loss is the culprit)."""
    import torch
    from gemc.backends.triton.graph_runner import GraphRunner

    spec, gm, entries = _rewritten(entry, model_args)
    model = spec.model.to(device)
    batch = [t.to(device) for t in spec.make_batch(seed, "cpu")]
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        ref = model(*batch).item()
    kinds = sorted({e["kind"] for e in entries})
    rows = [{"variant": "eager", "loss": ref}]
    for left_out in [None, *kinds, "all"]:
        kept = [e for e in entries if left_out != "all" and e["kind"] != left_out]
        if left_out == "jagged_attention":
            kept = [e for e in kept if e["kind"] != "packed_tokens"]
        label = f"without {left_out}" if left_out else "every kernel"
        try:
            with torch.no_grad():
                loss = GraphRunner(gm, kept, params, device=device, narrow=False)(*batch).item()
            rows.append({"variant": label, "loss": loss, "rel": abs(loss - ref) / abs(ref)})
        except Exception as exc:  # noqa: BLE001 - a combination the runner refuses
            rows.append({"variant": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(rows[-1], flush=True)
    return rows


def graph_step(entry: str, model_args: dict[str, Any], device: Any, autocast: Any,
               seed: int, leave_out: tuple[str, ...] = (), rewritten: Any = None
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Eager and gemc's graph (Inductor around gemc's ops, less the kinds in ``leave_out``)
    on one batch: the losses and one row per parameter."""
    import torch
    from gemc.backends.triton.embedding_bag_reference import rowwise_adagrad_step_, touched_rows
    from gemc.backends.triton.inductor_graph import build, runner_for

    spec, gm, entries = rewritten or _rewritten(entry, model_args)
    if "jagged_attention" in leave_out:
        leave_out = (*leave_out, "packed_tokens")  # its region runs the attention
    entries = [e for e in entries if e["kind"] not in leave_out]
    model = spec.model.to(device)
    batch = [t.to(device) for t in spec.make_batch(seed, "cpu")]

    model.zero_grad()
    with torch.autocast(device.type, dtype=autocast or torch.bfloat16,
                        enabled=autocast is not None):
        ref = model(*batch)
    ref.backward()
    grads = {k: (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach().clone()
             for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    runner, _ = runner_for(gm, entries, params, device=device)
    built = build(runner, autocast=autocast)
    fn = torch.compile(built.module, dynamic=False)
    t0 = time.perf_counter()
    loss = fn(*batch)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0

    emb = [e for e in entries if e["kind"] == "batched_embedding_bag"]
    tables = {t["fqn"]: (t, e["optimizer"]) for e in emb for t in e["tables"]}
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"
             and "gemc.param" not in n.meta]
    inputs = dict(zip(names, batch))
    rows = []
    for k, p in model.named_parameters():
        if k in tables:
            table, opt = tables[k]
            if k not in grads:
                continue
            ids = inputs[table["ids"]]
            weight = p.detach().float().clone()
            touched = touched_rows(ids, torch.tensor([0, ids.numel()], device=ids.device), 1)[0]
            rowwise_adagrad_step_(weight, grads[k].float(),
                                  torch.zeros(weight.shape[0], device=weight.device), touched,
                                  opt["lr"], opt["eps"], opt["weight_decay"])
            base = p.detach().float()
            rows.append({**_compare(k, runner.table_weights(k).float() - base, weight - base),
                         "what": "table update"})
        elif k in grads:
            got = p.grad
            if got is None:
                rows.append({"name": k, "what": "gradient", "rel_l2": math.inf,
                             "note": "no gradient from gemc's graph"})
                continue
            rows.append({**_compare(k, got, grads[k]), "what": "gradient"})
    return {"eager_loss": ref.item(), "gemc_loss": loss.item(), "compile_s": compile_s,
            "kinds": sorted({e["kind"] for e in entries})}, rows


def attention_kernels(device: Any, dtype: Any) -> list[dict[str, Any]]:
    """The guarded key-padding attention (self and cross) and the varlen-key kernel at GEM's
    h200 shapes, against SDPA under the same boolean mask: forward and the three gradients."""
    import torch
    import torch.nn.functional as F
    from gemc.backends.triton.key_padding_attention import key_padding_attention
    from gemc.backends.triton.varlen_key_attention import varlen_key_attention

    gen = torch.Generator().manual_seed(0)
    b, h, n_len, d = (256, 4, 256, 64) if device.type == "cuda" else (3, 2, 70, 16)
    lengths = torch.randint(0, n_len + 1, (b,), generator=gen).clamp(min=1)
    keep = (torch.arange(n_len)[None] < lengths[:, None]).to(device)
    rows = []
    for queries, label in ((32, "cross M=32"), (1, "cross M=1")):  # summary / target
        q = torch.randn(b, h, queries, d, generator=gen).to(device, dtype).requires_grad_()
        kv = torch.randn(b, n_len, 2, h, d, generator=gen).to(device, dtype)
        k, v = (t.permute(0, 2, 1, 3).detach().requires_grad_() for t in kv.unbind(2))
        for fn_name, fn in (
                ("varlen_key_attention",
                 lambda q, k, v: varlen_key_attention(q, k, v, keep.sum(1).to(torch.int32))),
                ("key_padding_attention",
                 lambda q, k, v: key_padding_attention(q, k, v, keep,
                                                       zero_padding_queries=False))):
            got = fn(q, k, v)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                 attn_mask=keep[:, None, None, :])
            g_out = torch.randn(got.shape, generator=gen).to(device)
            g_got = torch.autograd.grad(got.float(), (q, k, v), g_out)
            g_ref = torch.autograd.grad(ref, (q, k, v), g_out)
            rows.append({**_compare(f"{fn_name} {label} out", got, ref), "dtype": str(dtype)})
            for which, a, w in zip("qkv", g_got, g_ref):
                rows.append({**_compare(f"{fn_name} {label} d{which}", a, w),
                             "dtype": str(dtype)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    sys.path.insert(0, str(REPO))
    device = torch.device(args.device)
    model_args = {}
    for item in args.set:
        key, _, value = item.partition("=")
        model_args[key] = _value(value)
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    result: dict[str, Any] = {"entry": args.entry, "args": model_args,
                              "autocast": args.autocast, "device": str(device),
                              "torch": torch.__version__}
    if args.bisect:
        result["bisect"] = bisect(args.entry, model_args, device, args.seed)
        _write(args.out, result)
        return 0
    if args.bisect_compiled:
        rewritten = _rewritten(args.entry, model_args)
        kinds = sorted({e["kind"] for e in rewritten[2]} - set(GENERATED_KINDS))
        result["bisect_compiled"] = []
        for left_out in [(), *((k,) for k in kinds), tuple(kinds)]:
            summary, rows = graph_step(args.entry, model_args, device, autocast, args.seed,
                                       left_out, rewritten)
            worst = max(rows, key=lambda r: r["rel_l2"])
            row = {"left_out": list(left_out), **summary, "worst": worst["name"],
                   "worst_rel_l2": worst["rel_l2"],
                   "median_rel_l2": sorted(r["rel_l2"] for r in rows)[len(rows) // 2]}
            result["bisect_compiled"].append(row)
            print({k: v for k, v in row.items() if k != "kinds"}, flush=True)
            torch._dynamo.reset()
        _write(args.out, result)
        return 0
    result["kernels"] = [r for dtype in (torch.float32, torch.bfloat16)
                         for r in attention_kernels(device, dtype)]
    print(f"{'kernel check':<48} {'rel L2':>10} {'max abs':>10} {'0 one side':>10}")
    for r in result["kernels"]:
        print(f"{r['name'] + ' ' + r['dtype'][6:]:<48} {r['rel_l2']:>10.2e} "
              f"{r['max_abs']:>10.2e} {r['zero_on_one_side']:>10}")
    summary, rows = graph_step(args.entry, model_args, device, autocast, args.seed)
    result.update(summary)
    result["params"] = rows
    print(f"\nloss eager {summary['eager_loss']:.6f}  gemc {summary['gemc_loss']:.6f}  "
          f"(first compiled step {summary['compile_s']:.1f}s; kinds {summary['kinds']})")
    rows.sort(key=lambda r: -r["rel_l2"])
    print(f"{'parameter':<48} {'what':<13} {'rel L2':>10} {'norm':>10} {'0 one side':>10}"
          f" {'numel':>10}")
    for r in rows[:args.top]:
        print(f"{r['name']:<48} {r['what']:<13} {r['rel_l2']:>10.2e} {r.get('norm', 0):>10.2e}"
              f" {r.get('zero_on_one_side', 0):>10} {r.get('numel', 0):>10}")
    _write(args.out, result)
    return 0


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
