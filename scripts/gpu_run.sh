#!/usr/bin/env bash
# On the GPU host (../shared/gpu/README.md), after `bash .gpu/w/install.sh`: what kvpatch's CUDA issue checks, in
# one call, with results under $OUT (or ./gpu-out). Usage: bash scripts/gpu_run.sh [suite-seconds]
#   1. nvidia-cuda-crt, if its wheel was put in .gpu/w/extra (mlx compiles Hopper kernels at run time and
#      needs its headers; pip download --no-deps --only-binary=:all: --python-version 3.12
#      --platform manylinux_2_17_x86_64 nvidia-cuda-crt==<the host's NVRTC version>);
#   2. python -m kvpatch status --verify --check, from a neutral directory;
#   3. the whole suite, interrupted with SIGINT at the time limit so pytest still prints its summary.
set -u
PY=${PY:-/opt/torch/.venv/bin/python}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export USE_TORCH=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".gpu/w/extra/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-deps --no-index .gpu/w/extra/*.whl 2>&1 | grep -v WARNING
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
repo=$PWD
(cd /tmp && timeout -s INT 200 "$PY" -P -m kvpatch status --verify --check > "$OUT/status.txt" 2>&1
 echo "status rc $?" >> "$OUT/status.txt")
tail -4 "$OUT/status.txt"
timeout -s INT "${1:-420}" "$PY" -P -m pytest "$repo/tests" -n 14 --dist loadfile -q --tb=short -rfEs \
  -p no:cacheprovider > "$OUT/suite.txt" 2>&1
echo "suite rc $?"
grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/suite.txt" | tail -40
