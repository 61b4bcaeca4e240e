#!/usr/bin/env bash
# The eleventh session's third device call (< 9.5 min on one H200):
#   1. issue 18: where MMoE's and BST's peak memory goes (benchmarks/memory_attribution.py:
#      the live blocks at each step's peak, by owner and by the generated line that made
#      them, next to the plan's predicted breakdown);
#   2. issue 17: the zoo's attentions against padded masked SDPA at their h200 shapes, with
#      the silu kernel's fast sigmoid on (no torch.compile variants);
#   3. issue 16: dlrm, mmoe and hstu, gemc alone, cold, 30 steps (the first step's phases;
#      torch.compile's rows are this session's first call's, same machine type).
#   bash benchmarks/h200_session11c.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }
echo "== 1. memory attribution"
mkdir -p "$OUT/mem"
for m in mmoe sasrec_bst; do
  GEMC_COMPILE_CACHE=/tmp/gemc-cache-mem timeout 90 python3 benchmarks/memory_attribution.py \
    --model $m --steps 3 --out "$OUT/mem" > "$OUT/mem/$m.log" 2>&1
  rc=$?; echo "== $m exit $rc"
  if [ $rc = 0 ]; then quiet < "$OUT/mem/$m.log" | sed -n '/^== /,$p' | cut -c1-200 | head -45
  else tail -15 "$OUT/mem/$m.log"; fi
done
echo "== 2. zoo attentions"
timeout 150 python3 benchmarks/kernels.py --cases zoo --no-compile --seed 17 \
  --out "$OUT/kernels_zoo.json" 2>&1 | quiet | grep -E "zoo|target|x vs" | cut -c1-200 | tail -25
echo "== 3. zoo gemc cold"
timeout 270 python3 benchmarks/zoo.py --out "$OUT/z3" --models dlrm,mmoe,hstu \
  --variants gemc --steps 30 --warmup 3 --cold --time-limit 260 --child-timeout 100 \
  > "$OUT/z3.log" 2>&1
echo "(exit $?)"
quiet < "$OUT/z3.log" | grep -E "first step|gemc  |^== |rror" | cut -c1-420
cd "$OUT" && tar czf rows_c.tar.gz z3 mem 2>/dev/null && rm -rf z3 mem
