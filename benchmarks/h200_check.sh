#!/usr/bin/env bash
# One device call (~7.5 min on the H200): end-to-end GEM training (eager, torch.compile,
# gemc, each in its own process; ~290 s, gemc's first step autotunes for ~150 s) and the
# fused groups against torch.compile with the host profile of gemc's calls (fusion.py,
# ~130 s). Results under $OUT; extra arguments go to e2e.py (e.g. --variants gemc). The
# launch-shape sweep (bwd_sweep.py) is left out: its small calls are bound by the host
# (BENCHMARKS.md, 2026-12-03), run it alone when that changes.
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 360 python3 benchmarks/e2e.py --steps 20 --warmup 5 --profile 1 --out "$OUT/e2e.json" \
  "$@" > "$OUT/e2e.log" 2>&1
grep -vE "Warning|warn" "$OUT/e2e.log" | tail -12
timeout 150 python3 benchmarks/fusion.py --profile-host 50 --out "$OUT/fusion.json" \
  > "$OUT/fusion.log" 2>&1
grep -E "^target|do_bench" "$OUT/fusion.log" | cut -c1-175
# The device tool returns at most 8 files: keep the JSON reports, pack the rest (the
# archive is written outside $OUT first: tar refuses a folder that changes as it reads it).
tar czf /tmp/extras.tar.gz -C "$OUT" --exclude='*.json' . \
  && find "$OUT" -type f ! -name '*.json' -delete && mv /tmp/extras.tar.gz "$OUT/"
