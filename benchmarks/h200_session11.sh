#!/usr/bin/env bash
# The next device call (< 9.5 min on one H200): what the tenth session could not measure.
#   1. MMoE and DLRM, torch.compile and gemc, cold, 30 steps, side by side (issue 16: MMoE's
#      sparse-table lookup inside the graph, its empty-history rows on the key-lengths path
#      with operands in one dtype; DLRM with torch.compile's set-up at set-up); then
#      sasrec_bst, hstu and wukong gemc alone for the cost model's rows (issue 18);
#   2. issue 19's narrow_group case: 1, 2, 4, 8 narrow shards in one batched kernel against
#      one kernel each (is the fixed ~0.85 ms paid per rank's kernel or per shard?);
#   3. issue 21: the fp8 breakdown again (the quantisation kernels' tests on the GPU now
#      that their operands are made on the CPU).
#   bash benchmarks/h200_session11.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }
timeout 300 python3 benchmarks/zoo.py --out "$OUT/z" --models mmoe,dlrm \
  --variants compile,gemc --steps 30 --warmup 3 --cold --time-limit 280 --child-timeout 140 \
  > "$OUT/z.log" 2>&1
echo "== 1a. zoo mmoe, dlrm (exit $?)"
quiet < "$OUT/z.log" | grep -E "first step|gemc  |compile  |^== |rror" | cut -c1-420
timeout 150 python3 benchmarks/zoo.py --out "$OUT/z2" --models sasrec_bst,hstu,wukong \
  --variants gemc --steps 30 --warmup 3 --cold --time-limit 140 --child-timeout 90 \
  > "$OUT/z2.log" 2>&1
echo "== 1b. zoo sasrec_bst, hstu, wukong (exit $?)"
quiet < "$OUT/z2.log" | grep -E "gemc  |^== |rror" | cut -c1-300
echo "== 2. narrow_group"
timeout 60 python3 benchmarks/kernels.py --cases narrow_group --out "$OUT/narrow_group.json" \
  2>&1 | quiet | tail -12
OUT="$OUT/fp8" timeout 100 bash benchmarks/h200_fp8_s10.sh 2>&1 | head -12
cd "$OUT" && tar czf rows.tar.gz z z2 fp8 2>/dev/null && rm -rf z z2 fp8
