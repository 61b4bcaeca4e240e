#!/usr/bin/env bash
# One device call: where does gemc's training step differ from eager's on the H200?
# 1. benchmarks/grad_parity.py on the GEM example's h200 preset, bf16 autocast and fp32:
#    the attention kernels against SDPA, then every parameter's gradient / table update;
# 2. `gemc run` 5 steps with every kernel and with --skip-kernels of the kinds in $SKIPS
#    (default key_padding_attention), to see which kind moves the loss curve.
# Usage (device tool): bash benchmarks/h200_parity.sh [MODEL_ENTRY] [PRESET]
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
entry=${1:-examples/gem/model.py:build}
preset=${2:-h200}
skips=${SKIPS:-key_padding_attention}
for ac in bf16 none; do
  timeout 240 python3 benchmarks/grad_parity.py "$entry" --set preset="$preset" --device cuda \
    --autocast $ac --out "$OUT/grad_$ac.json" 2>"$OUT/grad_$ac.err" | tee "$OUT/grad_$ac.txt"
  echo "grad_parity ($ac) exit $?"; grep -v -i warn "$OUT/grad_$ac.err" | tail -5
done
timeout 60 python3 -c "import sys; from gemc.cli import main; sys.exit(main())" compile "$entry" --set preset="$preset" --topology h200:1x1 --planner default \
  --out "$OUT/plan.json" --quiet 2>&1 | tail -2
for skip in none $skips; do
  extra=(); [ "$skip" != none ] && extra=(--skip-kernels "$skip")
  timeout 200 python3 -c "import sys; from gemc.cli import main; sys.exit(main())" run "$OUT/plan.json" --steps 5 --quiet --report "$OUT/run_$skip.json" \
    "${extra[@]}" 2>&1 | grep -v -i warn | tail -2
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], [round(x['loss'], 5) for x in r['losses']], 'ms', round(r['step_ms'] or 0, 2))" "$OUT/run_$skip.json" "$skip"
done
