#!/usr/bin/env bash
# One device call (the device tool allows 10 minutes a command and returns at most 8
# files): benchmarks/zoo.py on the H200 within --time-limit (default here 420 s: models
# left over are listed as skipped, run them in a second call with --models), then the
# table and summary on stdout, zoo.json and zoo.log under $OUT and everything else (plans,
# per-variant rows) packed into $OUT/extras.tar.gz. Extra arguments go to zoo.py, e.g.
#   bash benchmarks/zoo_h200.sh --models gem,dlrm --variants eager,compile,gemc,gemc-measured
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 570 python3 benchmarks/zoo.py --out "$OUT" --time-limit 420 --child-timeout 300 "$@" \
  > "$OUT/zoo.log" 2>&1
echo "zoo.py exit code $?"
grep -vE "Warning|warn|warnings.warn|^zoo: .* in a child process" "$OUT/zoo.log" | tail -60
tar czf /tmp/extras.tar.gz -C "$OUT" --exclude='zoo.json' --exclude='zoo.log' . \
  && find "$OUT" -type f ! -name 'zoo.json' ! -name 'zoo.log' -delete \
  && mv /tmp/extras.tar.gz "$OUT/"
