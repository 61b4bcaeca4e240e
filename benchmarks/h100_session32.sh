#!/usr/bin/env bash
# Thirty-second session's device calls (issue 17), each < 10 min:
#   bash benchmarks/h100_session32.sh 1   # the row kernel (loads gathered at the top of each
#       # tile pair, delta recomputed per pair, one uncovered-rows test a program) on the
#       # GPU: its tests at every config it may pick and the uncovered-rows tests; TransAct's
#       # region at each forward and row-kernel config (attention_gpu_time.py
#       # --transact-blocks); TransAct's attention by default against padded cuDNN on the
#       # same machine (--defaults-only)
#   bash benchmarks/h100_session32.sh 2   # after the picks (forward capped at 96 registers,
#       # dq's scratch loaded after its product again): their GPU tests, the configs again,
#       # TransAct's attention by default against padded cuDNN, and TransAct's steps without
#       # and with CUDA graphs (12 steps, 3 warm-up, each variant its own process)
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

pair() {  # MODEL TIMEOUT: gemc without, then with CUDA graphs, if the time left allows each
  local m=$1 limit=$2 v left
  for v in gemc-nographs gemc-cudagraphs; do
    left=$((budget - SECONDS + t0))
    if [ "$left" -lt 45 ]; then echo "== $m $v skipped (${left} s left)"; continue; fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" python3 benchmarks/zoo.py --out "/tmp/cg_${m}_$v" --models "$m" \
      --variants "$v" --steps 12 --warmup 3 > "/tmp/cg_${m}_$v.log" 2>&1
    echo "== $m $v (exit $?, $((SECONDS - t0)) s)"
    [ -f "/tmp/cg_${m}_$v/zoo.json" ] || tail -c 1500 "/tmp/cg_${m}_$v.log" >> "$OUT/failures.txt"
  done
  python3 - "$m" "$OUT" <<'PY' 2>&1 | tee -a "$OUT/steps.txt" | cut -c1-600
import json, pathlib, sys
m, out = sys.argv[1], pathlib.Path(sys.argv[2])
rows = {}
for v in ("gemc-nographs", "gemc-cudagraphs"):
    p = pathlib.Path(f"/tmp/cg_{m}_{v}/zoo.json")
    rows[v] = json.loads(p.read_text())["variants"][m][0] if p.exists() else {"error": "no result"}
pairs = out / "pairs.json"
allp = json.loads(pairs.read_text()) if pairs.exists() else {}
allp[m] = rows
pairs.write_text(json.dumps(allp))
a, b = (rows[v].get("losses") or [] for v in rows)
gap = max((abs(x - y) for x, y in zip(a, b)), default=None)
for v, r in rows.items():
    print(m, v, r.get("step_ms"), [round(t, 1) for t in r.get("step_ms_all", [])[3:]],
          str(r.get("error", ""))[:160])
print(m, "max |loss gap| per step", gap, "of", len(a), len(b), "losses")
PY
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
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['models']['transact_blocks']; \
f=lambda x: round(x, 4) if isinstance(x, float) else str(x)[:60]; \
[print(r['variant'], f(r.get('graph_ms')), f(r.get('kernels_ms')), f(r.get('max_err')), \
[(n[:16], round(ms, 4)) for n, ms in r.get('top', [])[:3]], str(r.get('error', ''))[:100]) \
for r in d['rows']]" "$OUT/blocks.json" 2>&1 | cut -c1-300
  grep -E "Error|error" /tmp/blocks.log | sort | uniq -c | head -5 | cut -c1-300
  defaults_vs_cudnn $((budget - SECONDS + t0 - 5))
fi
if [ "$part" = 2 ]; then  # the key figure first: the call may be cut short
  defaults_vs_cudnn 70
  GEMC_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py -k "forced_row_config0 or not one_kernel" \
    > "$OUT/tests.log" 2>&1
  echo "== the picks' tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -6 | cut -c1-300
  timeout 90 python3 benchmarks/attention_gpu_time.py --transact-blocks \
    --out "$OUT/blocks.json" > /tmp/blocks.log 2>&1
  echo "== TransAct region at each config (exit $?, $((SECONDS - t0)) s)"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['models']['transact_blocks']; \
[print(r['variant'], round(r.get('graph_ms', -1), 4), round(r.get('kernels_ms', -1), 4), \
[(n[:16], round(ms, 4)) for n, ms in r.get('top', [])[:2]], str(r.get('error', ''))[:100]) \
for r in d['rows']]" "$OUT/blocks.json" 2>&1 | cut -c1-300
fi
