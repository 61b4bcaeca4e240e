#!/usr/bin/env bash
# Thirty-second session's device calls (issue 17), each < 10 min:
#   bash benchmarks/h100_session32.sh 1   # the row kernel (loads gathered at the top of each
#       # tile pair, delta recomputed per pair, one uncovered-rows test a program) on the
#       # GPU: its tests at every config it may pick and the uncovered-rows tests; TransAct's
#       # region at each forward and row-kernel config (attention_gpu_time.py
#       # --transact-blocks); TransAct's attention by default against padded cuDNN on the
#       # same machine (--defaults-only)
#   bash benchmarks/h100_session32.sh 2   # after the forward's pick was capped at 96
#       # registers: TransAct's attention by default against padded cuDNN first, then the
#       # GPU tests at the row kernel's 64-row pick, then every config again
set -uo pipefail
source scripts/device_record.sh
t0=$SECONDS
part=${1:-1}
budget=585  # seconds this call may take in all

source benchmarks/transact_device_steps.sh

if [ "$part" = 1 ]; then
  gpu_tests 220 tests.log "not hopper" tests/kernels/test_fused_softmax_backward.py \
    tests/kernels/test_uncovered_rows.py
  blocks 190
  defaults_vs_cudnn $((budget - SECONDS + t0 - 5))
fi
if [ "$part" = 2 ]; then  # the key figure first: the call may be cut short
  defaults_vs_cudnn 70
  gpu_tests 90 tests.log "row64 or not one_kernel" tests/kernels/test_fused_softmax_backward.py
  blocks 90
fi
