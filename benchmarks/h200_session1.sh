#!/usr/bin/env bash
# One device call: calibrate the H200, then the cost-model accuracy benchmark with that
# calibration. Results land in $OUT (calibration file, JSON, logs).
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m gemc.cost_model.calibrate --out "$OUT/h200.json" 2>&1 | tee "$OUT/calibrate.log"
cal="$OUT/h200.json"; [ -f "$cal" ] || cal=none
timeout 300 python3 benchmarks/cost_model_accuracy.py --mode eager --calibration "$cal" --out "$OUT/accuracy.json" 2>&1 | tee "$OUT/accuracy.log"
