#!/usr/bin/env bash
# Thirty-first session's device calls (issue 17), each < 10 min:
#   bash benchmarks/h100_session31.sh 1   # the row kernel's and row sums' tests on the GPU
#       # (rows of two blocks: dq through the row kernel's scratch), then transact,
#       # dlrm_dcnv2 and wukong, gemc and gemc-cudagraphs each (with the row kernel on
#       # where its tests passed: the default it would become)
#   bash benchmarks/h100_session31.sh 2   # TransAct's region attention at each forward and
#       # row-kernel config (attention_gpu_time.py --transact-blocks), then hstu, sasrec_bst,
#       # mmoe and din, gemc and gemc-cudagraphs each
#   bash benchmarks/h100_session31.sh 3   # with the row kernel on by default, its pick set
#       # to 32-row blocks first (softmax_row_backward._prefer, and BLOCK = 32 in its
#       # test): its tests on the GPU, TransAct's attention against padded cuDNN
#       # (--defaults-only), and sasrec_bst's gemc losses again (run-to-run spread)
#   bash benchmarks/h100_session31.sh 4   # the GEM and DLRM examples, gemc and
#       # gemc-cudagraphs each (the zoo's seven ran in parts 1 and 2)
# Each model's pair runs 12 steps (3 warm-up) in its own processes on one machine; a line a
# model (both steps, every step's time past the warm-up, the largest per-step loss gap, any
# error) goes to stdout and to $OUT/cudagraphs_zoo.txt; both variants' rows to
# $OUT/pairs.json; a failed run's last log lines to $OUT/failures.txt. What CUDA graphs by
# default on a GPU would need: every zoo model's step and losses under them.
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}
budget=585  # seconds this call may take in all

pair() {  # MODEL TIMEOUT: gemc without, then with CUDA graphs, if the time left allows each
  # (gemc-nographs: what the gemc variant was when calls 1 and 2 ran, before --compile-mode auto)
  local m=$1 limit=$2 v left
  for v in gemc-nographs gemc-cudagraphs; do
    left=$((budget - SECONDS + t0))
    if [ "$left" -lt 45 ]; then echo "== $m $v skipped (${left} s left)"; continue; fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" python3 benchmarks/zoo.py --out "/tmp/cg_${m}_$v" --models "$m" \
      --variants "$v" --steps 12 --warmup 3 > "/tmp/cg_${m}_$v.log" 2>&1
    local rc=$?
    echo "== $m $v (exit $rc, $((SECONDS - t0)) s)"
    if [ "$rc" != 0 ] || ! [ -f "/tmp/cg_${m}_$v/zoo.json" ]; then
      { echo "==== $m $v exit $rc"; grep -E "Error|error|Traceback" "/tmp/cg_${m}_$v.log" \
          | sort | uniq -c | sort -rn | head -5 | cut -c1-300
        tail -c 2500 "/tmp/cg_${m}_$v.log"; } >> "$OUT/failures.txt"
    fi
    grep -E "fell back|cudagraph|CUDAGraph|skipping cudagraphs" "/tmp/cg_${m}_$v.log" \
      | sort | uniq -c | sort -rn | head -4 | cut -c1-250
  done
  python3 - "$m" "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/cudagraphs_zoo.txt" | cut -c1-600
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
print(m, "max |loss gap| per step", gap, "of", len(a), len(b), "losses; last",
      a[-1:] , b[-1:])
EOF
}

if [ "$part" = 1 ]; then
  GEMC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py tests/kernels/test_small_table_gather.py \
    -k "not hopper" > "$OUT/tests.log" 2>&1
  echo "== row kernel's and row sums' tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
  if grep -qE "[0-9]+ passed" "$OUT/tests.log" && ! grep -qE "failed|error" "$OUT/tests.log"; then
    export GEMC_FUSED_SOFTMAX_SHORT_ROWS=1  # it passed: the steps below run the coming default
  fi
  echo "== steps with GEMC_FUSED_SOFTMAX_SHORT_ROWS=${GEMC_FUSED_SOFTMAX_SHORT_ROWS:-unset}" \
    | tee -a "$OUT/cudagraphs_zoo.txt"
  pair transact 120
  pair dlrm_dcnv2 90
  pair wukong 90
fi
if [ "$part" = 2 ]; then
  timeout 150 python3 benchmarks/attention_gpu_time.py --transact-blocks --out "$OUT/blocks.json" \
    > /tmp/blocks.log 2>&1
  echo "== TransAct region at each forward / row-kernel config (exit $?, $((SECONDS - t0)) s)"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['models']['transact_blocks']; \
f=lambda x: round(x, 4) if isinstance(x, float) else str(x)[:60]; \
[print(r['variant'], f(r.get('graph_ms')), f(r.get('kernels_ms')), f(r.get('max_err')), \
[(n[:16], round(ms, 4)) for n, ms in r.get('top', [])[:3]], str(r.get('error', ''))[:100]) \
for r in d['rows']]" "$OUT/blocks.json" 2>&1 | cut -c1-300
  grep -E "Error|error" /tmp/blocks.log | sort | uniq -c | head -5 | cut -c1-300
  export GEMC_FUSED_SOFTMAX_SHORT_ROWS=${ROW_KERNEL:-0}  # ROW_KERNEL=1: as part 1 ran
  echo "== steps with GEMC_FUSED_SOFTMAX_SHORT_ROWS=$GEMC_FUSED_SOFTMAX_SHORT_ROWS" \
    | tee -a "$OUT/cudagraphs_zoo.txt"
  for m in hstu sasrec_bst mmoe din; do pair "$m" 90; done
fi
if [ "$part" = 3 ]; then
  GEMC_TEST_DEVICE=cuda timeout 110 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py > "$OUT/tests.log" 2>&1
  echo "== row kernel's tests on the GPU, 32-row blocks by default (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -6 | cut -c1-300
  timeout 100 python3 benchmarks/attention_gpu_time.py --models transact --defaults-only \
    --out "$OUT/agt_transact.json" > /tmp/agt.log 2>&1
  echo "== transact attention, defaults (exit $?, $((SECONDS - t0)) s)"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['models']['transact']; \
  [print(r['variant'][:36], r.get('do_bench_ms'), r.get('graph_ms'), r.get('kernels_ms'), r.get('host_ms'), \
  [(n[:20], round(x, 4)) for n, x in r.get('top', [])[:3]]) for r in m['rows']]; print(d['versus_cudnn'])" \
    "$OUT/agt_transact.json" 2>&1 | cut -c1-300
  timeout $((330 - SECONDS + t0)) python3 benchmarks/zoo.py --out /tmp/sb --models sasrec_bst \
    --variants gemc --steps 12 --warmup 3 > /tmp/sb.log 2>&1
  echo "== sasrec_bst gemc again (exit $?, $((SECONDS - t0)) s)"
  python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['sasrec_bst'][0]; \
  print(v.get('step_ms'), [round(x, 4) for x in v.get('losses', [])])" /tmp/sb/zoo.json
fi
if [ "$part" = 4 ]; then  # the two examples under CUDA graphs: what a default needs besides the zoo
  pair gem 240
  pair dlrm 150
fi
