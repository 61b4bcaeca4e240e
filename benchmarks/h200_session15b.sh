#!/usr/bin/env bash
# The fifteenth session's last H200 call (< 6.5 minutes):
#   1. MMoE and DLRM cold, torch.compile / gemc (Inductor's pointwise autotuning off, the
#      new default) / gemc-pwtune (on, as before): first step and step time side by side;
#   2. HSTU's silu attention variants (the one-kernel backward's error since 967719c).
#   GEMC_COMMIT=<this checkout's sha, typed: git on the GPU machine's copy answers a stale one> bash benchmarks/h200_session15b.sh
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 290 python3 benchmarks/zoo.py --out "$OUT/pw" --models mmoe,dlrm \
  --variants compile,gemc,gemc-pwtune --steps 20 --warmup 3 --cold --time-limit 230 \
  --child-timeout 90 > "$OUT/pw.log" 2>&1
echo "== 1. mmoe, dlrm (exit $?, $((SECONDS - t0)) s)"
grep -vE "Warning|warn" "$OUT/pw.log" | grep -E "^== |^ +(variant|compile|gemc|gemc-pwtune) |first step [0-9]|skipped|rror" | cut -c1-330
python3 - "$OUT/pw/zoo.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for m, rows in d["variants"].items():
    for r in rows:
        fs = (r.get("runner_report") or {}).get("first_step") or {}
        t = (fs.get("torch_timers") or {}).get("CachingAutotuner.benchmark_all_configs") or {}
        ge = (r.get("runner_report") or {}).get("graph_executor") or {}
        print(m, r["variant"], "first", r.get("first_step_s"), "step", r.get("step_ms"),
              "autotune", t, "options", ge.get("inductor_options"))
PY
timeout 95 python3 benchmarks/kernels.py --cases silu_variants --no-compile \
  --out "$OUT/silu_variants.json" > "$OUT/silu.log" 2>&1
echo "== 2. silu variants (exit $?, $((SECONDS - t0)) s)"; grep -E "silu variant|rror" "$OUT/silu.log" | cut -c1-300
cd "$OUT" && tar czf pw.tar.gz pw && rm -rf pw
