#!/usr/bin/env bash
# The fp8 linear's host time (issue 21, branch s11-fp8), one H200, < 9.5 min:
#   1. the fp8 tests on the GPU: the quantisation ops are triton_ops there (the CPU runs
#      them as custom ops), so this is where Inductor compiles them for real;
#   2. the compiled LayerNorm -> Linear at M = 8,192 under the profiler, host against GPU
#      (is the fp8 triton unit still host-bound?), its y, dx, dW bit-equal to fp8 aten;
#   3. the breakdown: the quantisation pieces and the units' fwd+bwd times;
#   4. (2) again with Inductor's static launcher for user Triton kernels (off by default;
#      the quantisation kernels are user kernels now): does it cut host time further?
#   bash benchmarks/h200_session11_fp8host.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$"; }
echo "== 1. fp8 tests on the GPU"
for t in tests/kernels/test_fp8_quant.py tests/precision/test_fp8_compiled.py \
         tests/precision/test_fp8_op.py; do
  GEMC_TEST_DEVICE=cuda timeout 70 python3 -m pytest -q -p no:cacheprovider -x "$t" 2>&1 \
    | tail -4
done
echo "== 2. unit profile, M = 8192"
timeout 150 python3 benchmarks/fp8_unit_profile.py --tokens 8192 \
  --out "$OUT/fp8_unit_profile.json" 2>&1 | quiet | cut -c1-200
echo "== 3. breakdown"
timeout 180 python3 benchmarks/fp8_breakdown.py --warmup 3 --iters 20 \
  --out "$OUT/fp8_breakdown.json" 2>&1 | quiet | cut -c1-200 | tail -40
echo "== 4. unit profile, M = 8192, static launch of user Triton kernels"
TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1 timeout 110 python3 \
  benchmarks/fp8_unit_profile.py --tokens 8192 --out "$OUT/fp8_unit_profile_static.json" \
  2>&1 | quiet | grep -E "^(bf16|fp8)|bit-equal" | cut -c1-200
