#!/usr/bin/env bash
# Where a cold first step's seconds go, by Python stack (issue 16): gemc on the models whose
# first step is over 1.5x torch.compile's, each child process sampled by py-spy (100 Hz,
# idle included, non-blocking), cold caches, 2 steps. py-spy travels as a wheel in .whl
# (carry it; `pip download py-spy --no-deps -d .whl`). VARIANTS=compile,gemc samples the
# baseline too. Then benchmarks/first_step_profile.py summarises each raw file, naming the
# kernels Inductor's runtime autotuning tuned from the children's kept output modules.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/py_spy-*.whl && export PATH=/tmp/site/bin:$PATH || exit 1
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
timeout 280 python3 benchmarks/zoo.py --out "$OUT/p" --models "${MODELS:-dlrm,mmoe,gem}" \
  --variants "${VARIANTS:-gemc}" --steps 2 --warmup 0 --cold --child-timeout 150 \
  --keep-output-code "$OUT/code" \
  --child-prefix "py-spy record --idle --nonblocking -r 100 --format raw -o $OUT/p/{name}.{variant}.pyspy.txt --" \
  > "$OUT/p.log" 2>&1
echo "== exit $?"; grep -E "first step|Error|error" "$OUT/p.log" | cut -c1-600
for f in "$OUT"/p/*.pyspy.txt; do
  v=$(basename "$f" .pyspy.txt)
  python3 benchmarks/first_step_profile.py --step --code "$OUT/code/$v" "$f" | head -70
done
cd "$OUT" && tar czf pyspy.tar.gz p/*.pyspy.txt p/*.gemc.json code 2>/dev/null; rm -rf p code
