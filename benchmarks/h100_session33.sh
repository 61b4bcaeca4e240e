#!/usr/bin/env bash
# Thirty-third session's device call (issue 17), < 10 min:
#   bash benchmarks/h100_session33.sh 1   # TransAct's attention by default against padded
#       # cuDNN first (the logsumexp and kept flags no longer zero-filled, the forward capped
#       # at 96 registers); then its region at each row-kernel config, the key-major tiles
#       # among them (attention_gpu_time.py --transact-blocks); then the GPU tests of the
#       # row kernel's 64-row pick and key-major configs, the uncovered rows (the
#       # logsumexp's now) and the key bias's kernel
#   bash benchmarks/h100_session33.sh 2   # the same, shorter (~330 s): part 1's call was
#       # taken back mid-call, and the device time left fits no second one of its length
#   bash benchmarks/h100_session33.sh 3   # part 2's timings alone (~190 s), no tests
#   CALL_S=250 bash benchmarks/h100_session33.sh 2   # part 2 with its tests cut at 250 s in all
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
r.get('host_ms'), [(n[:20], round(x, 4)) for n, x in r.get('top', [])[:5]]) for r in m['rows']]; \
print(d['versus_cudnn'])" "$OUT/agt_transact.json" 2>&1 | cut -c1-400
  grep -E "Error|error" /tmp/agt.log | sort | uniq -c | head -5 | cut -c1-300
}

print_blocks() {  # the rows of $OUT/blocks.json (attention_gpu_time.py --transact-blocks)
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['models']['transact_blocks']; \
f=lambda x: round(x, 4) if isinstance(x, float) else str(x)[:60]; \
[print(r['variant'], f(r.get('graph_ms')), f(r.get('kernels_ms')), f(r.get('max_err')), \
[(n[:16], round(ms, 4)) for n, ms in r.get('top', [])[:3]], str(r.get('error', ''))[:100]) \
for r in d['rows']]; [print(n, c) for n, cs in d.get('compiled', {}).items() for c in cs]" \
    "$OUT/blocks.json" 2>&1 | cut -c1-300
}

blocks() {  # TransAct's region at each forward / row-kernel config, in at most $1 s
  timeout "$1" python3 benchmarks/attention_gpu_time.py --transact-blocks \
    --out "$OUT/blocks.json" > /tmp/blocks.log 2>&1
  echo "== TransAct region at each forward / row-kernel config (exit $?, $((SECONDS - t0)) s)"
  print_blocks
  grep -E "Error|error" /tmp/blocks.log | sort | uniq -c | head -5 | cut -c1-300
}

gpu_tests() {  # the row kernel's ($2: pytest -k), uncovered rows' and key bias's, $1 s
  GEMC_TEST_DEVICE=cuda timeout "$1" python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py tests/kernels/test_uncovered_rows.py \
    tests/kernels/test_rep_key_bias.py -k "$2" > "$OUT/tests.log" 2>&1
  echo "== row kernel's, uncovered rows' and key bias's tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -12 | cut -c1-300
  grep -E "^[.FEsx]+ *(\[ *[0-9]+%\])?$" "$OUT/tests.log" | tail -4  # progress, if cut short
}

if [ "$part" = 1 ]; then  # the key figure first: the call may be cut short
  defaults_vs_cudnn 80
  blocks 170
  gpu_tests $((budget - SECONDS + t0 - 5)) "(keys or row64 or not one_kernel) and not hopper"
fi
if [ "$part" = 2 ]; then
  defaults_vs_cudnn 75
  blocks 110
  gpu_tests $((${CALL_S:-330} - SECONDS + t0)) "(keys or not one_kernel) and not hopper"
fi
if [ "$part" = 3 ]; then
  defaults_vs_cudnn 75
  blocks 110
fi
