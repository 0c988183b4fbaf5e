#!/usr/bin/env bash
# Install kvpatch with its test dependency group into a virtualenv and run the whole test suite, including the
# matrix of real mlx-lm / mlx-vlm releases (layered and cached under ${KVPATCH_CACHE:-~/.cache/kvpatch}).
# Arguments go to pytest. The venv's bin is put first on PATH, so the ruff and mypy tests run (and fail
# the suite when the tree is not clean) instead of skipping.
#
#   bash scripts/test.sh            everything (what CI runs): unit tests here, every matrix bucket (the
#                                   patch tier in each, the integration tier where tests/tiers.py says)
#   bash scripts/test.sh --quick    the unit tests, and the patch tier in the newest mlx-lm and mlx-vlm
#                                   buckets; with an existing venv it only reinstalls kvpatch from this checkout
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVPATCH_VENV:-.venv}
# What runs, as tests/test_matrix.py and tests/tiers.py pick it (KVPATCH_MATRIX names buckets in both tiers).
RUNS="every tier; matrix buckets: ${KVPATCH_MATRIX:-all}"
if [ "${1:-}" = "--quick" ] || [ "${1:-}" = "quick" ]; then
  shift
  export KVPATCH_TIER=quick
  RUNS="tiers: unit, patch (matrix buckets: ${KVPATCH_MATRIX:-newest})"
  if [ -x "$VENV/bin/pytest" ]; then
    printf '== [quick] kvpatch from this checkout into %s; %s\n' "$VENV" "$RUNS"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps .
    PATH="$(cd "$VENV/bin" && pwd):$PATH"
    export PATH
    exec "$VENV/bin/pytest" -q "$@"
  fi
fi

step() { printf '\n== [%s] %s (at %d s)\n' "$1" "$2" "$SECONDS"; }
# pip's own output (what it downloads and installs), without the "Requirement already satisfied" lines
# that say nothing on a warm run.
pip_install() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check "$@" 2>&1 |
    awk '!/^Requirement already satisfied/ { print; fflush() }'
}

step 1/4 "virtualenv $VENV ($("$PY" --version 2>&1))"
"$PY" -m venv "$VENV"
step 2/4 "pip"
pip_install --upgrade pip
step 3/4 "kvpatch from this checkout, then its test dependency group (pytest, ruff, mypy, zizmor, numpy, transformers, jinja2, pillow, requests)"
pip_install --force-reinstall --no-deps .
pip_install . --group test  # PEP 735 dependency group: pip >= 25.1 (step 2 upgrades it)
PATH="$(cd "$VENV/bin" && pwd):$PATH"
export PATH
step 4/4 "pytest $* ($RUNS; upstream layers cached under ${KVPATCH_CACHE:-~/.cache/kvpatch})"
exec "$VENV/bin/pytest" "$@"
