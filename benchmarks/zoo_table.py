"""Several ``benchmarks/zoo.py`` runs (one per device call, one commit) merged into one
report with issue 16's verdicts.

    python benchmarks/zoo_table.py A/zoo.json B/zoo.json C/zoo.json --out DIR

Why: issue 16 asks for every model, eager bf16 / torch.compile / gemc, cold, 30 steps, side
by side, and that takes longer than one device call may run (10 minutes), so
``benchmarks/h200_issue16.sh a|b|c`` splits the models over three calls and this joins
their zoo.json files. It prints zoo.py's table per model and its summary, then each of
issue 16's conditions as PASS or FAIL with its numbers:

- every model (the two examples and ``examples/zoo``) has eager, compile and gemc rows
  without error;
- gemc >= 1.0x torch.compile (samples/s) on every model, >= 1.5x geometric mean, and the
  GEM example >= 1.6x;
- gemc's first step <= 1.5x torch.compile's, per model;
- each curve has 30+ steps and gemc's is within ``zoo.loss_tolerance`` of eager's.

Beside the verdicts it lists the later steps that compiled again (:func:`late_steps`): issue
16 judges the first step, and a recompile at a later step (MMoE's second token bucket cost
gemc 20.4 s at its third step in the twelfth session's run) is the same cost paid later.

It refuses files measured on different source trees (``provenance.source_hash``: zoo.py
records it, as on the GPU machine there is no ``.git``), torch versions, devices or run
settings, naming them, unless ``--allow-mixed`` (then every row is labelled with its file
and commit). A later file's row for the same model and variant replaces an earlier one,
and the report says so. Writes ``DIR/zoo.json`` (zoo.py's format plus ``merged_from``,
``replaced``, ``late_steps`` and ``verdicts``) and ``DIR/report.txt``; exit 0 when every condition passes,
1 when one fails, 2 when the files were refused.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import zoo  # noqa: E402  (the table, the summary and the tolerance, shared)

BASE_VARIANTS = ("eager", "compile", "gemc")
MIN_STEPS = 30
MIN_X_COMPILE, MIN_GEOMEAN, MAX_FIRST_STEP_X, MIN_GEM_X = 1.0, 1.5, 1.5, 1.6
SAME = ("source_hash", "torch", "gpu", "device", "preset", "steps", "warmup")
"""What the files must agree on to be one measurement (``source_hash`` is read from each
file's ``provenance``)."""


class MixedRuns(ValueError):
    """The files were not measured alike; the message names them and the fix."""


def _fact(doc: dict[str, Any], key: str) -> Any:
    if key == "source_hash":
        return (doc.get("provenance") or {}).get("source_hash") or "unrecorded"
    return doc.get(key)


def label(path: str, doc: dict[str, Any]) -> str:
    """A file's short name in the table: its directory and its commit (or tree hash; both
    where the checkout had changes beyond the commit)."""
    prov = doc.get("provenance") or {}
    commit, tree = (prov.get("git_commit") or "")[:8], (prov.get("source_hash") or "")[:8]
    ref = (f"{commit}+{tree[:6]}" if commit and prov.get("git_dirty") else commit) \
        or tree or "?"
    p = Path(path)
    return f"{p.parent.name if p.name == 'zoo.json' else p.stem}@{ref}"


def check_alike(docs: list[tuple[str, dict[str, Any]]]) -> None:
    """Raise ``MixedRuns`` if the files differ in any of ``SAME``."""
    diffs = []
    for key in SAME:
        values = {str(_fact(doc, key)) for _, doc in docs}
        if len(values) > 1 or "unrecorded" in values:  # no tree recorded: not one commit
            diffs.append(f"{key}: " + ", ".join(f"{path} = {_fact(doc, key)}"
                                                for path, doc in docs)
                         + (" (written before zoo.py recorded its source tree)"
                            if "unrecorded" in values else ""))
    if diffs:
        raise MixedRuns(
            "zoo_table: refusing to merge zoo.json files measured differently:\n  "
            + "\n  ".join(diffs)
            + "\nFix: run every part at one commit (bash benchmarks/h200_issue16.sh PART, "
            "all parts from the same working tree, same settings), or pass --allow-mixed "
            "to merge anyway with every row labelled by its file and commit.")


def merge(docs: list[tuple[str, dict[str, Any]]], allow_mixed: bool = False
          ) -> dict[str, Any]:
    """One zoo.json from several, later rows replacing earlier ones (listed in
    ``replaced``); loss deviations recomputed against the merged eager row."""
    try:
        check_alike(docs)
        mixed = False
    except MixedRuns:
        if not allow_mixed:
            raise
        mixed = True
    facts: dict[str, Any] = {}
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    replaced: list[str] = []
    skipped: list[str] = []
    for path, doc in docs:
        facts.update(doc.get("models") or {})
        skipped += doc.get("skipped") or []
        for name, model_rows in (doc.get("variants") or {}).items():
            for r in model_rows:
                old = rows.setdefault(name, {}).get(r["variant"])
                if old is not None:
                    replaced.append(f"{name}/{r['variant']}: {old['source_file']} -> {path}")
                rows[name][r["variant"]] = {**r, "source_file": path,
                                            "source": label(path, doc)}
    order = {v: i for i, v in enumerate(zoo.VARIANTS)}
    variants: dict[str, list[dict[str, Any]]] = {}
    for name, by in rows.items():
        variants[name] = sorted(by.values(), key=lambda r: order.get(r["variant"], 99))
        for r in variants[name]:
            r.pop("max_rel_loss_diff_vs_eager", None)
        zoo.e2e._compare_losses(variants[name])
    skipped = [s for s in dict.fromkeys(skipped)
               if s.split("/", 1)[-1] not in rows.get(s.split("/", 1)[0], {})]
    first = docs[0][1]
    return {**{k: first.get(k) for k in ("device", "gpu", "torch", "preset", "steps",
                                         "warmup", "peak_flops", "provenance")},
            "mixed": mixed,
            "merged_from": [{"file": p, "label": label(p, d), "provenance": d.get("provenance"),
                             **{k: d.get(k) for k in SAME[1:]}} for p, d in docs],
            "replaced": replaced, "models": facts, "variants": variants,
            "summary": zoo.summary(variants), "skipped": skipped}


def _verdict(check: str, ok: bool, detail: str, model: str | None = None) -> dict[str, Any]:
    return {"check": check, "model": model, "pass": bool(ok), "detail": detail}


def verdicts(merged: dict[str, Any], expected: list[str]) -> list[dict[str, Any]]:
    """Issue 16's conditions on a merged run, each PASS/FAIL with the numbers behind it."""
    out: list[dict[str, Any]] = []
    variants, per = merged["variants"], merged["summary"]["per_model"]
    missing = [f"{m}/{v}" for m in expected for v in BASE_VARIANTS
               if v not in {r["variant"] for r in variants.get(m, [])}]
    errors = [f"{m}/{r['variant']}: {r['error']}" for m in expected
              for r in variants.get(m, []) if r.get("error")]
    out.append(_verdict("every model: eager, compile, gemc measured", not missing
                        and not errors, f"{len(expected)} models; missing: "
                        f"{', '.join(missing) or 'none'}; errors: {'; '.join(errors) or 'none'}"))
    ratios = {}
    for m in expected:
        x = (per.get(m) or {}).get("gemc") or {}
        ratios[m] = x.get("x_compile")
        out.append(_verdict(f"gemc >= {MIN_X_COMPILE}x torch.compile", (ratios[m] or 0)
                            >= MIN_X_COMPILE, f"{ratios[m]:.2f}x" if ratios[m]
                            else "not measured", m))
    have = [x for x in ratios.values() if x]
    geo = math.exp(sum(math.log(x) for x in have) / len(have)) if have else None
    out.append(_verdict(f"geometric mean >= {MIN_GEOMEAN}x", geo is not None and
                        geo >= MIN_GEOMEAN and len(have) == len(expected),
                        (f"{geo:.2f}x over {len(have)} of {len(expected)} models" if geo
                         else "no model measured")))
    for m in expected:
        f = ((per.get(m) or {}).get("gemc") or {}).get("first_step_x_compile")
        by = {r["variant"]: r for r in variants.get(m, [])}
        secs = "/".join(f"{by[v]['first_step_s']:.1f}" if (by.get(v) or {}).get("first_step_s")
                        else "-" for v in ("compile", "gemc"))
        out.append(_verdict(f"first step <= {MAX_FIRST_STEP_X}x torch.compile's",
                            f is not None and f <= MAX_FIRST_STEP_X,
                            (f"{f:.2f}x" if f else "not measured")
                            + f" (compile / gemc {secs} s)", m))
    if "gem" in expected:
        gem = ratios["gem"]
        out.append(_verdict(f"GEM example >= {MIN_GEM_X}x", (gem or 0) >= MIN_GEM_X,
                            f"{gem:.2f}x" if gem else "not measured", "gem"))
    for m in expected:
        by = {r["variant"]: r for r in variants.get(m, [])}
        eager, gemc = by.get("eager") or {}, by.get("gemc") or {}
        dev = gemc.get("max_rel_loss_diff_vs_eager")
        cdev = (by.get("compile") or {}).get("max_rel_loss_diff_vs_eager")
        tol = zoo.loss_tolerance(cdev)
        steps = min(len(eager.get("losses") or []), len(gemc.get("losses") or []))
        ok = dev is not None and dev <= tol and steps >= MIN_STEPS
        out.append(_verdict(
            f"loss curve within tolerance of eager, {MIN_STEPS}+ steps", ok,
            (f"gemc {dev:.2e}" if dev is not None else
             "gemc not compared (no eager or gemc curve, or of other lengths)")
            + (f" (compile {cdev:.2e})" if cdev is not None else "")
            + f", tolerance {tol:.2e}, {steps} steps", m))
    return out


LATE_STEP_S = 1.0
"""A step after the first at least this long, and :data:`LATE_STEP_X` times the median of
the steps after the first, compiled again (a recompile costs seconds, a step milliseconds)."""
LATE_STEP_X = 20.0


def late_steps(merged: dict[str, Any]) -> list[str]:
    """Per model and variant, the steps after the first that compiled again (by their time:
    :data:`LATE_STEP_S`), as ``"mmoe/gemc: step 3 20.4 s (median 38.7 ms)"``."""
    out = []
    for name, rows in merged["variants"].items():
        for r in rows:
            later = [t / 1e3 for t in (r.get("step_ms_all") or [])[1:]]
            if not later:
                continue
            median = statistics.median(later)
            late = [(i + 2, t) for i, t in enumerate(later)
                    if t >= max(LATE_STEP_S, LATE_STEP_X * median)]
            if late:
                out.append(f"{name}/{r['variant']}: "
                           + ", ".join(f"step {i} {t:.1f} s" for i, t in late)
                           + f" (median {1e3 * median:.1f} ms)")
    return out


def verdict_text(vs: list[dict[str, Any]]) -> str:
    """The verdicts, one line each, and the overall one."""
    lines = ["\n== issue 16"]
    lines += [f"{'PASS' if v['pass'] else 'FAIL'}  {v['check']}"
              + (f" [{v['model']}]" if v["model"] else "") + f": {v['detail']}" for v in vs]
    failed = sum(not v["pass"] for v in vs)
    lines.append(f"{'PASS' if not failed else 'FAIL'}  issue 16: "
                 f"{len(vs) - failed} of {len(vs)} conditions met")
    return "\n".join(lines)


def report(merged: dict[str, Any], vs: list[dict[str, Any]]) -> str:
    """zoo.py's tables and summary for the merged rows, then where they came from and the
    verdicts."""
    lines = ["== merged: " + ", ".join(
        f"{m['label']} ({m['file']}; tree "
        f"{(m['provenance'] or {}).get('source_hash') or 'unrecorded'}, "
        f"torch {m['torch']}, {m['gpu'] or m['device']})" for m in merged["merged_from"])]
    lines += [f"replaced: {r}" for r in merged["replaced"]]
    if merged["mixed"]:
        lines.append("MIXED (--allow-mixed): rows come from different trees, torch versions, "
                     "devices or settings; each row's source is in its last column")
    for name, rows in merged["variants"].items():
        if rows:
            flops = (merged["models"].get(name) or {}).get("train_flops_per_step")
            lines.append(zoo.model_block(name, rows, flops, source=merged["mixed"]))
    lines.append(zoo.summary_text(merged["summary"], merged["skipped"]))
    here = zoo.source_hash()
    tree = (merged.get("provenance") or {}).get("source_hash")
    lines.append(f"\nthis checkout's source tree: {here} "
                 + ("(the runs' tree)" if here == tree else f"(not the runs' {tree})"))
    lines.append(f"\n== later steps that compiled again (>= {LATE_STEP_S:g} s and "
                 f"{LATE_STEP_X:g}x the later steps' median; not one of issue 16's conditions)")
    lines += merged.get("late_steps") or ["none"]
    lines.append(verdict_text(vs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="zoo.json files, earlier first (later rows win)")
    p.add_argument("--out", required=True, help="directory for the merged zoo.json and "
                   "report.txt")
    p.add_argument("--allow-mixed", action="store_true",
                   help="merge files of different trees, torch versions, devices or "
                   "settings, each row labelled with its source")
    p.add_argument("--models", default=None,
                   help="the models issue 16 expects (default: every model zoo.py knows)")
    args = p.parse_args(argv)
    docs = []
    for f in args.files:
        try:
            docs.append((f, json.loads(Path(f).read_text())))
        except (OSError, ValueError) as exc:
            print(f"zoo_table: cannot read {f}: {exc}; give zoo.json files written by "
                  f"benchmarks/zoo.py", file=sys.stderr)
            return 2
    try:
        merged = merge(docs, allow_mixed=args.allow_mixed)
    except MixedRuns as exc:
        print(exc, file=sys.stderr)
        return 2
    expected = [m.strip() for m in args.models.split(",")] if args.models \
        else list(zoo.models())
    vs = verdicts(merged, expected)
    merged["late_steps"] = late_steps(merged)
    merged["verdicts"] = vs
    text = report(merged, vs)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zoo.json").write_text(json.dumps(merged, indent=1, default=str) + "\n")
    (out / "report.txt").write_text(text + "\n")
    print(f"zoo_table: wrote {out / 'zoo.json'} and {out / 'report.txt'}", file=sys.stderr)
    return 0 if all(v["pass"] for v in vs) else 1


if __name__ == "__main__":
    sys.exit(main())
