#!/usr/bin/env bash
# One device call: re-calibrate (new sections), per-category breakdown of the eager step
# (measured vs predicted), and the jagged-attention kernel benchmark.
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 120 python3 -m gemc.cost_model.calibrate --out "$OUT/h200.json" 2>&1 | tee "$OUT/calibrate.log" | tail -3
cal="$OUT/h200.json"; [ -f "$cal" ] || cal=cost_model/data/h200.json
timeout 150 python3 benchmarks/cost_model_breakdown.py --calibration "$cal" \
  --configs dlrm/h200/b16384/bf16,dlrm/h200/b16384/fp32,gem/h200/b1024/bf16,gem/h200/b1024/fp32 \
  --out "$OUT/breakdown.json" 2>&1 | grep -v '^USDT' > "$OUT/breakdown.log"
timeout 200 python3 benchmarks/kernels.py --cases attention,silu --out "$OUT/attention.json" 2>&1 | grep -v "^\[" | tail -30
