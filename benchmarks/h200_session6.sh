#!/usr/bin/env bash
# One device call: fused-group benchmark, then end-to-end GEM training (eager, compile, gemc,
# gemc without its kernels) with a per-kernel profile of 3 steps of each variant.
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 python3 benchmarks/fusion.py --out "$OUT/fusion.json" > "$OUT/fusion.log" 2>&1
grep -vE "^\[|Warning" "$OUT/fusion.log" | tail -22
timeout 400 python3 benchmarks/e2e.py --steps 20 --warmup 5 --profile 3 \
  --variants eager,compile,gemc,gemc-nokernels --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
grep -vE "Warning" "$OUT/e2e.log" | tail -25
for f in "$OUT"/e2e.json.*.kernels.txt; do echo "== $f"; head -14 "$f"; done
