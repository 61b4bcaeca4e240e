#!/usr/bin/env bash
# The ninth session's third device call (< 7 min on one H200): gemc, cold, 30 steps, on the
# models whose compiled graph lost its eager islands (the batched lookup traced into the
# graph; key-padding cross-attentions decided ahead of it): GEM, DLRM, MMoE, Wukong,
# DLRM-DCNv2. Step time, the first step by phase, loss curves; Dynamo's graph breaks are
# counted by the runner's compile accounting (the rows' first_step section).
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
quiet() { grep -vE "Warning|warnings.warn|^ *$|^zoo: .* in a child process"; }
timeout 400 python3 benchmarks/zoo.py --out "$OUT/c" --models "${MODELS:-gem,dlrm,mmoe,wukong,dlrm_dcnv2}" \
  --variants gemc --steps 30 --warmup 3 --cold --time-limit 330 --child-timeout 150 \
  > "$OUT/c.log" 2>&1
echo "== exit $?"
quiet < "$OUT/c.log" | grep -E "first step|gemc  |variant|^== |rror" | cut -c1-420
cd "$OUT" && tar czf rows.tar.gz c 2>/dev/null && rm -rf c
