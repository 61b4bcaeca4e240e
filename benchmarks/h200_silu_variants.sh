#!/usr/bin/env bash
# One device call (< 5 min on one H200): HSTU's silu attention at the zoo h200 shape (B=128,
# L=512, 4 heads of 128, causal, ~50% fill, bf16), the kernel's speed variants (fast sigmoid,
# one-kernel backward with atomic dq, heuristic or autotuned configs, with and without the
# relative bias), each checked against the padded formula in fp32, against padded masked
# SDPA (issue 17's target: fwd+bwd >= 2x the fastest masked SDPA; 1.95x at e05fd50).
#   bash benchmarks/h200_silu_variants.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 420 python3 benchmarks/kernels.py --cases silu_variants --seed 17 \
  --out "$OUT/silu_variants.json" 2>&1 | grep -vE "Warning|warnings.warn" | tail -40
