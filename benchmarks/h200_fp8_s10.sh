#!/usr/bin/env bash
# One device call (< 4 min), issue 21: where the compiled row-wise fp8 linear's time goes.
#   source scripts/device_env.sh && bash benchmarks/h200_fp8_s10.sh
# 1. tests/kernels/test_fp8_quant.py on the GPU: gemc's fp8 quantisation kernels with the
#    hardware cast (cvt.rn.satfinite), bit for bit against gemc's ATen quantisation (on the
#    CPU only the soft-rounded path is checked); and the fp8 linear with quantizer "triton"
#    on CUDA tensors (tests/precision/test_fp8_compiled.py -k triton_quantizer: the step
#    bit-equal to the ATen quantizer's, eager and compiled; one compile for aligned and
#    unaligned token counts). Prints pytest's summary line and any failure.
# 2. benchmarks/fp8_breakdown.py at K = N = 4096, M in {8192, 32768}: every piece timed
#    alone (bf16 and fp8 GEMMs, each operand's quantisation eager step by step, compiled,
#    and by gemc's kernels) and the whole compiled LayerNorm -> Linear fwd+bwd in bf16, fp8
#    with the ATen quantizer (today's path) and fp8 with gemc's kernels. Prints one summary
#    line per M ("M=...: {json}") and then one table row per piece: its ms at each M, its
#    GB/s or TFLOP/s at the largest M, and for the kernels whether their fp8 bits equal
#    the ATen path's. Everything lands in $OUT (fp8_breakdown.json, the logs).
set -uo pipefail
OUT="${OUT:-/tmp/h200_fp8_s10}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

echo "== 1. fp8 quantisation kernels on the GPU"
GEMC_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_fp8_quant.py tests/precision/test_fp8_compiled.py -k "test_fp8_quant or triton_quantizer" \
  > "$OUT/kernel_tests.log" 2>&1
echo "(exit $?) $(tail -1 "$OUT/kernel_tests.log")"
grep -E "^(FAILED|E ) " "$OUT/kernel_tests.log" | head -6

echo "== 2. fp8 breakdown"
timeout 170 python3 benchmarks/fp8_breakdown.py --warmup 3 --iters 20 \
  --out "$OUT/fp8_breakdown.json" > "$OUT/breakdown.log" 2> "$OUT/breakdown.err"
echo "(exit $?)"
grep -E "^M=|^note|wrote" "$OUT/breakdown.log" "$OUT/breakdown.err" | cut -d: -f2- | cut -c1-600
python3 - "$OUT/fp8_breakdown.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
except (OSError, ValueError) as e:
    sys.exit(f"no breakdown json: {e}")
names = list(dict.fromkeys(n for r in rows for part in ("gemm", "quant", "unit") for n in r[part]))
print(f"{'piece':42s}" + "".join(f"{'M=' + str(r['m']):>11s}" for r in rows) + "  rate@maxM  bits")
for n in names:
    cells, last = [], {}
    for r in rows:
        v = {**r["gemm"], **r["quant"], **r["unit"]}.get(n, {})
        cells.append(f"{v['ms']:11.4f}" if "ms" in v else f"{'ERR' if 'error' in v else '-':>11s}")
        last = v or last
    rate = last.get("gb_per_s", last.get("tflop_per_s", ""))
    unit = " GB/s" if "gb_per_s" in last else (" TF/s" if "tflop_per_s" in last else "")
    bits = {True: "equal", False: "DIFFER"}.get(last.get("bits_equal_aten"), "")
    err = f"  {last['error'][:70]}" if "error" in last else ""
    print(f"{n:42s}{''.join(cells)}  {str(rate) + unit:>10s}  {bits}{err}")
PY
