#!/usr/bin/env bash
# The ninth session's last device call (< 9.5 min on one H200), most valuable first, each
# step under its own timeout:
#   1. gemc, cold, 30 steps, on the models whose compiled graph changed this session (the
#      batched lookup and the key-padding cross-attentions inside the graph; the lookup's
#      layout as one op): GEM, DLRM, MMoE, Wukong, DLRM-DCNv2;
#   2. gemc's pooled lookup on narrow shards (issue 19: does a narrow shard cost more per
#      column, as TorchRec's estimator charges?);
#   3. fp8 under torch.compile on torch 2.11 (issue 21): compiled row-wise fp8 vs bf16 on
#      LayerNorm -> Linear at K = N = 4096 (benchmarks/h200_fp8_s9.sh's first piece), and
#      Wukong gemc-fp8 (its bf16 row is step 1's).
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }
timeout 300 python3 benchmarks/zoo.py --out "$OUT/z" --models gem,dlrm,mmoe,wukong,dlrm_dcnv2 \
  --variants gemc --steps 30 --warmup 3 --cold --time-limit 235 --child-timeout 110 \
  > "$OUT/z.log" 2>&1
echo "== 1. zoo (exit $?)"
quiet < "$OUT/z.log" | grep -E "first step|gemc  |^== |rror" | cut -c1-420
echo "== 2. narrow shards"
timeout 60 python3 benchmarks/kernels.py --cases narrow --out "$OUT/narrow.json" 2>&1 | quiet | tail -24
echo "== 3. fp8"
timeout 55 python3 benchmarks/precision.py --gemms --tokens 8192,32768 --features 4096 \
  --warmup 2 --iters 10 --out "$OUT/fp8_gemms.json" 2>&1 | quiet | tail -12
timeout 130 python3 benchmarks/zoo.py --out "$OUT/f8" --models wukong --variants gemc-fp8 \
  --steps 10 --warmup 3 --time-limit 60 --child-timeout 110 > "$OUT/f8.log" 2>&1
echo "(wukong gemc-fp8 exit $?)"
quiet < "$OUT/f8.log" | grep -E "gemc|first step|skipped|rror" | cut -c1-300 | tail -8
cd "$OUT" && tar czf rows.tar.gz z f8 2>/dev/null && rm -rf z f8
