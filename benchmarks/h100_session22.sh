#!/usr/bin/env bash
# Twenty-second session's device calls, one part per call (each under ten minutes):
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session22.sh 1   # GPU tests of the new code; Wukong
#                                                           # gemc vs gemc-fp8, profiled (issue 21)
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session22.sh 2   # fp8 vs bf16 loss, 500 steps (issue 21)
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session22.sh 3   # the zoo's attentions (issue 17)
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
t0=$SECONDS
part=${1:-1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$part" = 1 ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/fusion/test_row_reader_forms.py \
    tests/fusion/test_recbole_causal_mask.py tests/runner/test_fp8_audit.py 2>&1 | tail -5 \
    | tee "$OUT/tests.log"
  echo "== tests ($((SECONDS - t0)) s)"
  timeout 300 python3 benchmarks/zoo.py --out "$OUT/wk" --models wukong --variants gemc,gemc-fp8 \
    --steps 20 --warmup 3 --profile 2 --time-limit 140 --child-timeout 160 > "$OUT/wk.log" 2>&1
  echo "== wukong gemc / gemc-fp8 profiled (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/wk.log" | grep -E "^== |^ +(variant|gemc)|rror" | cut -c1-300
  cd "$OUT" && tar czf wk.tar.gz wk && rm -rf wk
elif [ "$part" = 2 ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 --tb=short \
    tests/fusion/test_row_reader_forms.py > "$OUT/reader_forms.log" 2>&1
  echo "== reader forms on the GPU (exit $?, $((SECONDS - t0)) s)"; tail -3 "$OUT/reader_forms.log"
  timeout 560 python3 benchmarks/fp8_loss.py --model wukong --steps 500 \
    --variants bf16,fp8 --graph --device cuda --every 50 \
    --out "$OUT/fp8_loss_wukong_gpu.json" > "$OUT/fp8_loss.log" 2>&1
  echo "== fp8 loss, 500 steps (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/fp8_loss.log" | tail -40 | cut -c1-300
elif [ "$part" = 3 ]; then
  timeout 500 python3 benchmarks/kernels.py --cases zoo --no-compile \
    --out "$OUT/kernels_zoo.json" > "$OUT/kernels_zoo.log" 2>&1
  echo "== the zoo's attentions (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kernels_zoo.log" | tail -30 | cut -c1-300
fi
