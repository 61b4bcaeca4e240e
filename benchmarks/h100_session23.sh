#!/usr/bin/env bash
# Twenty-third session's device calls, one part per call (each under ten minutes):
#   GEMC_COMMIT=<sha> bash benchmarks/h100_session23.sh 1   # the zoo's attentions: kernels or
#                                                           # host (attention_gpu_time.py), and
#                                                           # the figure (kernels.py zoo)
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
t0=$SECONDS
part=${1:-1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import numpy, triton, torch; print('numpy', numpy.__version__, 'triton', triton.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/gpu.txt"
if [ "$part" = 1 ]; then
  timeout 300 python3 benchmarks/attention_gpu_time.py --out "$OUT/attention_gpu_time.json" \
    > "$OUT/attention_gpu_time.log" 2>&1
  echo "== attention: kernels or host (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/attention_gpu_time.log" | cut -c1-400
  timeout 240 python3 benchmarks/kernels.py --cases zoo --no-compile \
    --out "$OUT/kernels_zoo.json" > "$OUT/kernels_zoo.log" 2>&1
  echo "== the zoo's attentions (exit $?, $((SECONDS - t0)) s)"
  grep -vE "Warning|warn" "$OUT/kernels_zoo.log" | tail -30 | cut -c1-300
fi
