#!/usr/bin/env bash
# Thirtieth session's device calls (issue 17), each < 10 min:
#   bash benchmarks/h100_session30.sh 1   # what s29 built and could not run: TransAct's
#       # region attention with the one-kernel softmax backward of short rows on and off
#       # (GEMC_FUSED_SOFTMAX_SHORT_ROWS=1 / 0; attention_gpu_time.py); the attention
#       # kernels', values ops' and fused backward's tests on the GPU; TransAct's step,
#       # gemc and gemc-cudagraphs, on one machine, after register_table made the bags'
#       # layout ahead of the graph; with the time left, HSTU's gemc step and one profiled
#       # step's kernels (row sums' ids now compared as int32)
#   bash benchmarks/h100_session30.sh 2   # TransAct's gemc-cudagraphs step after the bags'
#       # layout stopped copying from pageable host memory under a capture (part 1 failed
#       # there); then every zoo attention's fwd+bwd, gemc's defaults and padded cuDNN,
#       # by do_bench, CUDA graph replay, kernel sum and host time (attention_gpu_time.py)
#   bash benchmarks/h100_session30.sh 3   # the softmax backward of short rows rebuilt as one
#       # program per (sequence, head) (softmax_row_backward.py): TransAct's region attention
#       # with it at 64- and 32-row blocks and with the two kernels; its tests on the GPU;
#       # TransAct's gemc-cudagraphs step (part 2's first item); HSTU's gemc step (row sums
#       # skip zero values); with the time left, the row kernel at 32-row blocks and
#       # TransAct's gemc step with the row kernel on
#   bash benchmarks/h100_session30.sh 4   # what part 3's budget cut: the row kernel's and
#       # the row sums' tests on the GPU (rows of two blocks), HSTU's gemc step (row sums
#       # skip zeros), TransAct gemc and gemc-cudagraphs with 16 steps each on one machine
#       # (past the recordings of each new token-count bucket; per-step losses compared)
#   bash benchmarks/h100_session30.sh 5   # hstu, sasrec_bst, mmoe, din: gemc and
#   bash benchmarks/h100_session30.sh 6   # transact, dlrm_dcnv2, wukong: gemc-cudagraphs,
#       # 12 steps each on one machine, the per-step losses compared: what CUDA graphs by
#       # default on a GPU would need (every zoo model's step and loss)
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}

source scripts/zoo_step.sh  # step MODEL VARIANT TIMEOUT STEPS WARMUP

agt() {  # $1 GEMC_FUSED_SOFTMAX_SHORT_ROWS (and $2 the row kernel's block, part 3): TransAct's
  # region attention, GPU and host time
  GEMC_FUSED_SOFTMAX_SHORT_ROWS=$1 ROW_BLOCK=${2:-} timeout 75 python3 -c "
import os, sys
sys.path.insert(0, 'benchmarks')
if os.environ['ROW_BLOCK']:  # the row kernel's pick replaced (its hook holds the heuristic)
    from gemc.backends.triton import config_choice as cc, softmax_row_backward  # noqa: F401
    hook = cc._KERNELS['jagged_attention._bwd_softmax_row_kernel'][0]
    hook.prefer = lambda args: [({'BLOCK': int(os.environ['ROW_BLOCK'])}, 4, 1)]
import attention_gpu_time as A
A.main(['--models', 'transact', '--defaults-only', '--out', sys.argv[1]])
from gemc.backends.triton import config_choice as cc
print('configs ran', {k: v for k, v in cc.ran('jagged_attention.').items() if v})
" "$OUT/agt_transact_fused$1${2:-}.json" > "/tmp/agt$1.log" 2>&1
  echo "== TransAct attention, fused softmax backward $1 (exit $?, $((SECONDS - t0)) s)"
  [ "$part" = 1 ] && tail -c 4000 "/tmp/agt$1.log" > "$OUT/agt$1.log.tail"
  grep "configs ran" "/tmp/agt$1.log" | cut -c1-600
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['models']['transact']; \
f=lambda x: round(x, 3) if isinstance(x, float) else str(x)[:60]; \
[print(r['variant'][:40], f(r.get('do_bench_ms')), f(r.get('graph_ms')), f(r.get('kernels_ms')), \
f(r.get('host_ms')), [(n[:22], round(ms, 4)) for n, ms in r.get('top', [])[:6]]) for r in d['rows']]" \
    "$OUT/agt_transact_fused$1${2:-}.json" 2>&1 | cut -c1-400
}

if [ "$part" = 1 ]; then
  agt 1
  agt 0
  GEMC_TEST_DEVICE=cuda timeout 80 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py tests/kernels/test_jagged_attention.py \
    tests/kernels/test_custom_ops.py > "$OUT/tests.log" 2>&1
  echo "== fused softmax, jagged attention, values ops on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
  step transact gemc 140 10 3
  step transact gemc-cudagraphs 160 10 3
  if [ $((SECONDS - t0)) -lt 440 ]; then  # HSTU's step and its kernels, with what time is left
    timeout $((560 - SECONDS + t0)) python3 benchmarks/zoo.py --out /tmp/hstu_prof \
      --models hstu --variants gemc --steps 5 --warmup 2 --profile 1 > /tmp/hstu_prof.log 2>&1
    echo "== hstu gemc, profiled (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/hstu_prof/zoo.json "$OUT/hstu_gemc_prof.json" 2>/dev/null
    cp /tmp/hstu_prof/*kernels.txt /tmp/hstu_prof/*gaps.txt "$OUT/" 2>/dev/null
    python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['hstu'][0]; \
print(v.get('step_ms'), [round(x, 2) for x in v.get('step_ms_all', [])], (v.get('losses') or [None])[-1])" \
      "$OUT/hstu_gemc_prof.json"
    head -25 /tmp/hstu_prof/*kernels.txt 2>/dev/null | cut -c1-200
  fi
fi
if [ "$part" = 2 ]; then
  step transact gemc-cudagraphs 170 10 3
  grep -n "Traceback" -A200 /tmp/transact_gemc-cudagraphs.log | grep "File \"/work/main\|Error" \
    | head -12 | cut -c1-250
  timeout 170 python3 benchmarks/attention_gpu_time.py --models hstu,sasrec_bst,mmoe,transact \
    --defaults-only --out "$OUT/agt_zoo.json" > /tmp/agt_zoo.log 2>&1
  echo "== zoo attentions (exit $?, $((SECONDS - t0)) s)"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['models']; \
f=lambda x: round(x, 3) if isinstance(x, float) else str(x)[:60]; \
[print(m, r['variant'][:34], f(r.get('do_bench_ms')), f(r.get('graph_ms')), f(r.get('kernels_ms')), \
f(r.get('host_ms'))) for m, e in d.items() for r in e['rows']]" "$OUT/agt_zoo.json" 2>&1 | cut -c1-300
  python3 -c "import json,sys; [print(m, v) for m, v in \
json.load(open(sys.argv[1]))['versus_cudnn'].items()]" "$OUT/agt_zoo.json" 2>&1 | cut -c1-300
fi
if [ "$part" = 3 ]; then
  agt 1 64
  agt 0
  GEMC_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py tests/kernels/test_uncovered_rows.py \
    tests/kernels/test_small_table_gather.py -k "not hopper" > "$OUT/tests.log" 2>&1
  echo "== row kernel's, uncovered rows' and row sums' tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
  step transact gemc-cudagraphs 150 8 3
  grep -n "Traceback" -A200 /tmp/transact_gemc-cudagraphs.log | grep "File \"/work/main\|Error" \
    | head -12 | cut -c1-250
  step hstu gemc 100 5 2
  agt 1 32
  if [ $((SECONDS - t0)) -lt 380 ]; then
    GEMC_FUSED_SOFTMAX_SHORT_ROWS=1 step transact gemc $((520 - SECONDS + t0)) 10 3
  fi
fi
if [ "$part" = 4 ]; then
  GEMC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_fused_softmax_backward.py tests/kernels/test_small_table_gather.py \
    -k "not hopper" > "$OUT/tests.log" 2>&1
  echo "== row kernel's and row sums' tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
  step hstu gemc 100 5 2
  step transact gemc 150 16 3
  step transact gemc-cudagraphs 170 16 3
  python3 -c "import json,sys; a, b = (json.load(open(f))['variants']['transact'][0]['losses'] \
for f in sys.argv[1:]); print('max |loss diff| gemc vs gemc-cudagraphs', \
max(abs(x - y) for x, y in zip(a, b)))" "$OUT/transact_gemc.json" "$OUT/transact_gemc-cudagraphs.json"
fi
if [ "$part" = 5 ] || [ "$part" = 6 ]; then
  models="hstu sasrec_bst mmoe din"
  [ "$part" = 6 ] && models="transact dlrm_dcnv2 wukong"
  for m in $models; do
    for v in gemc gemc-cudagraphs; do
      timeout 68 python3 benchmarks/zoo.py --out "/tmp/cg_${m}_$v" --models "$m" --variants "$v" \
        --steps 12 --warmup 3 > "/tmp/cg_${m}_$v.log" 2>&1
      echo "== $m $v (exit $?, $((SECONDS - t0)) s)"
      cp "/tmp/cg_${m}_$v/zoo.json" "/tmp/cg_${m}_$v.json" 2>/dev/null
    done
    python3 -c "import json,sys; r = [json.load(open(f))['variants'][sys.argv[1]][0] \
for f in sys.argv[2:]]; print(sys.argv[1], [(x.get('variant'), x.get('step_ms'), \
[round(t, 1) for t in x.get('step_ms_all', [])[3:]], str(x.get('error', ''))[:120]) for x in r], \
'max |loss diff|', max((abs(a - b) for a, b in zip(r[0].get('losses') or [], \
r[1].get('losses') or [])), default=None))" "$m" "/tmp/cg_${m}_gemc.json" \
      "/tmp/cg_${m}_gemc-cudagraphs.json" 2>&1 | tee -a "$OUT/cudagraphs_zoo.txt" | cut -c1-400
  done
fi
