#!/usr/bin/env bash
# One device call: the kernel tests compiled for the GPU, then the kernel benchmark.
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
GEMC_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels 2>&1 | tail -25 | tee "$OUT/kernel_tests.log"
timeout 360 python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
