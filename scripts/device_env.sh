#!/usr/bin/env bash
# Source this on a GPU machine that has a CUDA torch but no network (the H200 we measure
# on): makes gemc importable from this checkout without pip reaching an index.
# Usage: source scripts/device_env.sh
_gemc_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e "$_gemc_root" >/tmp/gemc-pip.log 2>&1; then
  # No setuptools able to build an editable install: lay the gemc namespace out by links.
  _shim=/tmp/gemc-shim
  rm -rf "$_shim" && mkdir -p "$_shim/gemc"
  for f in "$_gemc_root"/gemc/*; do ln -s "$f" "$_shim/gemc/"; done
  ln -s "$_gemc_root/passes" "$_shim/gemc/passes"
  ln -s "$_gemc_root/cost_model" "$_shim/gemc/cost_model"
  ln -s "$_gemc_root/backends" "$_shim/gemc/backends"
  export PYTHONPATH="$_shim:$_gemc_root${PYTHONPATH:+:$PYTHONPATH}"
  echo "device_env: editable install failed (see /tmp/gemc-pip.log); using links in $_shim" >&2
fi
export PYTHONPATH="$_gemc_root${PYTHONPATH:+:$PYTHONPATH}"  # examples/ and benchmarks/
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import gemc, torch; print('gemc', gemc.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
