#!/usr/bin/env bash
# The eleventh session's last device call (< 4 min): the zoo attentions twice with the
# heuristic configs and once autotuned (GEMC_AUTOTUNE=1), the tuned configs recorded
# (issue 17: is HSTU's spread the config choice?).  bash benchmarks/h200_session11e.sh
source scripts/device_env.sh >/dev/null 2>&1; export PYTHONUNBUFFERED=1
for i in 1 2; do timeout 45 python3 benchmarks/kernels.py --cases zoo --no-compile --seed 17 --out $OUT/h$i.json 2>&1 | grep -E "zoo (hstu|mmoe)"; done
echo "== autotuned"
timeout 120 python3 - <<'PY' 2>&1 | grep -vE "Warning|warn" | tail -12
import os, sys, runpy, json
os.environ['GEMC_AUTOTUNE'] = '1'; os.environ['TRITON_CACHE_DIR'] = '/tmp/tc_a'
sys.argv = ['kernels.py', '--cases', 'zoo', '--no-compile', '--seed', '17', '--out', os.environ['OUT'] + '/auto.json']
sys.path.insert(0, 'benchmarks')
try:
    runpy.run_path('benchmarks/kernels.py', run_name='__main__')
except SystemExit:
    pass
from gemc.backends.triton import config_choice as c
c.record_tuned()
rec = json.load(open('/tmp/tc_a/gemc-tuned-configs.json'))
json.dump(rec, open(os.environ['OUT'] + '/tuned.json', 'w'), indent=1)
for name, r in rec.items():
    if 'jagged' in name:
        for k, v in r.get('configs', {}).items():
            print(name, k[:60], v)
PY
