#!/usr/bin/env bash
# One device call on a machine with several H200s (issue 9): calibrate (collectives
# included), compare the collectives with the cost model, then run the carried plans.
# Before the call, on the CPU box (ortools):
#   python benchmarks/multi_gpu.py prepare --gpus N --out-dir mg_plans
# and pass carry=["mg_plans"] (the directory is git-ignored). Usage on the device:
#   bash benchmarks/h200_multi.sh mg_plans [steps]
set -uo pipefail
PLANS=${1:?usage: h200_multi.sh PLANS_DIR [STEPS]}
STEPS=${2:-50}
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
N=$(nvidia-smi -L | wc -l)
echo "GPUs: $N"
timeout 150 python3 -m gemc.cli calibrate --quick --out "$OUT/calibration_h200x$N.json" \
  > "$OUT/calibrate.log" 2>&1; tail -5 "$OUT/calibrate.log"
python3 benchmarks/multi_gpu.py collectives --calibration "$OUT/calibration_h200x$N.json" \
  --out "$OUT/collectives.json" | tail -40
timeout 400 python3 benchmarks/multi_gpu.py run --plans "$PLANS" --steps "$STEPS" --timeout-s 130 \
  --device cuda --out "$OUT/multi_gpu.json" 2>&1 | grep -v Warning | tail -20
cp "$PLANS"/*.run.json "$OUT/" 2>/dev/null || true
