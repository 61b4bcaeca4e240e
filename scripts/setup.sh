#!/usr/bin/env bash
# Sets up .venv with everything gemc needs, from the project's own files. Idempotent.
# torch is pinned to the CPU build 2.13.0 first: any other version would pull a
# multi-GB CUDA build. On a GPU machine, install gemc into an environment that already
# has a CUDA torch (>= 2.11) instead: `pip install -e .` keeps the torch it finds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
log=$(mktemp)
pip_install() {
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    echo "setup: 'pip install $*' failed (log above)" >&2
    exit 1
  fi
}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip_install --upgrade pip
pip_install torch==2.13.0
pip_install -e '.[dev]'
# FBGEMM's CPU ops (jagged_to_padded_dense, dense_to_jagged): the tests capture models that
# call them as generative-recommenders does. --no-deps: its wheel would not pull torch, but
# keep the pinned CPU build whatever it declares (it needs numpy, which gemc's deps bring).
pip_install --no-deps fbgemm-gpu-cpu==1.8.0
# Headless Chromium renders the HTML report in tests/report (Debian package `chromium`).
# Optional for everything else: a failure here is reported and setup goes on.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing chromium (apt-get) for the report test" >&2
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
              chromium fonts-dejavu-core; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "setup: could not install chromium; tests/report will fail until it is installed" >&2
  fi
fi
rm -f "$log"
.venv/bin/python -c "import gemc, torch, triton, ortools, networkx; print('gemc', gemc.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
