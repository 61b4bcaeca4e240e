#!/usr/bin/env bash
# Issue 19: what one embedding shard's fused step (forward, backward, row-wise Adagrad) costs
# on the GPU across widths, bags and rows, beside gemc's model's price of each (the
# narrow_split case of benchmarks/kernels.py: one pass, and the column shard's two phases).
# The data the lookup price is fitted to (gemc/cost_model/op_cost.batched_embedding_time).
#   GEMC_COMMIT=<sha> bash benchmarks/lookup_price_sweep.sh     # one GPU, ~5 min
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
t0=$SECONDS
for rows in 40000000 2500000; do
  for batch in 16384 65536; do
    [ "$rows" = 40000000 ] && [ "$batch" = 65536 ] && continue  # run by h200_session20.sh 1
    timeout 120 python3 benchmarks/kernels.py --cases narrow_split --no-compile \
      --narrow-rows $rows --narrow-batch $batch --narrow-poolings 100 \
      --out "$OUT/split_${rows}_${batch}.json" > "$OUT/split_${rows}_${batch}.log" 2>&1
    echo "== rows $rows, $batch bags (exit $?, $((SECONDS - t0)) s)"
    grep -E "^column shard [0-9]+ wide|rror" "$OUT/split_${rows}_${batch}.log" | cut -c1-300
  done
done
