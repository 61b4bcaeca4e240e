#!/usr/bin/env bash
# Twenty-ninth session's device calls (issue 17), each < 10 min:
#   bash benchmarks/h100_session29.sh 1   # HSTU's gemc step after gather_rows stopped
#       # wrapping its ids in three passes; HSTU's and TransAct's steps with the compiled
#       # graph replayed as CUDA graphs (zoo.py's gemc-cudagraphs: torch.compile
#       # mode="reduce-overhead") against plain gemc, each pair on one machine;
#       # test_small_table_gather on the GPU
#   bash benchmarks/h100_session29.sh 2   # debug: where TransAct's gemc-cudagraphs run keeps
#       # tensors in the CUDA graph pool (Inductor's allocation history)
#   bash benchmarks/h100_session29.sh 3   # TransAct's region attention with the one-kernel
#       # softmax backward of short rows and with the two kernels
#       # (GEMC_FUSED_SOFTMAX_SHORT_ROWS=1 / 0), no copy of the gradient; the fused
#       # backward's and the attention kernels' tests on the GPU; then part 2
#   bash benchmarks/h100_session29.sh 4   # part 3's timings and the fused backward's own
#       # tests on the GPU only (what the session's last device seconds allowed)
#   bash benchmarks/h100_session29.sh 5   # TransAct's step, gemc and gemc-cudagraphs, on
#       # one machine, after register_table made the bags' layout ahead of the graph
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}

source scripts/zoo_step.sh  # step MODEL VARIANT TIMEOUT STEPS WARMUP

if [ "$part" = 1 ]; then
  step hstu gemc 110 5 2
  step hstu gemc-cudagraphs 130 5 3
  step transact gemc 120 8 2
  step transact gemc-cudagraphs 140 8 3
  GEMC_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_small_table_gather.py > "$OUT/tests.log" 2>&1
  echo "== test_small_table_gather on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -6 | cut -c1-300
fi
if [ "$part" = 3 ] || [ "$part" = 4 ]; then
  for fused in 1 0; do
    GEMC_FUSED_SOFTMAX_SHORT_ROWS=$fused timeout 80 python3 benchmarks/attention_gpu_time.py \
      --models transact --defaults-only --out "$OUT/agt_transact_fused$fused.json" \
      > "/tmp/agt$fused.log" 2>&1
    echo "== TransAct attention, fused softmax backward $fused (exit $?, $((SECONDS - t0)) s)"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['models']['transact']; \
[print(r['variant'][:40], round(r.get('do_bench_ms') or 0, 3), round(r.get('graph_ms') or 0, 3), \
round(r.get('kernels_ms') or 0, 3), round(r.get('host_ms') or 0, 3), \
[(n[:22], round(ms, 4)) for n, ms in r.get('top', [])[:6]]) for r in d['rows'][:2] + d['rows'][3:4]]" \
      "$OUT/agt_transact_fused$fused.json" 2>&1 | cut -c1-400
  done
  tests=(tests/kernels/test_fused_softmax_backward.py)
  [ "$part" = 3 ] && tests+=(tests/kernels/test_jagged_attention.py tests/kernels/test_custom_ops.py)
  GEMC_TEST_DEVICE=cuda timeout 70 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    "${tests[@]}" > "$OUT/tests3.log" 2>&1
  echo "== fused softmax, jagged attention, values ops on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests3.log" | tail -8 | cut -c1-300
  [ "$part" = 3 ] && part=2
fi
if [ "$part" = 2 ]; then  # where TransAct's cudagraph pool keeps tensors (debug)
  timeout 130 python3 benchmarks/zoo.py --out /tmp/tcg --models transact \
    --variants gemc-cudagraphs --steps 3 --warmup 1 \
    --child-prefix "python3 benchmarks/cudagraph_history.py" > /tmp/tcg.log 2>&1
  echo "== transact gemc-cudagraphs, history (exit $?, $((SECONDS - t0)) s)"
  cp /tmp/tcg.log "$OUT/tcg.log"
  grep -n "Data Pointer" -A40 /tmp/tcg.log | grep -E "Data Pointer|/work/main|File" \
    | grep -v "site-packages/torch/_" | head -80 | cut -c1-250
fi
if [ "$part" = 5 ]; then
  step transact gemc 150 10 3
  step transact gemc-cudagraphs 170 10 3
fi
