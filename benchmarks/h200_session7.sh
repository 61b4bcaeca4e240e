#!/usr/bin/env bash
# The seventh session's one device call (< 9.5 min on one H200), most valuable first, each
# step under its own timeout so a slow one cannot starve the rest:
#   1. gemc on hstu and din with per-kernel / GPU-idle profiles: the sync-free sparse
#      optimizer, HSTU's SiLU attention on packed tokens, the gather_rows backward;
#   2. the cold first step of dlrm and gem (gemc; torch.compile's measured earlier the same
#      day at e29c0be) with the compile accounting;
#   3. HSTU's two relative-bias gathers: gemc::gather_rows vs index_select, eager/compiled;
#   4. compiled row-wise fp8 vs bf16 on LayerNorm -> Linear (4 shapes) and Wukong trained
#      with fp8 forced on its big linears;
#   5. the zoo models' attention vs padded SDPA at their h200 shapes.
# Everything lands under $OUT: logs, JSON and one tar of the per-variant rows and profiles.
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }

timeout 150 python3 benchmarks/zoo.py --out "$OUT/hd" --models hstu,din --variants gemc \
  --steps 15 --warmup 3 --profile 2 --time-limit 120 --child-timeout 110 > "$OUT/hd.log" 2>&1
echo "== 1. hstu, din (exit $?)"; quiet < "$OUT/hd.log" | tail -14

timeout 150 python3 benchmarks/zoo.py --out "$OUT/fs" --models dlrm,gem --variants gemc \
  --steps 4 --warmup 1 --cold --time-limit 100 --child-timeout 110 > "$OUT/fs.log" 2>&1
echo "== 2. first step (exit $?)"; quiet < "$OUT/fs.log" | grep -E "first step|gemc  " | tail -8

echo "== 3. gathers"
timeout 45 python3 benchmarks/scatter_add_contention.py --hstu --no-grid --iters 10 \
  --out "$OUT/gathers.json" 2>&1 | quiet | tail -8

echo "== 4. fp8"
timeout 80 python3 benchmarks/precision.py --gemms --tokens 8192,32768 --features 2048,4096 \
  --iters 10 --out "$OUT/fp8_gemms.json" 2>&1 | quiet | tail -12
timeout 75 python3 benchmarks/zoo.py --out "$OUT/f8" --models wukong --variants gemc-fp8 \
  --steps 15 --warmup 3 --time-limit 60 --child-timeout 65 > "$OUT/f8.log" 2>&1
quiet < "$OUT/f8.log" | grep -E "gemc|first step" | tail -4

echo "== 5. attention vs padded SDPA"
timeout 70 python3 benchmarks/kernels.py --cases zoo --out "$OUT/kernels_zoo.json" 2>&1 \
  | quiet | tail -16

cd "$OUT" && tar czf rows.tar.gz hd fs f8 2>/dev/null && rm -rf hd fs f8
