"""Regenerate every file derived from the patch units, in order, with one command (run from the clone's root):

    python -m kvpatch.maint.regenerate [--only ID,ID] [--offline] [--no-fingerprints] [--no-example] [--no-git]
    python -m kvpatch.maint.regenerate --check [...]    # exit 1 naming each stale file; write nothing

1. ``kvpatch/data/units.json``, the unit index (:mod:`kvpatch.maint.units`);
2. ``kvpatch/data/fingerprints.json``, the targets' source fingerprints on every release of each patch's
   affected range (``scripts/record_fingerprints.py``: it lists those releases on the package index, says which
   release layers are not cached and roughly how much they weigh, then downloads and installs them under
   ``~/.cache/kvpatch/layers``; ``--only`` measures just those patches and keeps the others' entries,
   ``--offline`` asks no index and measures only the releases whose layers are cached, naming the rest;
   ``--no-fingerprints`` leaves the file). ``--check`` measures too, so it downloads the same layers unless
   ``--offline``;
3. ``COMPAT.md``, the compatibility table (:mod:`kvpatch.maint.compat`);
4. the ``kvpatch status --verify`` example in ``docs/status.md``: that command's output in the newest mlx-vlm
   matrix bucket (which holds the newest mlx-lm too), with a throwaway verdict cache. Only a whole regeneration
   (no ``--only``, no ``--check``, no ``--no-example``) refreshes it: it is a snapshot of what the command printed,
   which a new patch's stubs would only spoil (tests/engine/test_compat_doc.py checks that it names no patch the
   catalogue lacks).

A unit that does not load, or a record the maintainer checks refuse (:func:`kvpatch.maint.new.record_problems`),
stops it before anything is written, with one line per problem naming the file and the field.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kvpatch import registry

from . import compat, envs, units
from .expiry import patch_file
from .matrix import VLM_BUCKETS
from .new import record_problems

#: The clone's root (this module is ``kvpatch/maint/regenerate.py`` in it).
REPO = Path(__file__).resolve().parents[2]
COMPAT = REPO / "COMPAT.md"
FINGERPRINTS_SCRIPT = REPO / "scripts" / "record_fingerprints.py"
STATUS_DOC = REPO / "docs" / "status.md"
#: Where docs/status.md's example is measured: the newest mlx-vlm bucket, which has the newest mlx-lm as well.
EXAMPLE_BUCKET = VLM_BUCKETS[-1]
#: The example's opening sentence and its fenced output, as docs/status.md holds them.
EXAMPLE = re.compile(r"^With [^\n]*`kvpatch status --verify` printed:\n\n```text\n.*?\n```\n", re.S | re.M)


def _file(path: Path, text: str, check: bool) -> bool:
    """Write ``text`` to ``path`` (or, with ``check``, compare); True when the file was already ``text``."""
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    if current == text:
        return True
    if not check:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return False


def fingerprints_command(only: str, *, check: bool, git: bool, offline: bool = False) -> list[str]:
    command = [sys.executable, str(FINGERPRINTS_SCRIPT)]
    if only:
        command += ["--only", only]
    if not git:
        command.append("--no-git")
    if offline:
        command.append("--offline")
    if check:
        command.append("--check")
    return command


def problems() -> list[str]:
    """Why the derived files cannot be generated now: units that do not load (as ``kvpatch list`` says it), and
    records the maintainer checks refuse. Empty when they can."""
    reg = registry.load()
    out = [f"kvpatch: patch module {module} cannot be loaded: {error}" for module, error in reg.broken.items()]
    out += [f"{patch_file(p)}: {problem}" for p in reg.patches for problem in record_problems(p)]
    return out


def example_text(output: str, bucket: envs.Bucket = EXAMPLE_BUCKET) -> str:
    """docs/status.md's example: the sentence that says where it was measured, and ``output`` fenced."""
    system = {"Darwin": "macOS"}.get(platform.system(), platform.system())
    device = "Metal" if system == "macOS" else "CPU"
    where = f"mlx {bucket.version('mlx')}, mlx-lm {bucket.version('mlx-lm')} and mlx-vlm {bucket.version('mlx-vlm')}"
    return (
        f"With {where} on {system} ({device}), `kvpatch status --verify` printed:\n\n```text\n{output.rstrip()}\n```\n"
    )


def status_example(*, offline: bool) -> str | None:
    """``kvpatch status --verify`` (this checkout's kvpatch) in :data:`EXAMPLE_BUCKET`, with a throwaway state and
    verdict cache; None, saying why, when it cannot run."""
    missing, size, _ = envs.missing_layers(EXAMPLE_BUCKET.requirements)
    if missing and offline:
        print(f"docs/status.md: example left as it is: {', '.join(missing)} not cached (--offline)", file=sys.stderr)
        return None
    if missing:
        print(f"docs/status.md: downloading {', '.join(missing)} (about {size / 1e6:.0f} MB)", file=sys.stderr)
    print(f"docs/status.md: running `kvpatch status --verify` in {EXAMPLE_BUCKET.name}", file=sys.stderr, flush=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPATCH") and k != "PYTHONPATH"}
    env = envs.bucket_environ(EXAMPLE_BUCKET, base=base)
    env["PYTHONPATH"] += os.pathsep + str(REPO)  # this checkout's kvpatch, behind the layers
    with tempfile.TemporaryDirectory(prefix="kvpatch-example-") as state:
        env.update(KVPATCH_CACHE=state, KVPATCH_VERDICTS=str(Path(state) / "verdicts"), KVPATCH_VERIFY="never")
        env["HF_HUB_OFFLINE"] = "1"
        command = [sys.executable, "-m", "kvpatch", "status", "--verify"]
        proc = subprocess.run(command, cwd=state, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode not in (0, 1, 2) or not proc.stdout.strip():  # 1, 2: what it found, shown as it is
        tail = envs._tail(proc.stderr or proc.stdout, 8)
        print(f"docs/status.md: example left as it is: status exited {proc.returncode}:\n{tail}", file=sys.stderr)
        return None
    return proc.stdout


def with_example(doc: str, output: str) -> str:
    """``doc`` (docs/status.md's text) with its example replaced by ``output``."""
    if not EXAMPLE.search(doc):
        raise ValueError("docs/status.md has no example to replace (a 'With ... printed:' line and a text block)")
    return EXAMPLE.sub(lambda _: example_text(output), doc, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpatch.maint.regenerate",
        description=__doc__.split("\n\n")[0],
        epilog="Downloads: fingerprints.json and the status example need release layers; "
        "each step says which ones are not cached before it downloads them (--offline: none).",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 naming each stale file; write nothing (downloads as writing does)"
    )
    parser.add_argument("--only", default="", help="comma-separated patch ids whose fingerprints are measured")
    parser.add_argument(
        "--offline", action="store_true", help="ask no package index, download nothing: use the cached layers only"
    )
    parser.add_argument("--no-fingerprints", action="store_true", help="leave fingerprints.json")
    parser.add_argument(
        "--no-example", action="store_true", help="leave the status example in docs/status.md (--only leaves it too)"
    )
    parser.add_argument("--no-git", action="store_true", help="fingerprint releases only, no git commits")
    args = parser.parse_args(argv)
    found = problems()
    if found:
        print("\n".join(found), file=sys.stderr)
        print("nothing regenerated: fix what each line names, then run this again", file=sys.stderr)
        return 2
    stale: list[str] = []
    index = registry.INDEX
    if not _file(index, units.render(units.expected()), args.check):
        stale.append(str(index))
    if not args.no_fingerprints:
        if not FINGERPRINTS_SCRIPT.is_file():
            print(f"{FINGERPRINTS_SCRIPT} is missing: run this from a clone of kvpatch", file=sys.stderr)
            return 2
        command = fingerprints_command(args.only, check=args.check, git=not args.no_git, offline=args.offline)
        if subprocess.run(command, cwd=REPO, check=False).returncode != 0:
            if not args.check:
                return 1  # the script said why (a release it could not measure)
            stale.append("kvpatch/data/fingerprints.json")
    if not _file(COMPAT, compat.render(), args.check):
        stale.append(str(COMPAT))
    if not (args.check or args.no_example or args.only) and STATUS_DOC.is_file():
        output = status_example(offline=args.offline)
        if output is not None:
            _file(STATUS_DOC, with_example(STATUS_DOC.read_text(encoding="utf-8"), output), check=False)
    if args.check and stale:
        again = " ".join(["python -m kvpatch.maint.regenerate", *(["--only", args.only] if args.only else [])])
        print(f"stale: {', '.join(stale)}: run `{again}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
