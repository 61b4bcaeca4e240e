#!/usr/bin/env bash
# The ninth session's first device call (< 9.5 min on one H200): gemc on every zoo model and
# both examples at one commit, cold caches (each variant's first step as on a fresh machine),
# 30 timed steps, each first step split into phases (batch, forward, backward, optimizers,
# loss read; each into torch's compile, gemc's Triton compiles and running). torch.compile's
# baselines are the sixth and seventh sessions' (same machine type, torch 2.11).
# Everything lands under $OUT: logs, zoo.json per half, one tar of the rows and plans.
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }

run_half() {  # $1 name, $2 models, $3 timeout s
  timeout "$3" python3 benchmarks/zoo.py --out "$OUT/$1" --models "$2" --variants gemc \
    --steps 30 --warmup 3 --cold --time-limit $(( $3 - 90 )) --child-timeout 150 \
    > "$OUT/$1.log" 2>&1
  echo "== $1: $2 (exit $?)"
  quiet < "$OUT/$1.log" | grep -E "first step|gemc  |variant|^== " | cut -c1-400
}
run_half a sasrec_bst,mmoe,wukong,dlrm_dcnv2 270
run_half b gem,dlrm,hstu,din 290
cd "$OUT" && tar czf rows.tar.gz a b 2>/dev/null && rm -rf a b
