#!/usr/bin/env bash
# Install kvpatch with its test extra into a virtualenv and run the whole test suite, including the
# matrix of real mlx-lm / mlx-vlm releases (layered and cached under ${KVPATCH_CACHE:-~/.cache/kvpatch}).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVPATCH_VENV:-.venv}
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps .
"$VENV/bin/python" -m pip install -q ".[test]"
exec "$VENV/bin/pytest" "$@"
