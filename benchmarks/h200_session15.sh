#!/usr/bin/env bash
# The fifteenth session's second H200 call (after issue 16's three parts), < 8 minutes:
#   1. the zoo's attentions and the history-query kernel at the h200 shapes (issue 17);
#   2. narrow shards in one pooled-lookup launch (issue 19/21's owner route);
#   3. the data-parallel replicas' bucketed step on the GPU beside its price (issue 19);
#   4. MMoE cold, torch.compile and gemc, 1 step, Inductor's output code kept: what
#      Inductor compiles in gemc's graph that it does not in torch.compile's (issue 16).
#   GEMC_COMMIT=<this checkout's sha, typed: git on the GPU machine's copy answers a stale one> bash benchmarks/h200_session15.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 230 python3 benchmarks/kernels.py --cases zoo,query,narrow,narrow_group \
  --out "$OUT/kernels_s15.json" > "$OUT/kernels_s15.log" 2>&1
echo "== 1-2. kernels (exit $?)"
grep -vE "Warning|warn" "$OUT/kernels_s15.log" | grep -E "zoo |narrow|query|target|rror" | cut -c1-250
timeout 60 python3 benchmarks/replica_step.py --device cuda --out "$OUT/replica_step.json" \
  > "$OUT/replica_step.log" 2>&1
echo "== 3. replica step (exit $?)"; tail -12 "$OUT/replica_step.log" | cut -c1-250
timeout 130 python3 benchmarks/zoo.py --out "$OUT/mmoe_code" --models mmoe \
  --variants compile,gemc --steps 1 --warmup 0 --cold --child-timeout 100 \
  --keep-output-code "$OUT/mmoe_code/code" > "$OUT/mmoe_code.log" 2>&1
echo "== 4. mmoe output code (exit $?)"
grep -E "first step" "$OUT/mmoe_code.log" | cut -c1-400
for d in "$OUT"/mmoe_code/code/*; do
  echo "$d: $(ls "$d" | wc -l) files, $(grep -l "def call" -r "$d" | wc -l) graphs," \
    "$(grep -ho "^def triton_[a-z_0-9]*\|^triton_[a-z_0-9]* = async_compile" -r "$d" | wc -l) kernels," \
    "$(grep -c "autotune\|triton_heuristics" -r "$d" | awk -F: '{s+=$2} END {print s}') heuristic lines"
done
cd "$OUT" && tar czf mmoe_code.tar.gz mmoe_code && rm -rf mmoe_code
