"""What gemc applied to each sequence probe (models written in other authors' idioms), on the CPU.

    .venv/bin/python benchmarks/probes_applied.py [--topology h200:1x1] [--only NAME,...] [--json OUT]

The probes (``tests/models/probes*/``: RecBole's SASRec / BERT4Rec, Hugging Face BERT,
generative-recommenders' HSTU, TiSASRec, DIN / DIEN-style target attention, ...) are the
cases of ``tests/test_probes_sequence.py`` and ``tests/test_probes_sequence_c.py``, where
each one is trained against eager. This compiles every case (``gemc.api.compile``, on meta)
and prints one markdown row per case: the attention kernels that applied, whether the
history was packed, and the compiler's own words where a jagged rewrite did not apply
(``match-*`` and ``pack-jagged-tokens`` warnings). Why: issue 17 asks for variable-length
histories recognised "in every form users write"; the zoo shows seven models, this shows
the forms, and which of them still run padded and why. Everything in the table is read off
the plans; nothing is inferred.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gemc.api import compile as gemc_compile  # noqa: E402

ATTENTIONS = ("key_padding_attention", "jagged_attention", "jagged_silu_attention",
              "jagged_query_attention", "softmax_attention")
WHY = ("match-jagged-attention", "match-softmax-attention", "match-silu-attention",
       "pack-jagged-tokens")


def cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every sequence probe case, name -> (entrypoint, kwargs)."""
    from tests import test_probes_sequence as a
    from tests import test_probes_sequence_c as c

    return {name: (mod._entry(module), args)
            for mod in (a, c) for name, (module, args) in mod.CASES.items()}


def applied(entry: str, args: dict[str, Any], topology: str) -> dict[str, Any]:
    """One case's row: its kernels by kind, packed or not, and the rewrites' warnings."""
    t0 = time.perf_counter()
    plan = gemc_compile(entry, args, topology=topology)
    kinds = Counter(k["kind"] for k in plan["kernels"])
    regions = [k for k in plan["kernels"] if k["kind"] == "packed_tokens"]
    return {
        "attention": {k: kinds[k] for k in ATTENTIONS if kinds.get(k)},
        "causal": sorted({bool(k.get("causal")) for k in plan["kernels"]
                          if k["kind"] in ATTENTIONS}),
        "packed_regions": kinds.get("packed_tokens", 0),
        # readers of one token per row the regions check at run time (their op)
        "checked_reads": sorted({r["reader"] for k in regions for r in k.get("reads") or ()}),
        # where a region's fill came from: the example batch, or why it is priced padded
        "fill_source": sorted({str(k.get("fill_source")) for k in regions
                               if k.get("guard")}),
        "why_not": [w for w in plan.get("warnings", []) if w.startswith(WHY)],
        "compile_s": round(time.perf_counter() - t0, 1),
    }


def _row(name: str, r: dict[str, Any]) -> str:
    att = ", ".join(f"{k} {v}" for k, v in r["attention"].items()) or "-"
    if True in r["causal"]:
        att += " (causal)"
    why = "; ".join(w.split(": ", 1)[1][:160] for w in r["why_not"][:2]) or "-"
    packed = str(r["packed_regions"] or "no")
    if r.get("checked_reads"):
        packed += f" (+ readout {', '.join(r['checked_reads'])} checked)"
    return f"| {name} | {att} | {packed} | {why} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="h200:1x1")
    p.add_argument("--only", default=None, help="comma-separated case names")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    every = cases()
    names = list(every) if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in every]
    if unknown:
        p.error(f"no probe case {', '.join(unknown)}; the cases: {', '.join(every)}")
    rows: dict[str, Any] = {}
    print("| case | attention kernels | packed regions | why not (the compiler's words) |")
    print("|---|---|---|---|")
    for name in names:
        entry, kwargs = every[name]
        try:
            rows[name] = applied(entry, kwargs, args.topology)
        except Exception as exc:  # a row that fails to compile is a finding, not a stop
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"| {name} | compile failed: {rows[name]['error'][:160]} | | |", flush=True)
            continue
        print(_row(name, rows[name]), flush=True)
    if args.json:
        out = Path(args.json)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps({"topology": args.topology, "rows": rows}, indent=1) + "\n")
        tmp.replace(out)
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
