#!/usr/bin/env bash
# Thirty-second session's device calls (issue 17), each < 10 min:
#   bash benchmarks/h100_session32.sh 1   # the row kernel (loads gathered at the top of each
#       # tile pair, delta recomputed per pair, one uncovered-rows test a program) on the
#       # GPU: its tests at every config it may pick and the uncovered-rows tests; TransAct's
#       # region at each forward and row-kernel config (attention_gpu_time.py
#       # --transact-blocks); TransAct's attention by default against padded cuDNN on the
#       # same machine (--defaults-only)
#   bash benchmarks/h100_session32.sh 2   # after the forward's pick was capped at 96
#       # registers: TransAct's attention by default against padded cuDNN first, then the
#       # GPU tests at the row kernel's 64-row pick, then every config again
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}
budget=585  # seconds this call may take in all

defaults_vs_cudnn() {  # TransAct's attention by default, against padded cuDNN, one machine
  timeout "$1" python3 benchmarks/attention_gpu_time.py --models transact --defaults-only \
    --out "$OUT/agt_transact.json" > /tmp/agt.log 2>&1
  echo "== transact attention, defaults vs cuDNN (exit $?, $((SECONDS - t0)) s)"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['models']['transact']; \
[print(r['variant'][:36], r.get('do_bench_ms'), r.get('graph_ms'), r.get('kernels_ms'), \
r.get('host_ms'), [(n[:20], round(x, 4)) for n, x in r.get('top', [])[:3]]) for r in m['rows']]; \
print(d['versus_cudnn'])" "$OUT/agt_transact.json" 2>&1 | cut -c1-300
  grep -E "Error|error" /tmp/agt.log | sort | uniq -c | head -5 | cut -c1-300
}

print_blocks() {  # the rows of $OUT/blocks.json (attention_gpu_time.py --transact-blocks)
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['models']['transact_blocks']; \
f=lambda x: round(x, 4) if isinstance(x, float) else str(x)[:60]; \
[print(r['variant'], f(r.get('graph_ms')), f(r.get('kernels_ms')), f(r.get('max_err')), \
[(n[:16], round(ms, 4)) for n, ms in r.get('top', [])[:3]], str(r.get('error', ''))[:100]) \
for r in d['rows']]" "$OUT/blocks.json" 2>&1 | cut -c1-300
}

if [ "$part" = 1 ]; then
  GEMC_TEST_DEVICE=cuda timeout 220 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py tests/kernels/test_uncovered_rows.py \
    -k "not hopper" > "$OUT/tests.log" 2>&1
  echo "== row kernel's and uncovered rows' tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -10 | cut -c1-300
  timeout 190 python3 benchmarks/attention_gpu_time.py --transact-blocks \
    --out "$OUT/blocks.json" > /tmp/blocks.log 2>&1
  echo "== TransAct region at each forward / row-kernel config (exit $?, $((SECONDS - t0)) s)"
  print_blocks
  grep -E "Error|error" /tmp/blocks.log | sort | uniq -c | head -5 | cut -c1-300
  defaults_vs_cudnn $((budget - SECONDS + t0 - 5))
fi
if [ "$part" = 2 ]; then  # the key figure first: the call may be cut short
  defaults_vs_cudnn 70
  GEMC_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py -k "row64 or not one_kernel" \
    > "$OUT/tests.log" 2>&1
  echo "== the picks' tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -6 | cut -c1-300
  timeout 90 python3 benchmarks/attention_gpu_time.py --transact-blocks \
    --out "$OUT/blocks.json" > /tmp/blocks.log 2>&1
  echo "== TransAct region at each config (exit $?, $((SECONDS - t0)) s)"
  print_blocks
fi
