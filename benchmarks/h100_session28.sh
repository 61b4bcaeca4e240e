#!/usr/bin/env bash
# Twenty-eighth session's device calls (issue 17), each < 10 min:
#   bash benchmarks/h100_session28.sh 1   # where HSTU's attention host time goes
#       # (launch_overhead_probe.py); TransAct's region attention with its default and its
#       # autotuned configs, and its kernels under ncu (occupancy, throughput, stalls);
#       # test_jagged_attention.py on the GPU
#   bash benchmarks/h100_session28.sh 2   # the launch probe again (its launcher capture
#       # fixed); TransAct's region kernels over the probe's config sweep; the forward
#       # kernel's source counters under ncu; two more kernel test files on the GPU
#   bash benchmarks/h100_session28.sh 3   # after the short-row configs: the launch probe
#       # with its per-step host times; TransAct's region at its new configs; the issue's
#       # figure for every zoo attention (kernels.py --cases zoo)
#   bash benchmarks/h100_session28.sh 4   # TransAct's step, gemc and gemc with its
#       # attentions left to SDPA (GEMC_ATTENTION_KERNEL=never), each with one profiled step
#       # (zoo.py --profile 1: kernels and GPU gaps, tarred); the changed kernels' tests
#   bash benchmarks/h100_session28.sh 5   # the final figures: the launch probe, the issue's
#       # figure for every zoo attention, TransAct's region attention four ways
#       # (attention_gpu_time.py); the silu key-block backward's and rep_key_bias's tests
#   bash benchmarks/h100_session28.sh 6   # where TransAct's and HSTU's gemc steps leave the
#       # GPU idle: one profiled step each with Python stacks (zoo.py --profile 1
#       # --profile-stack), the gaps files tarred
#   bash benchmarks/h100_session28.sh 7   # TransAct's step, torch.compile and gemc, on one
#       # machine
#   bash benchmarks/h100_session28.sh 8   # HSTU's gemc step after gather_rows stopped
#       # wrapping its ids in three passes (the session's last device seconds)
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}

ncu_transact() {  # $1 timeout: the region attention's three kernels, one launch each
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -z "$ncu" ] && { echo "== ncu: not found"; return; }
  timeout "$1" "$ncu" --clock-control none --target-processes all \
    --kernel-name regex:'_fwd_kernel|_bwd_dq_kernel|_bwd_dkdv_kernel' --launch-skip 6 \
    --launch-count 3 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/launch_overhead_probe.py --transact 3 > "$OUT/ncu_transact.txt" 2>&1
  echo "== ncu, TransAct's region kernels (exit $?, $((SECONDS - t0)) s)"
  grep -E "^  _|Duration|Registers Per|Shared Memory Config|Dynamic Shared|Achieved Occ|Theoretical Occ|Block Limit|Compute \(SM\) Th|Memory Throughput|Waves Per|Grid Size|Block Size|Stall|Issue Slot|No Eligible" \
    "$OUT/ncu_transact.txt" | cut -c1-150 | head -80
}

zoo_attentions() {  # $1 timeout, $2 tag, $3 models: the figure (kernels.py)
  timeout "$1" python3 benchmarks/kernels.py --cases zoo --no-compile --zoo-models "$3" \
    --out "$OUT/kernels_zoo_$2.json" > "/tmp/kernels_zoo_$2.log" 2>&1
  echo "== the zoo's attentions, $2 (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "/tmp/kernels_zoo_$2.log" | grep -E "fwd\+bwd|^zoo" | cut -c1-200
}

if [ "$part" = 1 ]; then
  timeout 120 python3 benchmarks/launch_overhead_probe.py --out "$OUT/launch_probe.json" \
    > /tmp/probe.log 2>&1
  echo "== launch probe (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" /tmp/probe.log | tail -60 | cut -c1-200
  for how in default autotune; do
    env=(); [ "$how" = autotune ] && env=(GEMC_AUTOTUNE=1)
    env "${env[@]}" timeout 120 python3 benchmarks/launch_overhead_probe.py --transact 3 \
      > "/tmp/transact_$how.log" 2>&1
    echo "== TransAct region, $how configs (exit $?, $((SECONDS - t0)) s)"
    grep -E '^\{"fwd_bwd_ms' "/tmp/transact_$how.log" | cut -c1-900
  done
  ncu_transact 150
  left=$((570 - SECONDS + t0))
  GEMC_TEST_DEVICE=cuda timeout "$left" python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_jagged_attention.py > "$OUT/tests.log" 2>&1
  echo "== test_jagged_attention on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
elif [ "$part" = 2 ]; then
  timeout 100 python3 benchmarks/launch_overhead_probe.py --out "$OUT/launch_probe.json" \
    > /tmp/probe.log 2>&1
  echo "== launch probe (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" /tmp/probe.log | tail -70 | cut -c1-200
  timeout 200 python3 benchmarks/launch_overhead_probe.py --sweep --out "$OUT/sweep.json" \
    > /tmp/sweep.log 2>&1
  echo "== TransAct region config sweep (exit $?, $((SECONDS - t0)) s)"
  grep -E '^\{"kernel' /tmp/sweep.log | cut -c1-200
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 100 "$ncu" --clock-control none --kernel-name regex:'_fwd_kernel' --launch-skip 2 \
    --launch-count 1 --section SourceCounters --section InstructionStats \
    python3 benchmarks/launch_overhead_probe.py --transact 3 > "$OUT/ncu_fwd_source.txt" 2>&1
  echo "== ncu source counters, forward (exit $?, $((SECONDS - t0)) s)"
  left=$((570 - SECONDS + t0))
  GEMC_TEST_DEVICE=cuda timeout "$left" python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_sdpa_empty_rows.py tests/kernels/test_attention_bias_and_varlen_keys.py \
    > "$OUT/tests.log" 2>&1
  echo "== two kernel test files on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
elif [ "$part" = 3 ]; then
  timeout 100 python3 benchmarks/launch_overhead_probe.py --out "$OUT/launch_probe.json" \
    > /tmp/probe.log 2>&1
  echo "== launch probe (exit $?, $((SECONDS - t0)) s)"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k.endswith('_us')}); print(d['steps_us']); [print(r) for r in d['launches']]" "$OUT/launch_probe.json"
  timeout 60 python3 benchmarks/launch_overhead_probe.py --transact 3 > /tmp/transact.log 2>&1
  echo "== TransAct region, new configs (exit $?, $((SECONDS - t0)) s)"
  grep -E '^\{"fwd_bwd_ms' /tmp/transact.log | cut -c1-120
  zoo_attentions $((560 - SECONDS + t0)) new hstu,sasrec_bst,mmoe,transact
elif [ "$part" = 4 ]; then
  mkdir -p /tmp/steps
  for v in gemc never; do
    env=(); [ "$v" = never ] && env=(GEMC_ATTENTION_KERNEL=never)
    env "${env[@]}" timeout 170 python3 benchmarks/zoo.py --out /tmp/transact_$v \
      --models transact --variants gemc --steps 10 --warmup 3 --profile 1 \
      > /tmp/transact_$v.log 2>&1
    echo "== transact gemc, $v (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/transact_$v/zoo.json "/tmp/steps/transact_$v.json" 2>/dev/null
    find /tmp/transact_$v -name "*.txt" -exec cp {} /tmp/steps/ \; 2>/dev/null
    python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['transact'][0]; \
print(v['step_ms'], [round(x, 2) for x in v['step_ms_all']], v['losses'][-1])" \
      "/tmp/steps/transact_$v.json"
    for f in /tmp/transact_$v/*gaps.txt; do [ -f "$f" ] && head -25 "$f" | cut -c1-160; done
  done
  tar -czf "$OUT/transact_steps.tgz" -C /tmp steps
  left=$((570 - SECONDS + t0))
  GEMC_TEST_DEVICE=cuda timeout "$left" python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_config_choice.py tests/kernels/test_uncovered_rows.py -k "not hopper" \
    > "$OUT/tests.log" 2>&1
  echo "== config choice and uncovered rows on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
elif [ "$part" = 5 ]; then
  timeout 100 python3 benchmarks/launch_overhead_probe.py --out "$OUT/launch_probe.json" \
    > /tmp/probe.log 2>&1
  echo "== launch probe (exit $?, $((SECONDS - t0)) s)"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k.endswith('_us')}); print(d['steps_us'])" "$OUT/launch_probe.json"
  zoo_attentions 150 final hstu,sasrec_bst,mmoe,transact
  timeout 120 python3 benchmarks/attention_gpu_time.py --models transact --defaults-only \
    --out "$OUT/attention_gpu_time_transact.json" > /tmp/agt.log 2>&1
  echo "== TransAct's attention four ways (exit $?, $((SECONDS - t0)) s)"
  grep -E '^\{"variant' /tmp/agt.log | cut -c1-300
  left=$((570 - SECONDS + t0))
  GEMC_TEST_DEVICE=cuda timeout "$left" python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_silu_key_block_backward.py tests/kernels/test_rep_key_bias.py \
    > "$OUT/tests.log" 2>&1
  echo "== silu key-block backward and rep_key_bias on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
elif [ "$part" = 6 ]; then
  mkdir -p /tmp/gaps
  for m in transact hstu; do
    timeout $([ $m = transact ] && echo 120 || echo 200) python3 benchmarks/zoo.py \
      --out /tmp/gaps_$m --models $m --variants gemc --steps 6 --warmup 3 --profile 1 \
      --profile-stack > /tmp/gaps_$m.log 2>&1
    echo "== $m gemc, profiled (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/gaps_$m/zoo.json "/tmp/gaps/${m}_gemc.json" 2>/dev/null
    find /tmp/gaps_$m -name "*.txt" -exec cp {} /tmp/gaps/ \; 2>/dev/null
    python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['$m'][0]; \
print(v['step_ms'], [round(x, 2) for x in v['step_ms_all']])" "/tmp/gaps/${m}_gemc.json"
    for f in /tmp/gaps_$m/*gaps.txt; do [ -f "$f" ] && sed -n 1,14p "$f" | cut -c1-160; done
  done
  tar -czf "$OUT/gaps.tgz" -C /tmp gaps
elif [ "$part" = 7 ]; then
  for v in compile gemc; do
    timeout 135 python3 benchmarks/zoo.py --out /tmp/transact_$v --models transact \
      --variants $v --steps 8 --warmup 2 > /tmp/transact_$v.log 2>&1
    echo "== transact $v (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/transact_$v/zoo.json "$OUT/transact_$v.json" 2>/dev/null
    python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['transact'][0]; \
print(v['step_ms'], [round(x, 2) for x in v['step_ms_all']], v['losses'][-1])" \
      "$OUT/transact_$v.json"
  done
elif [ "$part" = 8 ]; then
  timeout 110 python3 benchmarks/zoo.py --out /tmp/hstu_gemc --models hstu --variants gemc \
    --steps 5 --warmup 2 > /tmp/hstu_gemc.log 2>&1
  echo "== hstu gemc (exit $?, $((SECONDS - t0)) s)"
  cp /tmp/hstu_gemc/zoo.json "$OUT/hstu_gemc.json" 2>/dev/null
  python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['hstu'][0]; \
print(v['step_ms'], [round(x, 2) for x in v['step_ms_all']], v['losses'])" "$OUT/hstu_gemc.json"
  grep -E "Error|error" /tmp/hstu_gemc.log | tail -3 | cut -c1-300
fi
echo "== done ($((SECONDS - t0)) s)"
