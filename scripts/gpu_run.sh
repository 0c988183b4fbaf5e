#!/usr/bin/env bash
# kvpatch's runs on a GPU host (CONTRIBUTING.md, "GPU runs"; the host and its install: ../shared/gpu/README.md), each
# fitting one 10-minute call, results under $OUT (or ./gpu-out):
#
#   bash scripts/gpu_run.sh status       the device; `kvpatch status --verify --check --json` from a neutral directory
#                                        (its exit status and check in status.txt); scripts/margins.py on the CPU and the device
#   bash scripts/gpu_run.sh suite K/N    part K of N of the whole test suite (scripts/gpu_suite.py splits it by file,
#                                        balanced by the last run's times): junit XML and pytest's output
#   bash scripts/gpu_run.sh summary DIR...   the parts merged: counts, failures, skip reasons grouped (no GPU needed)
#
# PY (default /opt/torch/.venv/bin/python) runs everything; WORKERS (14) pytest-xdist workers (0: none) and DIST their
# distribution (loadfile: a file's tests in one worker; load: test by test, when one file would outlast the rest); LIMIT (540) seconds
# after which a part is interrupted (SIGINT: pytest still writes its summary and XML). A wheel of nvidia-cuda-crt in
# .gpu/w/extra is installed first: mlx compiles Hopper kernels at run time and needs its headers (pip download
# --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 nvidia-cuda-crt==<the host's
# NVRTC version>).
set -u
PY=${PY:-/opt/torch/.venv/bin/python}
OUT=${OUT:-$PWD/gpu-out}
WORKERS=${WORKERS:-14}
DIST=${DIST:-loadfile}
LIMIT=${LIMIT:-540}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export USE_TORCH=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$OUT"

prepare() {
  if compgen -G "$repo/.gpu/w/extra/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-deps --no-index "$repo"/.gpu/w/extra/*.whl 2>&1 | grep -v WARNING
  fi
}

case "${1:-}" in
status)
  prepare
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    "$PY" -c "import importlib.metadata as m, mlx.core as mx; print('mlx', mx.__version__, mx.default_device()); \
print(', '.join(f'{d} {m.version(d)}' for d in ('mlx-lm', 'mlx-vlm', 'kvpatch')))"
  } 2>&1 | tee "$OUT/device.txt"
  # a neutral directory: the installed kvpatch, not this checkout's
  # one measurement gives both the exit status and the verdicts (device time is short); the margins are margins.py's
  (cd /tmp && timeout -s INT 200 "$PY" -P -m kvpatch status --verify --check --json > "$OUT/status.json" \
     2> "$OUT/status.err"
   echo "status --verify --check: exit $?" > "$OUT/status.txt")
  "$PY" -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1])).get('check'), indent=1))" \
    "$OUT/status.json" >> "$OUT/status.txt" 2>&1
  timeout -s INT 150 "$PY" -P "$repo/scripts/margins.py" --device default --json "$OUT/margins.json" \
    > "$OUT/margins.txt" 2>&1
  cat "$OUT/status.txt" "$OUT/margins.txt"
  ;;
suite)
  part=${2:?usage: gpu_run.sh suite K/N}
  prepare
  # tests/upstream runs directly against the host's releases (mlx-lm and mlx-vlm installed together, as in the
  # vlm-0.7.10 bucket); the runners that start matrix and coexistence buckets have no package index to layer from
  export KVPATCH_MATRIX=none KVPATCH_COEXIST=0
  name="suite-${part%/*}-of-${part#*/}"
  mapfile -t files < <("$PY" "$repo/scripts/gpu_suite.py" files "$part")
  echo "part $part: ${#files[@]} test files, $WORKERS workers, ${LIMIT} s limit"
  start=$SECONDS
  xdist=(-n "$WORKERS" --dist "$DIST")
  [ "$WORKERS" = 0 ] && xdist=()  # no pytest-xdist: one process
  (cd "$repo" && timeout -s INT "$LIMIT" "$PY" -P -m pytest "${files[@]}" "${xdist[@]}" -q \
    --tb=short -rfE -p no:cacheprovider --junitxml="$OUT/$name.xml" > "$OUT/$name.txt" 2>&1)
  rc=$?
  echo "part $part: pytest exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name.txt"
  grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/$name.txt" | tail -40
  "$PY" "$repo/scripts/gpu_suite.py" summary "$OUT" | head -60
  ;;
summary)
  shift
  "${PY_HERE:-python3}" "$repo/scripts/gpu_suite.py" summary "$@"
  ;;
*)
  sed -n '2,17p' "$0"
  exit 2
  ;;
esac
