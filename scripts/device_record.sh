#!/usr/bin/env bash
# Source this first in a device call's script: makes gemc importable (device_env.sh) and
# records the machine and software under $OUT/gpu.txt (GPU, numpy / triton / torch, CPU),
# so every raw result that comes back names what it ran on.
# Usage: source scripts/device_record.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import numpy, triton, torch; print('numpy', numpy.__version__, 'triton', triton.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/gpu.txt"
