#!/usr/bin/env bash
# One device call: confirm the cost-model accuracy, then the precision tests on the GPU
# and the 200-step precision benchmark.
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 235 python3 benchmarks/cost_model_accuracy.py --mode eager --gpu h200 --calibration cost_model/data/h200.json --steps 6 --warmup 2 --out "$OUT/accuracy.json" 2>&1 | grep -v Warn > "$OUT/accuracy.log"
tail -12 "$OUT/accuracy.log"
GEMC_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider tests/precision 2>&1 | tail -3
timeout 250 python3 benchmarks/precision.py --out "$OUT/precision.json" 2>&1 | tee "$OUT/precision.log" | tail -15
