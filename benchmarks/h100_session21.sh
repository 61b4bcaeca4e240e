#!/usr/bin/env bash
# Issue 17: the key-block silu backward (GEMC_SILU_KEY_BLOCK_BACKWARD=1) on the GPU: its
# kernel tests, then HSTU at the zoo's preset with it off and on (each its own zoo.py run,
# gemc only, 20 steps), one call:
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session21.sh     # one GPU, ~5 min
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
t0=$SECONDS
GEMC_TEST_DEVICE=cuda GEMC_SILU_KEY_BLOCK_BACKWARD=1 timeout 90 python3 -m pytest -q -x \
  -p no:cacheprovider tests/kernels/test_silu_key_block_backward.py 2>&1 | tail -3 \
  | tee "$OUT/key_block_tests.log"
echo "== key-block tests on the GPU ($((SECONDS - t0)) s)"
for kb in 0 1; do
  GEMC_SILU_KEY_BLOCK_BACKWARD=$kb timeout 150 python3 benchmarks/zoo.py --out "$OUT/kb$kb" \
    --models hstu --variants gemc --steps 20 --warmup 3 --time-limit 120 --child-timeout 120 \
    > "$OUT/kb$kb.log" 2>&1
  echo "== hstu gemc, key-block backward $kb (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kb$kb.log" | grep -E "^== |^ +(variant|gemc) |skipped|rror" | cut -c1-300
done
cd "$OUT" && tar czf kb.tar.gz kb0 kb1 && rm -rf kb0 kb1
