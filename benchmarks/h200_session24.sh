#!/usr/bin/env bash
# Twenty-fourth session's device calls (issue 17 on an H200), one part a call, each < 10 min:
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 1   # the attention kernel tests on
#       # the GPU; the figure for every zoo attention, TransAct's included
#       # (kernels.py --cases zoo); kernels or host (attention_gpu_time.py)
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 2   # the fill sweep: masked_tower at
#       # 25 / 50 / 75 / 100% fill, torch.compile and gemc (is the packed tower's time
#       # proportional to its real tokens?)
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 3   # one call for both, when device
#       # starts are scarce: the zoo's attentions; gemc's masked_tower at 25 / 50 / 100% fill;
#       # attention_gpu_time.py in what time is left
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 4   # the zoo's attentions alone
#       # (< 4 min: what a short end of the session's device time allows)
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
t0=$SECONDS
part=${1:-1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import numpy, triton, torch; print('numpy', numpy.__version__, 'triton', triton.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/gpu.txt"
if [ "$part" = 1 ]; then
  GEMC_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 \
    tests/kernels/test_uncovered_rows.py tests/kernels/test_attention_bias_and_varlen_keys.py \
    tests/kernels/test_silu_key_block_backward.py > "$OUT/tests.log" 2>&1
  echo "== attention kernel tests on the GPU (exit $?, $((SECONDS - t0)) s)"; tail -3 "$OUT/tests.log"
  timeout 240 python3 benchmarks/kernels.py --cases zoo --no-compile \
    --out "$OUT/kernels_zoo.json" > "$OUT/kernels_zoo.log" 2>&1
  echo "== the zoo's attentions (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kernels_zoo.log" | grep -E "fwd\+bwd|^zoo|guard" | cut -c1-200
  timeout 150 python3 benchmarks/attention_gpu_time.py --out "$OUT/attention_gpu_time.json" \
    > "$OUT/attention_gpu_time.log" 2>&1
  echo "== attention: kernels or host (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/attention_gpu_time.log" | cut -c1-400 | tail -40
elif [ "$part" = 2 ]; then
  export GEMC_ZOO_EXTRA=masked_tower=benchmarks/masked_tower.py:build
  for fill in 25 50 75 100; do
    preset=h200-fill$fill; [ "$fill" = 50 ] && preset=h200
    timeout 140 python3 benchmarks/zoo.py --out /tmp/fill$fill --models masked_tower \
      --variants compile,gemc --preset "$preset" --steps 10 --warmup 3 > /tmp/fill$fill.log 2>&1
    echo "== masked_tower at $fill% fill (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/fill$fill/zoo.json "$OUT/fill$fill.json" 2>/dev/null
    grep -vE "Warning|warn" /tmp/fill$fill.log | grep -E "masked_tower|compile|gemc|step" | tail -8 | cut -c1-250
    cat /tmp/fill$fill.log >> "$OUT/fill.log"
  done
elif [ "$part" = 4 ]; then
  timeout 220 python3 benchmarks/kernels.py --cases zoo --no-compile \
    --out "$OUT/kernels_zoo.json" > "$OUT/kernels_zoo.log" 2>&1
  echo "== the zoo's attentions (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kernels_zoo.log" | grep -E "fwd\+bwd|^zoo|guard" | cut -c1-200
elif [ "$part" = 3 ]; then
  timeout 240 python3 benchmarks/kernels.py --cases zoo --no-compile \
    --out "$OUT/kernels_zoo.json" > "$OUT/kernels_zoo.log" 2>&1
  echo "== the zoo's attentions (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kernels_zoo.log" | grep -E "fwd\+bwd|^zoo|guard" | cut -c1-200
  export GEMC_ZOO_EXTRA=masked_tower=benchmarks/masked_tower.py:build
  for fill in 25 50 100; do
    preset=h200-fill$fill; [ "$fill" = 50 ] && preset=h200
    timeout 100 python3 benchmarks/zoo.py --out /tmp/fill$fill --models masked_tower \
      --variants gemc --preset "$preset" --steps 8 --warmup 2 > /tmp/fill$fill.log 2>&1
    echo "== gemc's masked_tower at $fill% fill (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/fill$fill/zoo.json "$OUT/fill$fill.json" 2>/dev/null
    grep -vE "Warning|warn" /tmp/fill$fill.log | grep -E "masked_tower|gemc|step" | tail -6 | cut -c1-250
  done
  left=$((500 - SECONDS + t0))
  if [ "$left" -gt 60 ]; then
    timeout "$left" python3 benchmarks/attention_gpu_time.py --out "$OUT/attention_gpu_time.json" \
      > "$OUT/attention_gpu_time.log" 2>&1
    echo "== attention: kernels or host (exit $?, $((SECONDS - t0)) s)"
    grep -vE "Warning|warn" "$OUT/attention_gpu_time.log" | cut -c1-300 | tail -30
  fi
fi
echo "== done ($((SECONDS - t0)) s)"
