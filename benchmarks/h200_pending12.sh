#!/usr/bin/env bash
# What the twelfth session left for the H200 (one device call, < 9 min):
#   1. mmoe and sasrec_bst, gemc, cold, 30 steps: the static-first token count (05229b7):
#      BST back at its static step (24.00 ms at cb3e7e2; 25.93 marked dynamic at d8fb791),
#      MMoE one recompile at its second bucket and none after (the row's step_ms_all and
#      graph_executor.packed_token_counts);
#   2. dlrm, gemc, cold, 6 steps with Triton's kernel dump: which kernel compiles again
#      at the second step (0.30-0.40 s on every model with the batched lookup);
#   3. the sparse route's duplicate price for issue 19 (scatter_add_contention --sparse-rows);
#   4. HSTU's silu attention variants (kernels.py --cases silu_variants): the one-kernel
#      backward's error now at the two-kernel path's (the timed runs no longer add into dq).
#   GEMC_COMMIT=<this checkout's sha, typed: git on the GPU machine's copy answers a stale one> bash benchmarks/h200_pending12.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }
timeout 230 python3 benchmarks/zoo.py --out "$OUT/p1" --models mmoe,sasrec_bst \
  --variants gemc --steps 30 --warmup 3 --cold --time-limit 220 --child-timeout 110 \
  > "$OUT/p1.log" 2>&1
echo "== 1. mmoe, sasrec_bst gemc (exit $?)"
quiet < "$OUT/p1.log" | grep -E "first step|gemc  |^== |rror" | cut -c1-300
python3 - "$OUT/p1/zoo.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, rows in d["variants"].items():
    for r in rows:
        ge = (r.get("runner_report") or {}).get("graph_executor") or {}
        print(m, r["variant"], r.get("step_ms"), [round(x / 1e3, 2) for x in (r.get("step_ms_all") or [])[:6]],
              "variants", len(ge.get("compiled_variants") or []), "counts", ge.get("packed_token_counts"))
PY
# 2. every Triton compile of the gemc row dumped (Triton's TRITON_KERNEL_DUMP: one directory
#    per compiled variant, keyed by the source and its specialisation): a kernel dumped
#    twice compiled again, and its two tt.func signatures say which attribute differed
TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR="$OUT/p2dump" timeout 120 python3 benchmarks/zoo.py \
  --out "$OUT/p2" --models dlrm --variants gemc --steps 6 --warmup 0 --cold --child-timeout 110 \
  > "$OUT/p2.log" 2>&1
echo "== 2. dlrm gemc 6 steps (exit $?)"
python3 - "$OUT/p2/zoo.json" "$OUT/p2dump" <<'PY'
import collections, glob, json, os, sys  # noqa: E401
d = json.load(open(sys.argv[1]))
r = d["variants"]["dlrm"][0]
print("steps s", [round(x / 1e3, 3) for x in r.get("step_ms_all") or []])
print("first step compiles", r["runner_report"]["first_step"]["triton_in_process"])
found = collections.defaultdict(list)  # kernel name -> its variants' tt.func lines
for f in glob.glob(os.path.join(sys.argv[2], "*", "*.ttir")):
    head = next((line.strip() for line in open(f) if "tt.func" in line), "")
    found[os.path.basename(f)[:-5]].append(head)
for name, heads in sorted(found.items()):
    print(f"{name}: {len(heads)} variant(s)")
    if len(heads) > 1:  # the signatures' attributes (tt.divisibility, constants) differ
        for h in heads:
            print("   ", h[:600])
PY
timeout 100 python3 benchmarks/scatter_add_contention.py --no-grid --sparse-rows \
  --out "$OUT/sparse_rows.json" > "$OUT/p3.log" 2>&1
echo "== 3. sparse rows (exit $?)"; tail -15 "$OUT/p3.log" | cut -c1-300
timeout 120 python3 benchmarks/kernels.py --cases silu_variants --no-compile \
  --out "$OUT/silu_variants.json" > "$OUT/p4.log" 2>&1
echo "== 4. silu variants (exit $?)"; grep -E "silu variant|rror" "$OUT/p4.log" | cut -c1-300
cd "$OUT" && tar czf pending12.tar.gz p1 p2 p2dump 2>/dev/null && rm -rf p1 p2 p2dump
