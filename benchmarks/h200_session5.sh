#!/usr/bin/env bash
# One device call: fused-group benchmark, then end-to-end GEM training (eager, compile, gemc).
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 110 python3 benchmarks/fusion.py --out "$OUT/fusion.json" > "$OUT/fusion.log" 2>&1
grep -vE "^\[|Warning" "$OUT/fusion.log" | tail -22
timeout 190 python3 benchmarks/e2e.py --steps 20 --warmup 4 --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
grep -vE "Warning" "$OUT/e2e.log" | tail -25
