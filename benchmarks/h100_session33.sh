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

source benchmarks/transact_device_steps.sh

s33_tests() {  # the row kernel's ($2: pytest -k), uncovered rows' and key bias's, $1 s
  gpu_tests "$1" tests.log "$2" tests/kernels/test_fused_softmax_backward.py \
    tests/kernels/test_uncovered_rows.py tests/kernels/test_rep_key_bias.py
}

if [ "$part" = 1 ]; then  # the key figure first: the call may be cut short
  defaults_vs_cudnn 80
  blocks 170
  s33_tests $((budget - SECONDS + t0 - 5)) "(keys or row64 or not one_kernel) and not hopper"
fi
if [ "$part" = 2 ]; then
  defaults_vs_cudnn 75
  blocks 110
  s33_tests $((${CALL_S:-330} - SECONDS + t0)) "(keys or not one_kernel) and not hopper"
fi
if [ "$part" = 3 ]; then
  defaults_vs_cudnn 75
  blocks 110
fi
