#!/usr/bin/env bash
# The eleventh session's third device call (< 9 min on one H200), issue 16's first step
# after the batched lookup's outputs became column views (one view per run of adjacent
# tables joined by the model's cat / stack: no copy kernel a table, forward or backward):
#   1. gem and wukong, torch.compile and gemc, cold, 30 steps, side by side;
#   2. dlrm and mmoe, gemc alone, cold, 30 steps (their torch.compile rows: this session's
#      first call, h200_session11.sh, same machine type).
#   bash benchmarks/h200_session11c.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }
timeout 330 python3 benchmarks/zoo.py --out "$OUT/zc" --models gem,wukong \
  --variants compile,gemc --steps 30 --warmup 3 --cold --time-limit 320 --child-timeout 150 \
  > "$OUT/zc.log" 2>&1
echo "== 1. zoo gem, wukong (exit $?)"
quiet < "$OUT/zc.log" | grep -E "first step|gemc  |compile  |^== |rror" | cut -c1-420
timeout 190 python3 benchmarks/zoo.py --out "$OUT/zd" --models dlrm,mmoe \
  --variants gemc --steps 30 --warmup 3 --cold --time-limit 180 --child-timeout 100 \
  > "$OUT/zd.log" 2>&1
echo "== 2. zoo dlrm, mmoe gemc (exit $?)"
quiet < "$OUT/zd.log" | grep -E "first step|gemc  |^== |rror" | cut -c1-420
cd "$OUT" && tar czf rows_c.tar.gz zc zd 2>/dev/null && rm -rf zc zd
