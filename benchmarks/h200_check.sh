#!/usr/bin/env bash
# One device call: fused groups (fusion.py, both GEMM paths measured and the faster kept),
# then end-to-end GEM training; extra arguments go to e2e.py (e.g. --variants gemc).
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 140 python3 benchmarks/fusion.py --out "$OUT/fusion.json" > "$OUT/fusion.log" 2>&1
grep -vE "^\.\.\.|Warning|detach|err = " "$OUT/fusion.log" | tail -45 | cut -c1-175
timeout 300 python3 benchmarks/e2e.py --steps 20 --warmup 5 --profile 3 --out "$OUT/e2e.json" \
  "$@" > "$OUT/e2e.log" 2>&1
grep -vE "Warning|warn" "$OUT/e2e.log" | tail -14
for f in "$OUT"/e2e.json.*.kernels.txt; do echo "== $f"; head -30 "$f" | cut -c1-150; done
