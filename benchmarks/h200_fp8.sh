#!/usr/bin/env bash
# One device call: the fp8 quantisation kernels and ops tested on the GPU (the in-register
# fp8 cast, _scaled_mm against the dequantise-then-matmul references), then the per-shape
# GEMM benchmark (precision.py --gemms).
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
GEMC_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_fp8_quant.py tests/precision/test_fp8_ops.py tests/precision/test_fp8.py \
    2>&1 | tail -25 | tee "$OUT/fp8_tests.log"
timeout 300 python3 benchmarks/precision.py --gemms --out "$OUT/fp8_gemms.json" 2>&1 \
    | tee "$OUT/fp8_gemms.log"
