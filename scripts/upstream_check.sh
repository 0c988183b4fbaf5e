#!/usr/bin/env bash
# CI step "upstream check": every patch's reproduction, without the patch, on the newest mlx-lm and mlx-vlm
# on PyPI (releases younger than 48 hours are ignored), layered over a virtualenv like scripts/test.sh's.
# Fails (exit 1) when a patch record disagrees with what was measured, and says which record, which field
# and what value to set. Arguments go to `kvpatch upstream-check` (e.g. --mlx-lm 0.32.2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVPATCH_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps .
"$VENV/bin/python" -m pip install -q . --group test

echo "== upstream check: reproductions (without and with each patch) on the newest upstream releases =="
set +e
"$VENV/bin/kvpatch" upstream-check "$@"  # the console script: the checkout's kvpatch/ never shadows the install
status=$?
set -e
if [ "$status" -ne 0 ]; then
  cat >&2 <<MSG

UPSTREAM CHECK FAILED (exit $status): upstream changed under a patch, or a reproduction could not run.
For every line under "records that disagree with what was measured" above, open the kvpatch/patches/<dist>/<file>.py it
names and set the field it names (fixed_in, fixed_commit, affected, checked_through, expiry) to the value
it gives; for "target moved or gone", retarget the patch (bug still there) or retire it (bug gone). Then:
    $VENV/bin/kvpatch compat --write && bash scripts/test.sh
Re-run just this check: bash scripts/upstream_check.sh   (or: $VENV/bin/kvpatch upstream-check --mlx-lm X.Y.Z)
MSG
fi
# The short bug hunt (docs/findings.md): the invariants on the same newest releases, kvpatch off and on, each finding
# attributed. A "new" finding is printed with its reproduction for a maintainer to triage (patch it or document it);
# it never fails this run: a new release's new bug is news, not a broken kvpatch, and the patch tier already fails
# when a patch stops fixing its own bug.
echo "== short bug hunt on the newest upstream releases (kvpatch off and on; report only) =="
"$VENV/bin/python" -m kvpatch.maint.hunt --upstream --budget "${KVPATCH_HUNT_BUDGET:-60}" --report-only ||
  echo "the bug hunt could not run (see above); the upstream check's result stands" >&2
exit "$status"
