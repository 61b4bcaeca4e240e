#!/usr/bin/env bash
# Twenty-third session's device calls, one part per call (each under ten minutes):
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session23.sh 1   # the zoo's attentions: kernels or
#                                                           # host (attention_gpu_time.py), and
#                                                           # the figure (kernels.py zoo)
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session23.sh 2   # after the fills went: the attention
#                                                           # kernel tests on the GPU, the same two
#                                                           # timings; replicas grouped vs alone
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session23.sh 3   # part 2 without the replicas (after
#                                                           # part 2's compile failure was fixed)
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session23.sh 4   # part 3 without attention_gpu_time.py
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}
if [ "$part" = 1 ]; then
  timeout 300 python3 benchmarks/attention_gpu_time.py --out "$OUT/attention_gpu_time.json" \
    > "$OUT/attention_gpu_time.log" 2>&1
  echo "== attention: kernels or host (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/attention_gpu_time.log" | cut -c1-400
  timeout 240 python3 benchmarks/kernels.py --cases zoo --no-compile \
    --out "$OUT/kernels_zoo.json" > "$OUT/kernels_zoo.log" 2>&1
  echo "== the zoo's attentions (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kernels_zoo.log" | tail -30 | cut -c1-300
elif [ "$part" = 2 ] || [ "$part" = 3 ] || [ "$part" = 4 ]; then
  GEMC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -x -p no:cacheprovider -n 0 \
    tests/kernels/test_uncovered_rows.py tests/kernels/test_silu_key_block_backward.py \
    tests/kernels/test_jagged_attention.py > "$OUT/tests.log" 2>&1
  echo "== attention kernel tests on the GPU (exit $?, $((SECONDS - t0)) s)"; tail -3 "$OUT/tests.log"
  [ "$part" = 4 ] || timeout 200 python3 benchmarks/attention_gpu_time.py --models hstu,mmoe \
    --out "$OUT/attention_gpu_time.json" > "$OUT/attention_gpu_time.log" 2>&1
  echo "== attention: kernels or host (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/attention_gpu_time.log" | cut -c1-700
  timeout 200 python3 benchmarks/kernels.py --cases zoo --no-compile \
    --out "$OUT/kernels_zoo.json" > "$OUT/kernels_zoo.log" 2>&1
  echo "== the zoo's attentions (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kernels_zoo.log" | grep -E "triton jagged|cudnn|^zoo" | cut -c1-300
  [ "$part" != 2 ] && exit 0
  timeout 150 python3 benchmarks/replica_step.py --device cuda --compare \
    --out "$OUT/replica_step.json" > "$OUT/replica_step.log" 2>&1
  echo "== replicas grouped vs alone (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/replica_step.log" | tail -15 | cut -c1-300
fi
