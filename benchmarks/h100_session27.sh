#!/usr/bin/env bash
# Twenty-seventh session's device calls (issue 17: the attention's host path), each < 10 min:
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session27.sh 1   # the changed kernels' tests on
#       # the GPU (zero-fills folded into the attention kernels, the direct launch past the
#       # Autotuner, gemc::rep_key_bias); HSTU's and TransAct's attention four ways
#       # (attention_gpu_time.py --defaults-only) and their host profiles, with the direct
#       # launch off too, and at the tree in .base (the commit before: see below); the
#       # issue's figure for every zoo attention (kernels.py --cases zoo)
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session27.sh 2   # the changed kernels' own
#       # tests on the GPU; benchmarks/transact_attention_probe.py (run from .probe/, uncommitted);
#       # the issue's figure for HSTU at .base; TransAct's step: gemc, and gemc with its
#       # attentions left to SDPA (GEMC_ATTENTION_KERNEL=never; zoo.py)
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session27.sh 3   # after the per-key bias load:
#       # its tests on the GPU, the probe, TransAct's attention four ways and as the issue's
#       # figure, TransAct's gemc step
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session27.sh 4   # TransAct's step: torch.compile,
#       # gemc, gemc with its attentions left to SDPA, on one machine; rep_key_bias's sm_90
#       # compile test there; the direct launch's and uncovered rows' tests in what is left
# .base: the code of the commit to compare against, laid out by
#   git archive <sha> gemc passes cost_model backends examples scripts pyproject.toml \
#     $(git ls-files benchmarks | grep -E '\.(py|sh)$') | tar -x -C .base
# (ignored by .git/info/exclude; name it in the device call's carry). Its gemc is imported
# from .base itself (in_base), never installed, so the two trees do not mix.
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}
root=$(pwd)

in_base() {  # run "$@" in .base with its own gemc: its gemc/ completed by links to its
  # passes/, cost_model/ and backends/ (a script puts its tree's root first on sys.path, so
  # that gemc/ is the one imported, and its subpackages must be found there, ahead of the
  # editable install's finder, which would map them to ours)
  for d in passes cost_model backends; do ln -sfn "../$d" "$root/.base/gemc/$d"; done
  (cd "$root/.base" && PYTHONPATH="$root/.base" "$@")
}

kernel_tests() {  # $1 timeout; $2 "quick": the changed kernels' own files only
  local files=(tests/kernels/test_uncovered_rows.py tests/kernels/test_direct_launch.py
               tests/kernels/test_rep_key_bias.py tests/kernels/test_silu_key_block_backward.py)
  [ "${2:-}" = quick ] || files+=(tests/kernels/test_sdpa_empty_rows.py
    tests/kernels/test_attention_bias_and_varlen_keys.py tests/kernels/test_jagged_attention.py)
  GEMC_TEST_DEVICE=cuda timeout "$1" python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    "${files[@]}" > "$OUT/tests.log" 2>&1
  echo "== the changed kernels' tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
}

zoo_attentions() {  # $1 timeout, $2 tag, $3 models, $4 "base" to run .base's
  local cmd=(timeout "$1" python3 benchmarks/kernels.py --cases zoo --no-compile
             --zoo-models "$3" --out "$OUT/kernels_zoo_$2.json")
  if [ "${4:-}" = base ]; then in_base "${cmd[@]}"; else "${cmd[@]}"; fi \
    > "/tmp/kernels_zoo_$2.log" 2>&1
  echo "== the zoo's attentions, $2 (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "/tmp/kernels_zoo_$2.log" | grep -E "fwd\+bwd|^zoo" | cut -c1-200
}

if [ "$part" = 1 ]; then
  kernel_tests 200
  timeout 150 python3 benchmarks/attention_gpu_time.py --models hstu,transact --defaults-only \
    --out "$OUT/attention_gpu_time.json" > "$OUT/attention_gpu_time.log" 2>&1
  echo "== attention four ways (exit $?, $((SECONDS - t0)) s)"
  python3 - "$OUT/attention_gpu_time.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for m, e in d["models"].items():
    for r in e["rows"]:
        print(m, r["variant"], *(f"{k} {r.get(k)}" for k in
              ("do_bench_ms", "graph_ms", "kernels_ms", "host_ms")))
EOF
  for how in new direct0 base; do
    models=hstu,transact; [ "$how" = base ] && models=hstu
    if [ "$how" = base ]; then
      in_base timeout 60 python3 benchmarks/attention_gpu_time.py --models $models \
        --profile-host "$OUT/host_profile_$how.txt" > /dev/null 2>&1
    elif [ "$how" = direct0 ]; then
      GEMC_DIRECT_LAUNCH=0 timeout 60 python3 benchmarks/attention_gpu_time.py --models hstu \
        --profile-host "$OUT/host_profile_$how.txt" > /dev/null 2>&1
    else
      timeout 60 python3 benchmarks/attention_gpu_time.py --models $models \
        --profile-host "$OUT/host_profile_$how.txt" > /dev/null 2>&1
    fi
    echo "== host profile, $how (exit $?, $((SECONDS - t0)) s)"
    grep -E "^====|^launches a call" "$OUT/host_profile_$how.txt" | cut -c1-200
  done
  left=$((560 - SECONDS + t0))
  [ "$left" -gt 60 ] && zoo_attentions "$left" new hstu,sasrec_bst,mmoe,transact
elif [ "$part" = 2 ]; then
  kernel_tests 130 quick
  { timeout 90 python3 benchmarks/transact_attention_probe.py \
    > /tmp/probe.log 2>&1; echo "== probe (exit $?, $((SECONDS - t0)) s)";
    grep -vE "Warning|warn" /tmp/probe.log | cut -c1-400 | tail -30; }
  zoo_attentions 80 base hstu base
  for v in gemc never; do
    env=(); [ "$v" = never ] && env=(GEMC_ATTENTION_KERNEL=never)
    env "${env[@]}" timeout 170 python3 benchmarks/zoo.py --out /tmp/transact_$v \
      --models transact --variants gemc --steps 10 --warmup 3 > /tmp/transact_$v.log 2>&1
    echo "== transact gemc, $v (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/transact_$v/zoo.json "$OUT/transact_$v.json" 2>/dev/null
    grep -vE "Warning|warn" /tmp/transact_$v.log | grep -E "transact|step|guard" | tail -4 \
      | cut -c1-250
  done
elif [ "$part" = 3 ]; then  # after the per-key bias load (KEY_BIAS)
  GEMC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_rep_key_bias.py tests/kernels/test_direct_launch.py \
    "tests/kernels/test_custom_ops.py::test_key_bias_values_attention_across_blocks_with_large_and_masked_entries" \
    "tests/kernels/test_custom_ops.py::test_key_bias_values_attention_op_passes_opcheck_and_is_sdpa_with_that_bias" \
    tests/kernels/test_uncovered_rows.py -k "not hopper" > "$OUT/tests.log" 2>&1
  echo "== the changed kernels' tests on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
  { timeout 60 python3 benchmarks/transact_attention_probe.py \
    > /tmp/probe.log 2>&1; echo "== probe (exit $?, $((SECONDS - t0)) s)";
    grep -vE "Warning|warn" /tmp/probe.log | cut -c1-300 | tail -12; }
  timeout 80 python3 benchmarks/attention_gpu_time.py --models transact --defaults-only \
    --out "$OUT/attention_gpu_time_transact.json" > /tmp/agt.log 2>&1
  echo "== TransAct's attention four ways (exit $?, $((SECONDS - t0)) s)"
  grep -E '^\{"variant' /tmp/agt.log | cut -c1-250
  zoo_attentions 110 transact transact
  left=$((575 - SECONDS + t0))
  timeout "$left" python3 benchmarks/zoo.py --out /tmp/transact_gemc --models transact \
    --variants gemc --steps 10 --warmup 3 > /tmp/transact_gemc.log 2>&1
  echo "== transact gemc (exit $?, $((SECONDS - t0)) s)"
  cp /tmp/transact_gemc/zoo.json "$OUT/transact_gemc.json" 2>/dev/null
  python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['transact'][0]; \
print(v['step_ms'], [round(x, 2) for x in v['step_ms_all']])" "$OUT/transact_gemc.json"
elif [ "$part" = 4 ]; then  # TransAct's step on one machine; then the kernel tests
  for v in compile gemc never; do
    variant=$v; env=(); [ "$v" = never ] && { variant=gemc; env=(GEMC_ATTENTION_KERNEL=never); }
    env "${env[@]}" timeout 150 python3 benchmarks/zoo.py --out /tmp/transact_$v \
      --models transact --variants $variant --steps 12 --warmup 3 > /tmp/transact_$v.log 2>&1
    echo "== transact $v (exit $?, $((SECONDS - t0)) s)"
    cp /tmp/transact_$v/zoo.json "$OUT/transact_$v.json" 2>/dev/null
    python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['transact'][0]; \
print(v['step_ms'], [round(x, 2) for x in v['step_ms_all']], v['losses'][-1])" \
      "$OUT/transact_$v.json"
  done
  GEMC_TEST_DEVICE=cuda timeout 40 python3 -m pytest -q -rf -p no:cacheprovider -n 0 -x \
    tests/kernels/test_rep_key_bias.py -k hopper > /tmp/hopper.log 2>&1
  echo "== rep_key_bias's sm_90 compile test on the GPU machine (exit $?)"
  grep -E "Error|error|assert|passed|failed" /tmp/hopper.log | tail -12 | cut -c1-400
  left=$((570 - SECONDS + t0))
  GEMC_TEST_DEVICE=cuda timeout "$left" python3 -m pytest -q -rf -p no:cacheprovider -n 0 \
    tests/kernels/test_direct_launch.py tests/kernels/test_uncovered_rows.py -k "not hopper" \
    > "$OUT/tests.log" 2>&1
  echo "== direct launch and uncovered rows on the GPU (exit $?, $((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -8 | cut -c1-300
fi
[ -f "$OUT/tests.log" ] && { echo "== kernel tests:"; grep -E "passed|failed" "$OUT/tests.log" | tail -2; }
echo "== done ($((SECONDS - t0)) s)"
