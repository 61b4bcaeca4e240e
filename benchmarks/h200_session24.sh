#!/usr/bin/env bash
# Twenty-fourth session's device calls (issue 17 on an H200), one part a call, each < 10 min:
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 1   # the attention kernel tests on
#       # the GPU (eager SDPA's empty rows on torch 2.11 among them); the figure for
#       # every zoo attention, TransAct's included (kernels.py --cases zoo); kernels or host
#       # (attention_gpu_time.py)
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 2   # the fill sweep: masked_tower at
#       # 25 / 50 / 75 / 100% fill, torch.compile and gemc (is the packed tower's time
#       # proportional to its real tokens?)
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 3   # one call for both, when device
#       # starts are scarce: the varlen / SDPA kernel tests; the zoo's attentions; gemc's
#       # masked_tower at 25 / 50 / 100% fill; attention_gpu_time.py in what time is left
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 4   # the zoo's attentions alone
#       # (< 4 min: what a short end of the session's device time allows)
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 5   # twenty-fifth session: the kernel
#       # tests; replica groups ahead of graph mode's graph vs inside it (replica_step.py);
#       # DIN packed over padding representatives, torch.compile and gemc (zoo.py)
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 6   # part 5 without DIN (< 3 min)
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 7   # twenty-sixth session: the kernel
#       # tests with 150 s (60 s cut them short on an H100); the replica groups' graph step
#       # (capture on the batch's device); masked_tower at 25 and 100% fill with torch.compile
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 8   # TransAct packed over padding
#       # representatives, torch.compile and gemc (zoo.py; < 5 min)
#   GEMC_COMMIT=<sha> bash benchmarks/h200_session24.sh 9   # MMoE after the priced attention
#       # choice kept its target attention SDPA, torch.compile and gemc (zoo.py; < 6 min)
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}

zoo_attentions() {  # the figure for every zoo attention (kernels.py --cases zoo)
  timeout "$1" python3 benchmarks/kernels.py --cases zoo --no-compile \
    --out "$OUT/kernels_zoo.json" > "$OUT/kernels_zoo.log" 2>&1
  echo "== the zoo's attentions (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kernels_zoo.log" | grep -E "fwd\+bwd|^zoo|guard" | cut -c1-200
}

gpu_time() {  # each zoo attention: kernel time or host time (attention_gpu_time.py)
  timeout "$1" python3 benchmarks/attention_gpu_time.py --out "$OUT/attention_gpu_time.json" \
    > "$OUT/attention_gpu_time.log" 2>&1
  echo "== attention: kernels or host (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/attention_gpu_time.log" | cut -c1-400 | tail -40
}

fill_sweep() {  # masked_tower: variants $1, $2 steps ($5 warm-up), fills $3 (%), $4 s each
  export GEMC_ZOO_EXTRA=masked_tower=benchmarks/masked_tower.py:build
  for fill in $3; do
    preset=h200-fill$fill; [ "$fill" = 50 ] && preset=h200
    timeout "$4" python3 benchmarks/zoo.py --out /tmp/fill$fill --models masked_tower \
      --variants "$1" --preset "$preset" --steps "$2" --warmup "$5" > /tmp/fill$fill.log 2>&1
    echo "== masked_tower ($1) at $fill% fill (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/fill$fill/zoo.json "$OUT/fill$fill.json" 2>/dev/null
    grep -vE "Warning|warn" /tmp/fill$fill.log | grep -E "masked_tower|compile|gemc|step" | tail -8 | cut -c1-250
    cat /tmp/fill$fill.log >> "$OUT/fill.log"
  done
}

kernel_tests() {  # the attention kernels on the GPU; eager SDPA's empty rows on torch 2.11
  GEMC_TEST_DEVICE=cuda timeout "$1" python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_sdpa_empty_rows.py tests/kernels/test_attention_bias_and_varlen_keys.py \
    ${@:2} > "$OUT/tests.log" 2>&1
  echo "== attention kernel tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|Error" "$OUT/tests.log" | tail -6
}

if [ "$part" = 1 ]; then
  kernel_tests 120 tests/kernels/test_uncovered_rows.py tests/kernels/test_silu_key_block_backward.py
  zoo_attentions 240
  gpu_time 150
elif [ "$part" = 2 ]; then
  fill_sweep compile,gemc 10 "25 50 75 100" 140 3
elif [ "$part" = 3 ]; then
  kernel_tests 60
  zoo_attentions 220
  fill_sweep gemc 8 "25 50 100" 100 2
  left=$((500 - SECONDS + t0))
  [ "$left" -gt 60 ] && gpu_time "$left"
elif [ "$part" = 5 ] || [ "$part" = 6 ] || [ "$part" = 7 ]; then
  if [ "$part" = 7 ]; then kernel_tests 150; else kernel_tests 60; fi
  for ahead in 1 0; do
    timeout 60 python3 benchmarks/replica_step.py --device cuda --compare --graph \
      --graph-ahead $ahead --out "$OUT/replica_step_graph_ahead$ahead.json" \
      > "$OUT/replica_step_ahead$ahead.log" 2>&1
    echo "== replica groups, graph mode, ahead=$ahead (exit $?, $((SECONDS - t0)) s)"
    grep -vE "Warning|warn" "$OUT/replica_step_ahead$ahead.log" | tail -6 | cut -c1-250
  done
  [ "$part" = 6 ] && { echo "== done ($((SECONDS - t0)) s)"; exit 0; }
  if [ "$part" = 7 ]; then
    fill_sweep compile,gemc 8 "25 100" 130 2
    [ -f "$OUT/tests.log" ] && { echo "== kernel tests:"; grep -E "passed|failed|FAILED" "$OUT/tests.log" | tail -8; }
    echo "== done ($((SECONDS - t0)) s)"; exit 0
  fi
  timeout 250 python3 benchmarks/zoo.py --out /tmp/din --models din --variants compile,gemc \
    --steps 10 --warmup 3 > "$OUT/din.log" 2>&1
  echo "== din, torch.compile and gemc (exit $?, $((SECONDS - t0)) s)"
  cp /tmp/din/zoo.json "$OUT/din.json" 2>/dev/null
  grep -vE "Warning|warn" "$OUT/din.log" | grep -E "din|compile|gemc|guard|step" | tail -12 | cut -c1-250
elif [ "$part" = 8 ] || [ "$part" = 9 ]; then
  model=transact; [ "$part" = 9 ] && model=mmoe
  timeout 400 python3 benchmarks/zoo.py --out /tmp/$model --models $model \
    --variants compile,gemc --steps 10 --warmup 3 > "$OUT/$model.log" 2>&1
  echo "== $model, torch.compile and gemc (exit $?, $((SECONDS - t0)) s)"
  cp /tmp/$model/zoo.json "$OUT/$model.json" 2>/dev/null
  grep -vE "Warning|warn" "$OUT/$model.log" | grep -E "$model|compile|gemc|guard|step" | tail -12 | cut -c1-250
elif [ "$part" = 4 ]; then
  zoo_attentions 220
fi
# the output's tail is what comes back for sure: the tests' verdict again, last
[ -f "$OUT/tests.log" ] && { echo "== kernel tests:"; grep -E "passed|failed" "$OUT/tests.log" | tail -2; }
echo "== done ($((SECONDS - t0)) s)"
