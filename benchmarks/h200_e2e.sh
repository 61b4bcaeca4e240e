#!/usr/bin/env bash
# One device call: end-to-end GEM training (eager, torch.compile, gemc) with a per-kernel
# profile of 3 steps of each variant. Extra arguments go to e2e.py (e.g. --variants ...).
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 500 python3 benchmarks/e2e.py --steps 20 --warmup 5 --profile 3 --out "$OUT/e2e.json" \
  "$@" > "$OUT/e2e.log" 2>&1
grep -vE "Warning|warn" "$OUT/e2e.log" | tail -22
for f in "$OUT"/e2e.json.*.kernels.txt; do echo "== $f"; head -22 "$f" | cut -c1-150; done
