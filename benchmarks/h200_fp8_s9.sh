#!/usr/bin/env bash
# One device call (< 4 min), issue 21 on torch 2.11: the fp8 linear as custom ops
# (gemc::fp8_linear) compiled by Inductor.
#   source scripts/device_env.sh && bash benchmarks/h200_fp8_s9.sh
# 1. precision.py --gemms at K = N = 4096, M in {8192, 32768} (session 7's failing command
#    cut to its largest features: 2 compiles, not 8, to fit the call): compiled bf16 vs
#    row-wise fp8, LayerNorm -> Linear fwd+bwd, a row per shape with both times, fp8's
#    speedup and its SQNR against fp32 (y, dW ~28-31 dB; < 25 dB is a bug).
# 2. Wukong (h200 preset) gemc (bf16) vs gemc-fp8 (row-wise fp8 forced on every linear with
#    in and out features >= 1024), 10 timed steps each after 3: step ms, first-step seconds
#    (compile included) and the losses side by side.
set -uo pipefail
OUT="${OUT:-/tmp/h200_fp8_s9}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$"; }

echo "== 1. compiled fp8 GEMMs"
timeout 60 python3 benchmarks/precision.py --gemms --tokens 8192,32768 --features 4096 \
  --warmup 2 --iters 10 --out "$OUT/fp8_gemms.json" 2>&1 | quiet | tail -12
echo "(exit ${PIPESTATUS[0]})"

echo "== 2. wukong gemc vs gemc-fp8"
timeout 180 python3 benchmarks/zoo.py --out "$OUT/wk" --models wukong --variants gemc,gemc-fp8 \
  --steps 10 --warmup 3 --time-limit 150 --child-timeout 85 > "$OUT/wk.log" 2>&1
echo "(exit $?)"
quiet < "$OUT/wk.log" | grep -E "gemc|first step|loss|skipped|fail" | tail -10
