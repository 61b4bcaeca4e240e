#!/usr/bin/env bash
# The steps a device call for TransAct's attention (issue 17) is made of, shared by the
# session scripts that source this after scripts/device_record.sh. Each step is cut at the
# seconds it is given, prints its figures as it ends, and leaves its raw output under $OUT.
# Usage: source benchmarks/transact_device_steps.sh; t0=$SECONDS

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

gpu_tests() {  # GPU tests: $1 seconds, $2 log name under $OUT, $3 pytest -k, the rest files
  local limit=$1 log=$2 expr=$3
  shift 3
  GEMC_TEST_DEVICE=cuda timeout "$limit" python3 -m pytest -v -rf -p no:cacheprovider -n 0 \
    "$@" -k "$expr" > "$OUT/$log" 2>&1
  echo "== GPU tests $log: -k '$expr' (exit $?, $((SECONDS - t0)) s)"
  echo "passed $(grep -c " PASSED" "$OUT/$log"), failed $(grep -c " FAILED" "$OUT/$log")"
  grep -E " FAILED|^E  " "$OUT/$log" | head -12 | cut -c1-300
  grep -E "[0-9]+ (passed|failed)" "$OUT/$log" | tail -2
}
