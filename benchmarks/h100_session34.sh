#!/usr/bin/env bash
# Thirty-fourth session's device call (issue 17), ~300 s: the key-major row kernel at 64-row
# blocks is the pick now where GPU-tested (the first call timed it 0.304 ms against 0.333).
#   bash benchmarks/h100_session34.sh 1   # TransAct's attention by default against padded
#       # cuDNN; then the GPU tests still owed: the key-major configs' causal and full-bias
#       # ones (the first call ran 4 of 12 before its cut), the uncovered rows' (the pick's
#       # now), the key bias kernel's, and each attention op's (its logsumexp not zero-filled)
#   CALL_S=200 bash benchmarks/h100_session34.sh 1   # the same, its tests cut sooner
set -uo pipefail
source scripts/device_record.sh
source benchmarks/transact_device_steps.sh
t0=$SECONDS
part=${1:-1}
end=$((t0 + ${CALL_S:-300}))

if [ "$part" = 1 ]; then  # the key figure first: the call may be cut short
  defaults_vs_cudnn 75
  gpu_tests $((end - SECONDS > 20 ? end - SECONDS : 20)) keys.log "keys and (full or True)" \
    tests/kernels/test_fused_softmax_backward.py
  gpu_tests $((end - SECONDS > 20 ? end - SECONDS : 20)) uncovered.log "not hopper" \
    tests/kernels/test_uncovered_rows.py tests/kernels/test_rep_key_bias.py
  gpu_tests $((end - SECONDS > 20 ? end - SECONDS : 20)) values.log "values or zero_fills" \
    tests/kernels/test_custom_ops.py
fi
