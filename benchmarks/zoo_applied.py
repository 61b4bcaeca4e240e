"""What gemc applied to each zoo model (h200 preset, h200:1x1), compiled on the CPU.

    .venv/bin/python benchmarks/zoo_applied.py [--preset h200] [--topology h200:1x1] [--json OUT]

For every model of ``examples/zoo`` this compiles the preset through ``gemc.compile`` (on
meta, as ``gemc compile`` does) and prints one markdown table: the generated kernels by
kind, whether the jagged-attention and packed-token rewrites applied, how many table
lookups the batched embedding kernel took, folded transposed linears, the precision choice,
the compile time, and the compiler's own warnings. It also counts, in the captured ATen
graph, the ops those rewrites look for (``scaled_dot_product_attention``,
``embedding_bag`` with per-sample weights, ``embedding``, ``einsum``/``bmm``), so a rewrite
that did not apply can be told apart from a pattern that is not there.

Everything in the table is *measured* from the compile (plan, warnings, graph) except the
"why not" column's reasons, which are *inferred* from the passes' stated match rules
(``passes/*.py`` docstrings) and say so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.zoo import MODELS  # noqa: E402
from gemc.api import compile as gemc_compile  # noqa: E402
from gemc.api import load_model  # noqa: E402
from gemc.capture import capture  # noqa: E402

aten = torch.ops.aten

# Why a rewrite does not apply, inferred from each model's idiom and the pass's match rules.
WHY_NOT = {
    "dlrm_dcnv2": (
        "no sequence: jagged attention / packed tokens have nothing to match; the DCNv2 "
        "x0 * (W(Vx) + b) + x products are matmul on a transposed weight, not nn.Linear, "
        "so only the MLP Linears get GEMM epilogues"
    ),
    "hstu": (
        "the pointwise silu(QK^T+rab)/n attention (einsum) is the jagged SiLU kernel over "
        "the history's offsets (match-silu-attention: keys zero-padded by index_put); its "
        "token-wise ops already run on the jagged [N, D] values, and the attention runs "
        "inside packed regions (one per layer: q, k, v, each padded by index_put, are its "
        "sources; the attention reads their tokens and writes its output as one, and the "
        "model's gather at the jagged positions reads the tokens: no padded q, k, v or "
        "output); "
        "the item nn.Embedding (padding_idx) is not a bag for group-embeddings"
    ),
    "sasrec_bst": (
        "nn.MultiheadAttention (need_weights left True) exports as baddbmm + softmax + bmm: "
        "match-softmax-attention takes it as a guarded attention (its key_padding_mask is "
        "a bool built in the graph, checked at run time; the target appended after the "
        "padding makes it a non-prefix, so the compacted path runs); the whole history "
        "tower (lookups, MHA's [L, B*H, d] head views, projections, LayerNorms, LeakyReLU "
        "FFN) is one guarded packed region, compact (its kept tokens in order, so the "
        "non-prefix mask packs too); the nn.Embedding lookups are not bags"
    ),
    "din": (
        "target attention is an MLP over [h,c,h-c,h*c] (no SDPA); Dice's batch statistics "
        "(mean/var over all B*L rows) read the padded tokens, so the history packs with one "
        "weighted representative per row with padding (pad_rep: the statistics weighted, "
        "each row's padded ids checked equal per call, padded on a miss); bags with "
        "per_sample_weights are excluded from group-embeddings"
    ),
    "wukong": (
        "no sequence: nothing for jagged attention / packed tokens; the 2-D [B, P] bag ids "
        "reach ATen as 1-D ids + offsets, so the batched bag takes them; fold-transposed-"
        "linear matches linear(transpose(x)), and the LCB/residual are einsum('mn,bnd->bmd')"
    ),
    "mmoe": (
        "the target attention (additive float mask from history_len) is a guarded "
        "attention and the history tower around it a guarded packed region; the tower's "
        "causal SDPA(is_causal=True) with no mask runs as the jagged causal kernel on the "
        "region's tokens (a real query sees only real keys when the padding is a suffix, "
        "which the region's check proves each step); an empty history's all -1e4 row "
        "keeps every key (eager attends over all of them), so that row runs packed at its "
        "full length; the target attention (one query, outside the region) keeps SDPA "
        "under the priced choice (its per-call guard sync costs more than the padded "
        "attention); the nn.Embedding lookups are not bags"
    ),
    "transact": (
        "nn.TransformerEncoder's additive float key mask (padding OR'd with the random time "
        "window, the latest action kept) is a guarded key-padding attention: the window "
        "masks the latest actions, so the mask is no prefix on most rows: their kept keys "
        "are gathered first and the varlen-key kernel runs over them (compacted, counted); "
        "the un-masked max pool and the first-tokens slice read the padded positions' "
        "outputs (as the published module does), so the encoder packs over padding "
        "representatives laid out from its sources (pad_rep, rep_layout 'sources': each "
        "row's trailing run of equal ids and items one token; the attentions and those "
        "readers on the padded values the representatives scatter to, eager's)"
    ),
}


def graph_ops(entrypoint: str, args: dict[str, Any]) -> dict[str, int]:
    """Ops of the captured ATen graph that the pattern passes look for."""
    gm = capture(load_model(entrypoint, args), entrypoint=entrypoint).gm
    ops: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is aten.scaled_dot_product_attention.default:
            ops["sdpa"] += 1
            if node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5]):
                ops["sdpa_causal"] += 1
        elif target in (aten.embedding_bag.default, aten.embedding_bag.padding_idx):
            ops["embedding_bag"] += 1
            # aten.embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
            #                    per_sample_weights, include_last_offset, padding_idx)
            psw = node.args[6] if len(node.args) > 6 else node.kwargs.get("per_sample_weights")
            if psw is not None:
                ops["bag_weighted"] += 1
        elif target is aten.embedding.default:
            ops["embedding"] += 1
        elif target in (aten.einsum.default, aten.bmm.default):
            ops["einsum_bmm"] += 1
        elif target is aten.linear.default:
            ops["linear"] += 1
        elif target is aten.layer_norm.default:
            ops["layer_norm"] += 1
    return dict(ops)


def applied(name: str, preset: str, topology: str) -> dict[str, Any]:
    entrypoint = f"{REPO / 'examples' / 'zoo' / name}.py:build"
    args = {"preset": preset}
    start = time.perf_counter()
    plan = gemc_compile(entrypoint, args, topology=topology)
    seconds = time.perf_counter() - start
    kinds = Counter(k["kind"] for k in plan["kernels"])
    batched = [k for k in plan["kernels"] if k["kind"] == "batched_embedding_bag"]
    entry = plan["precision"][0] if plan["precision"] else {}
    gemms = Counter(site["gemms"][g]["dtype"] for site in entry.get("sites", [])
                    for g in ("fwd", "dgrad", "wgrad") if g in site.get("gemms", {}))
    probe = entry.get("probe") or {}
    precision = {"baseline": entry.get("dtype", "fp32"), "gemms": dict(gemms),
                 "probe": "skipped: " + probe["skipped"] if "skipped" in probe else "measured"}
    return {
        "model": name,
        "compile_s": round(seconds, 1),
        "kernels": dict(sorted(kinds.items())),
        "batched_lookups": sum(len(k["tables"]) for k in batched),
        "tables": len(plan["tables"]),
        "precision": precision,
        "predicted_step_ms": plan["predicted"]["step_ms"],
        "predicted_memory_gb": plan["predicted"]["max_memory_gb"],
        "warnings": plan["warnings"],
        "graph": graph_ops(entrypoint, args),
        "attention_choice": attention_choices(plan),
    }


def attention_choices(plan: dict[str, Any]) -> list[str]:
    """Each matched attention's priced choice (passes/attention_choice): gemc's kernel kept,
    with both prices from its plan entry, or the model's attention kept, from the pass's
    warning (its node, both prices and why)."""
    out = []
    for k in plan["kernels"]:
        p = (k.get("predicted") or {}).get("attention")
        if p:
            out.append(f"{k['name']}: gemc {p['gemc_ms']:.3g} ms vs padded "
                       f"{p['padded_ms']:.3g} ms (fill {p['fill']:.2g})")
    for w in plan["warnings"]:
        if "kept-padded: " in w:
            node = w.split(":", 1)[1].split(" stays", 1)[0].strip()
            why = w.split("kept-padded: ", 1)[1].split("; GEMC_ATTENTION_KERNEL", 1)[0]
            sync = " + the guard's host sync" if "host sync" in why else ""
            out.append(f"{node} kept SDPA: {why.split(' for the model')[0]}{sync}")
    return out


def packed_refusals(warnings: list[str]) -> list[str]:
    """Why ``pack-jagged-tokens`` left a history padded, from the plan's warnings: the text
    after "stays padded" (what reads the padded tokens, in which module; or what the
    runner lacks to pack it)."""
    out = []
    for w in warnings:
        if not w.startswith("pack-jagged-tokens:") or "stays padded" not in w:
            continue
        why = w.split("stays padded", 1)[1].lstrip(": (").rstrip(")")
        subject = w[len("pack-jagged-tokens:"):].split("stays padded", 1)[0].strip()
        out.append(f"{subject}: {why}")
    return out


ATTENTION = {"jagged_attention": "jagged", "key_padding_attention": "guarded",
             "jagged_silu_attention": "silu", "jagged_query_attention": "jagged queries"}  # kernel kind -> its name in the table


def _cell(row: dict[str, Any]) -> list[str]:
    k, g = row["kernels"], row["graph"]
    fused = ", ".join(f"{kind} {n}" for kind, n in k.items()
                      if kind not in (*ATTENTION, "packed_tokens",
                                      "batched_embedding_bag", "transposed_linear")) or "none"
    made = ", ".join(f"{ATTENTION[kind]} {k[kind]}" for kind in ATTENTION if k.get(kind))
    attn = (f"yes ({made})" if made
            else f"no (graph: {g.get('sdpa', 0)} SDPA, {g.get('sdpa_causal', 0)} causal)")
    packed = f"yes ({k['packed_tokens']})" if k.get("packed_tokens") else "no"
    refused = packed_refusals(row["warnings"])
    if refused:  # the pass's own reasons, from the plan's warnings (measured, not inferred)
        packed += "; stays padded: " + " | ".join(refused)
    bags = g.get("embedding_bag", 0)
    batched = (f"{row['batched_lookups']} of {bags} bags in {k.get('batched_embedding_bag', 0)} "
               f"kernel(s) ({g.get('bag_weighted', 0)} weighted bags); "
               f"nn.Embedding lookups {g.get('embedding', 0)}")
    p = row["precision"]
    precision = (f"{p['baseline']}; GEMMs " + ", ".join(f"{d} {n}" for d, n in p["gemms"].items())
                 + f"; probe {p['probe'][:60]}")
    warned = "; ".join(w.split(":")[0] for w in row["warnings"]) or "-"
    return [row["model"], fused, attn, packed, batched, str(k.get("transposed_linear", 0)),
            precision, f"{row['predicted_step_ms']:.1f}",
            f"{row['predicted_memory_gb']:.1f}", str(row["compile_s"]), warned,
            "; ".join(row.get("attention_choice") or ()) or "-",
            WHY_NOT.get(row["model"], "")]


HEADER = ["model", "fused kernels (measured)", "jagged attention", "packed tokens",
          "batched embeddings", "fold-transposed-linear", "precision", "pred. step ms",
          "pred. GB", "compile s", "warnings (passes)",
          "attention choice (priced, ms fwd+bwd)", "why not (inferred)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="h200")
    parser.add_argument("--topology", default="h200:1x1")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--from-json", default=None,
                        help="print the table from rows a previous run wrote (no compile)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if opts.from_json:
        rows = json.loads(Path(opts.from_json).read_text())
    else:
        rows = [applied(m, opts.preset, opts.topology) for m in opts.models.split(",")]
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in rows:
        print("| " + " | ".join(_cell(row)) + " |")
    for row in rows:
        for w in row["warnings"]:
            print(f"\n- {row['model']}: {w}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
