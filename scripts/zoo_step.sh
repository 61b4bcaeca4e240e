#!/usr/bin/env bash
# Source this in a device call's script, after device_record.sh and after setting t0:
# step MODEL VARIANT TIMEOUT STEPS WARMUP runs one zoo.py step figure in its own process and
# leaves under $OUT the results (MODEL_VARIANT.json) and the log's last 20 KB (a call
# brings back a few files of bounded size), then prints the step, every step's time, the
# last loss and any error, and the log's errors, fallbacks and CUDA-graph lines.
step() {
  timeout "$3" python3 benchmarks/zoo.py --out "/tmp/$1_$2" --models "$1" --variants "$2" \
    --steps "$4" --warmup "$5" > "/tmp/$1_$2.log" 2>&1
  echo "== $1 $2 (exit $?, $((SECONDS - t0)) s)"
  cp "/tmp/$1_$2/zoo.json" "$OUT/$1_$2.json" 2>/dev/null
  tail -c 20000 "/tmp/$1_$2.log" > "$OUT/$1_$2.log.tail" 2>/dev/null
  python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants'][sys.argv[2]][0]; \
print(v.get('step_ms'), [round(x, 2) for x in v.get('step_ms_all', [])], \
(v.get('losses') or [None])[-1], str(v.get('error', ''))[:300])" "$OUT/$1_$2.json" "$1"
  grep -E "Error|error|Warning: .*fell back|cudagraph" "/tmp/$1_$2.log" | sort | uniq -c \
    | sort -rn | head -6 | cut -c1-300
}
