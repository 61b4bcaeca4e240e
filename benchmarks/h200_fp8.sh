#!/usr/bin/env bash
# One device call (< 6 min): the fp8 linear's tests on the GPU (the compiled path against
# its emulation, Inductor's LayerNorm+quantisation kernel, _scaled_mm's contract), then the
# per-shape benchmark of compiled bf16 vs row-wise fp8 (precision.py --gemms, ~3 min).
# The zoo A/B with fp8 forced on the big linears is a second call:
#   bash benchmarks/zoo_h200.sh --models wukong,gem,dlrm_dcnv2 --variants gemc,gemc-fp8
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
GEMC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/precision/test_fp8.py tests/precision/test_fp8_compiled.py \
    2>&1 | tail -25 | tee "$OUT/fp8_tests.log"
timeout 400 python3 benchmarks/precision.py --gemms --out "$OUT/fp8_gemms.json" 2>&1 \
    | grep -vE "Warning|warnings.warn" | tee "$OUT/fp8_gemms.log"
