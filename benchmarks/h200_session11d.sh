#!/usr/bin/env bash
# The eleventh session's fourth device call (< 9 min on one H200):
#   1. issue 21: the fp8 tests on the GPU with the quantisation as triton_ops (Inductor
#      launches them) and the backward's native _scaled_mm; the unit profile at M = 8,192
#      (host against kernel time, unprofiled too; y, dx, dW bit-equal to the ATen path);
#   2. issue 18: where MMoE's and BST's peak memory goes (benchmarks/memory_attribution.py);
#   3. issue 17: the zoo's attentions against padded masked SDPA, fast sigmoid on.
#   bash benchmarks/h200_session11d.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|USDT|_warn_once"; }
echo "== 1. fp8 tests on the GPU"
for t in tests/kernels/test_fp8_quant.py tests/precision/test_fp8_compiled.py; do
  GEMC_TEST_DEVICE=cuda timeout 80 python3 -m pytest -q -p no:cacheprovider -x "$t" 2>&1 | tail -3
done
timeout 110 python3 benchmarks/fp8_unit_profile.py --tokens 8192 \
  --out "$OUT/fp8_unit_profile.json" 2>&1 | quiet | cut -c1-200 | tail -30
echo "== 2. memory attribution"
mkdir -p "$OUT/mem"
for m in mmoe sasrec_bst; do
  GEMC_COMPILE_CACHE=/tmp/gemc-cache-mem timeout 95 python3 benchmarks/memory_attribution.py \
    --model $m --steps 3 --out "$OUT/mem" > "$OUT/mem/$m.log" 2>&1
  rc=$?; echo "== $m exit $rc"
  if [ $rc = 0 ]; then quiet < "$OUT/mem/$m.log" | sed -n '/^== /,$p' | cut -c1-200 | head -40
  else tail -12 "$OUT/mem/$m.log"; fi
done
echo "== 3. zoo attentions"
timeout 110 python3 benchmarks/kernels.py --cases zoo --no-compile --seed 17 \
  --out "$OUT/kernels_zoo.json" 2>&1 | quiet | grep -E "zoo|target|x vs" | cut -c1-200 | tail -25
