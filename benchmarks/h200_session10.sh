#!/usr/bin/env bash
# The tenth session's device call (< 9.5 min on one H200), each step under its own timeout:
#   1. MMoE and DLRM, torch.compile and gemc, cold, 30 steps, side by side on one machine
#      (issue 16's first step <= 1.5x torch.compile's: MMoE's sparse-table lookup now
#      compiles inside the graph as gemc::table_lookup, and its BERT-style empty-history
#      row no longer forces the padded attention; DLRM re-measured on the same machine);
#   2. issue 21's fp8 breakdown (benchmarks/h200_fp8_s10.sh: the quantisation kernels on
#      the GPU, then every piece of the compiled row-wise fp8 linear timed alone).
#   bash benchmarks/h200_session10.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }
timeout 330 python3 benchmarks/zoo.py --out "$OUT/z" --models mmoe,dlrm \
  --variants compile,gemc --steps 30 --warmup 3 --cold --time-limit 300 --child-timeout 140 \
  > "$OUT/z.log" 2>&1
echo "== 1. zoo (exit $?)"
quiet < "$OUT/z.log" | grep -E "first step|gemc  |compile  |^== |rror|graph_break" | cut -c1-420
OUT="$OUT/fp8" timeout 220 bash benchmarks/h200_fp8_s10.sh
cd "$OUT" && tar czf rows.tar.gz z fp8 2>/dev/null && rm -rf z fp8
