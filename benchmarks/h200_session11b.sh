#!/usr/bin/env bash
# The eleventh session's second device call (< 8 min on one H200):
#   1. issue 17: HSTU's silu attention speed variants at its h200 shape against padded
#      masked SDPA (benchmarks/h200_silu_variants.sh: each variant checked in fp32 first);
#   2. issue 21: the fp8 quantisation kernels' tests on the GPU after the two fixes
#      (the scale's exponent from frexp(amax), the sign bit of a rounded zero);
#   3. issue 21: the compiled LayerNorm -> Linear under torch.profiler at M = 8,192, where
#      the Triton-quantised fp8 unit ran 3.80 ms against ~1.3 ms of pieces: host- or GPU-bound?
#   bash benchmarks/h200_session11b.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
echo "== 1. silu variants"
OUT="$OUT" timeout 300 bash benchmarks/h200_silu_variants.sh
echo "== 2. fp8 quantisation kernels on the GPU"
GEMC_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_fp8_quant.py tests/precision/test_fp8_compiled.py \
  -k "test_fp8_quant or triton_quantizer" > "$OUT/fp8_kernel_tests.log" 2>&1
echo "(exit $?) $(tail -1 "$OUT/fp8_kernel_tests.log")"
grep -E "^(FAILED|E ) " "$OUT/fp8_kernel_tests.log" | head -6
echo "== 3. fp8 unit profile, M=8192"
timeout 150 python3 benchmarks/fp8_unit_profile.py --tokens 8192 \
  --out "$OUT/fp8_unit_profile.json" 2>&1 | grep -vE "Warning|warnings.warn|USDT|^ *$" | tail -45
