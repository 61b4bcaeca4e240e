#!/usr/bin/env bash
# What the nineteenth session could not run (its device time ran out), on an H200:
#   1. the embedding bag's kernel tests on the GPU, the two-phase row-wise Adagrad race fix
#      (825ff0b) among them, then narrow_split (its whole-row check failed at 27b9d85);
#   2. HSTU's silu variants: the key-block backward (SILU_KEY_BLOCK_BACKWARD, off until this
#      shows its errors at the old path's level and its time) and the bias rows after 233ee3a;
#   3. HSTU warm, gemc (Inductor's pointwise kernels untimed, the default since 0dfd44f) vs
#      gemc-pwtune: is 0dfd44f the +17.5% (38.22 -> 44.92 ms) since 9f27354?
#   1b. (issue 19) narrow_split at the global batch a DLRMv2 column shard serves (65,536 bags
#      x 100 ids), beside gemc's model's price of the same shard.
#   GEMC_COMMIT=<this checkout's sha, typed> bash benchmarks/h200_session20.sh 1   # ~8 min
#   4. issue 21 with gemc's Triton quantisers (triton_ops since s11, never run on a model):
#      LayerNorm -> Linear at Wukong's M = 8,192 and K, N in {2048, 4096}, then Wukong
#      gemc vs gemc-fp8 (fp8 forced on every linear >= 1024 features), 30 steps.
#   GEMC_COMMIT=<this checkout's sha, typed> bash benchmarks/h200_session20.sh 2   # ~5 min
#   GEMC_COMMIT=<this checkout's sha, typed> bash benchmarks/h200_session20.sh 3   # ~6 min
# (three device calls: each inside a command's 10 minutes)
set -uo pipefail
PART="${1:?usage: bash benchmarks/h200_session20.sh 1|2}"
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
t0=$SECONDS
if [ "$PART" = 1 ]; then
GEMC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_embedding_bag.py tests/kernels/test_embedding_bag_column_shards.py \
  2>&1 | tail -15 | tee "$OUT/embedding_bag_tests.log"
echo "== 0. embedding bag tests on the GPU ($((SECONDS - t0)) s)"
timeout 200 python3 benchmarks/kernels.py --cases narrow_split --no-compile \
  --out "$OUT/narrow_split.json" > "$OUT/narrow_split.log" 2>&1
echo "== 1. narrow_split (exit $?, $((SECONDS - t0)) s)"; grep -vE "Warning|warn" "$OUT/narrow_split.log" | tail -12 | cut -c1-300
# issue 19: a DLRMv2 column shard serves the global batch (65,536 bags x 100 ids): what its
# fused step costs against gemc's model (TorchRec's estimator: 0.979 ms for t13's 16 columns)
timeout 200 python3 benchmarks/kernels.py --cases narrow_split --no-compile \
  --narrow-batch 65536 --narrow-poolings 100 \
  --out "$OUT/narrow_split_65536.json" > "$OUT/narrow_split_65536.log" 2>&1
echo "== 1b. narrow_split at 65,536 bags (exit $?, $((SECONDS - t0)) s)"
grep -E "^column shard|rror" "$OUT/narrow_split_65536.log" | cut -c1-300
exit 0
fi
if [ "$PART" = 3 ]; then
export GEMC_FP8_QUANTIZER=triton
timeout 200 python3 benchmarks/precision.py --gemms --tokens 8192 --features 2048,4096 \
  --out "$OUT/fp8_gemms_triton.json" > "$OUT/fp8_gemms.log" 2>&1
echo "== 4a. fp8 LayerNorm -> Linear, triton quantisers (exit $?, $((SECONDS - t0)) s)"
grep -E "^M=|geomean|rror" "$OUT/fp8_gemms.log" | cut -c1-300
timeout 330 python3 benchmarks/zoo.py --out "$OUT/fp8" --models wukong --variants gemc,gemc-fp8 \
  --steps 30 --warmup 3 --time-limit 150 --child-timeout 150 > "$OUT/fp8.log" 2>&1
echo "== 4b. wukong gemc vs gemc-fp8, triton quantisers (exit $?, $((SECONDS - t0)) s)"
grep -vE "Warning|warn" "$OUT/fp8.log" | grep -E "^== |^ +(variant|gemc|gemc-fp8) |skipped|rror" | cut -c1-300
cd "$OUT" && tar czf fp8.tar.gz fp8 && rm -rf fp8
exit 0
fi
timeout 120 python3 benchmarks/kernels.py --cases silu_variants --no-compile \
  --out "$OUT/silu_variants.json" > "$OUT/silu.log" 2>&1
echo "== 2. silu variants (exit $?, $((SECONDS - t0)) s)"; grep -E "silu variant|rror" "$OUT/silu.log" | cut -c1-300
timeout 150 python3 benchmarks/zoo.py --out "$OUT/pw" --models hstu --variants gemc,gemc-pwtune \
  --steps 20 --warmup 3 --time-limit 120 --child-timeout 70 > "$OUT/pw.log" 2>&1
echo "== 3. hstu gemc vs gemc-pwtune (exit $?, $((SECONDS - t0)) s)"
grep -vE "Warning|warn" "$OUT/pw.log" | grep -E "^== |^ +(variant|gemc|gemc-pwtune) |skipped|rror" | cut -c1-300
cd "$OUT" && tar czf pw.tar.gz pw && rm -rf pw
