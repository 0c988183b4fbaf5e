#!/usr/bin/env bash
# Install kvpatch with its test dependency group into a virtualenv and run the whole test suite, including the
# matrix of real mlx-lm / mlx-vlm releases (layered and cached under ${KVPATCH_CACHE:-~/.cache/kvpatch}).
# Arguments go to pytest. The venv's bin is put first on PATH, so the ruff and mypy tests run (and fail
# the suite when the tree is not clean) instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVPATCH_VENV:-.venv}

step() { printf '\n== [%s] %s\n' "$1" "$2"; }
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
step 4/4 "pytest $* (matrix buckets: ${KVPATCH_MATRIX:-all}; upstream layers cached under ${KVPATCH_CACHE:-~/.cache/kvpatch})"
exec "$VENV/bin/pytest" "$@"
