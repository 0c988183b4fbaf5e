"""Run a command inside one matrix bucket: its upstream releases layered over this interpreter.

    .venv/bin/python scripts/in_bucket.py lm-0.32.2 -- python -m pytest tests/upstream/test_offset_detach.py -q
    KVPATCH_DISABLE=offset-detach .venv/bin/python scripts/in_bucket.py lm-0.32.2 -- python -m pytest ...

``python`` as the command's first word means this interpreter (the one with kvpatch and the test
extra). The layers are built on first use and cached (``kvpatch.maint.envs``). Exit status: the command's.
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvpatch.maint.envs import bucket_environ
from kvpatch.maint.matrix import BUCKETS, COEXIST_BUCKETS


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        names = ", ".join(b.name for b in BUCKETS + COEXIST_BUCKETS)
        print(f"usage: in_bucket.py BUCKET -- COMMAND [ARGS...]\nbuckets: {names}", file=sys.stderr)
        return 2
    by_name = {b.name: b for b in BUCKETS + COEXIST_BUCKETS}
    if argv[0] not in by_name:
        print(f"unknown bucket {argv[0]!r}; known: {', '.join(by_name)}", file=sys.stderr)
        return 2
    command = argv[2:]
    if command[0] == "python":
        command[0] = sys.executable
    return subprocess.run(command, env=bucket_environ(by_name[argv[0]], base=dict(os.environ))).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
