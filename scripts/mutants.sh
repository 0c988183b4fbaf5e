#!/usr/bin/env bash
# Three mutants of fix code (issue 9: "the suite still catches every fix removed"). Each mutant changes one line
# of a fix in a scratch clone of HEAD, installs that clone into a scratch venv (the requirements of .venv, which
# `bash scripts/test.sh` makes), and runs the patch's tests in an affected matrix bucket: each must FAIL, and the
# same selections must pass unmutated. Usage: bash scripts/mutants.sh   (about 2 minutes; nothing here changes)
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone -q "$repo" "$tmp/src"
"$repo/.venv/bin/python" -m venv "$tmp/venv"
"$repo/.venv/bin/pip" freeze --exclude kvpatch > "$tmp/req.txt"
"$tmp/venv/bin/pip" install -q -r "$tmp/req.txt" >/dev/null 2>&1
cd "$tmp/src"
run() {  # name bucket file-to-mutate python-replacement tests...
  local name=$1 bucket=$2 file=$3 old=$4 new=$5; shift 5
  git checkout -q -- "$file"
  python3 - "$file" "$old" "$new" <<'PY'
import sys
p, old, new = sys.argv[1:4]
s = open(p).read()
assert s.count(old) == 1, (p, old)
open(p, "w").write(s.replace(old, new))
PY
  echo "=== mutant $name ($bucket): $file"
  git diff --unified=0 -- "$file" | grep '^[-+] ' 
  "$tmp/venv/bin/"pip install -q --no-deps --force-reinstall . >/dev/null 2>&1
  "$tmp/venv/bin/"python scripts/in_bucket.py "$bucket" -- python -m pytest -q -p no:cacheprovider "$@" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | cut -c1-200
  git checkout -q -- "$file"
}
run offset-detach-no-tie lm-0.32.2 kvpatch/patches/_lazy.py "keys = state[\"keys\"] = join(keys, self.offset)" "pass" \
  tests/upstream/test_offset_detach.py tests/upstream/test_regressions.py -k "offset_detach or offset-detach"
run trim-no-floor lm-0.32.2 kvpatch/patches/mlx_lm/batch_trim_capped.py "            self.offset = mx.maximum(self.offset, 0)
" "" tests/upstream/test_batch_trim_capped.py tests/upstream/test_regressions.py -k "trim"
run mask-fill-inverted lm-0.22.0 kvpatch/patches/mlx_lm/mask_fill.py "mx.where(mask, mx.array(0, queries.dtype), mx.array(mx.finfo(queries.dtype).min, queries.dtype))" "mx.where(mask, mx.array(mx.finfo(queries.dtype).min, queries.dtype), mx.array(0, queries.dtype))" \
  tests/upstream/test_regressions.py tests/upstream/test_e2e_lm.py -k "mask"
"$tmp/venv/bin/"pip install -q --no-deps --force-reinstall . >/dev/null 2>&1
echo "=== unmutated, same selections"
"$tmp/venv/bin/"python scripts/in_bucket.py lm-0.32.2 -- python -m pytest -q -p no:cacheprovider tests/upstream/test_offset_detach.py tests/upstream/test_batch_trim_capped.py tests/upstream/test_regressions.py -k "offset_detach or offset-detach or trim" 2>&1 | tail -1
"$tmp/venv/bin/"python scripts/in_bucket.py lm-0.22.0 -- python -m pytest -q -p no:cacheprovider tests/upstream/test_regressions.py tests/upstream/test_e2e_lm.py -k mask 2>&1 | tail -1
