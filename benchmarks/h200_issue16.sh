#!/usr/bin/env bash
# Issue 16's table, one H200, in three device calls at ONE commit (a device command may run
# 10 minutes; the whole set, 8 models x eager/compile/gemc cold, does not fit in one):
#   bash benchmarks/h200_issue16.sh a     # gem, hstu              (~4.5 min expected)
#   bash benchmarks/h200_issue16.sh b     # wukong, mmoe, dlrm     (~5 min)
#   bash benchmarks/h200_issue16.sh c     # din, sasrec_bst, dlrm_dcnv2 (~4.5 min)
#   bash benchmarks/h200_issue16.sh d     # transact (the zoo's seventh model, sixteenth
#                                         # session; not yet measured: ~2 min expected)
#   bash benchmarks/h200_issue16.sh x --models wukong --variants gemc   # what a part left out
# Prefix each with GEMC_COMMIT=<this checkout's sha, typed>: the GPU machine's copy answers
# git with a stale commit (fifteenth session); zoo.json's source_hash is what zoo_table.py checks.
# The split balances the ninth and eleventh sessions' cold first steps (BENCHMARKS.md:
# compile / gemc 30.6 / 51.8 s GEM, 42.9 / 25.6 HSTU, ~30 / 30 Wukong, 18 / 27 MMoE, 14 / 19
# DIN and BST, 13 / 12 DLRM-DCNv2, 7 / 14 DLRM) plus ~15 s a child for start-up and 33 steps.
# Every variant in its own process with empty compile caches (--cold), 3 untimed + 30 timed
# steps; no new variant starts after 400 s and a variant is stopped after 150 s, so a part
# ends within 9.5 minutes (zoo.json keeps what finished; what did not is listed as skipped:
# run it as part x). Output under $OUT: zoo_issue16_PART.json, zoo_issue16_PART.log and
# rows_PART.tar.gz (plans and each row with its run report). Then, on the CPU machine, with
# the three parts' zoo_issue16_*.json files in one directory R (same working tree!):
#   python benchmarks/zoo_table.py R/zoo_issue16_a.json R/zoo_issue16_b.json \
#       R/zoo_issue16_c.json R/zoo_issue16_d.json --out R/issue16
# which refuses files of different source trees (zoo.json's provenance.source_hash).
set -uo pipefail
PART="${1:?usage: bash benchmarks/h200_issue16.sh a|b|c|d|x [zoo.py arguments]}"
shift
case "$PART" in
  a) MODELS=(--models gem,hstu) ;;
  b) MODELS=(--models wukong,mmoe,dlrm) ;;
  c) MODELS=(--models din,sasrec_bst,dlrm_dcnv2) ;;
  d) MODELS=(--models transact) ;;
  *) MODELS=()
     if [[ " $* " != *" --models "* ]]; then
       echo "h200_issue16.sh: part '$PART' is not a, b, c or d: name its models, e.g." \
            "bash benchmarks/h200_issue16.sh x --models wukong --variants gemc" >&2
       exit 2
     fi ;;
esac
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 560 python3 benchmarks/zoo.py --out "$OUT/rows_$PART" "${MODELS[@]}" \
  --variants eager,compile,gemc --steps 30 --warmup 3 --cold \
  --time-limit 400 --child-timeout 150 "$@" > "$OUT/zoo_issue16_$PART.log" 2>&1
echo "== part $PART: zoo.py exit $? after $((SECONDS - t0)) s"
grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process" "$OUT/zoo_issue16_$PART.log" \
  | grep -E "^== |^ +(variant|eager|compile|gemc) |: gemc |geomean|skipped|rror|first step:" \
  | cut -c1-300
cp "$OUT/rows_$PART/zoo.json" "$OUT/zoo_issue16_$PART.json" 2>/dev/null \
  || echo "no zoo.json written: see zoo_issue16_$PART.log"
[ -d "$OUT/rows_$PART" ] && (cd "$OUT" && tar czf "rows_$PART.tar.gz" "rows_$PART" && rm -rf "rows_$PART")
python3 -c "import json,sys; p=json.load(open(sys.argv[1]))['provenance']; print('tree', p['source_hash'], 'gemc', p['gemc_version'])" \
  "$OUT/zoo_issue16_$PART.json" 2>/dev/null
echo "merge (CPU, all parts in R): python benchmarks/zoo_table.py" \
  "R/zoo_issue16_a.json R/zoo_issue16_b.json R/zoo_issue16_c.json R/zoo_issue16_d.json [R/zoo_issue16_x.json] --out R/issue16"
