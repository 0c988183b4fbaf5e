"""Downstream servers' own test suites, from their sdists on PyPI (cached, never committed).

``sdist_tree("vllm-mlx", "0.6.0")`` downloads the sdist once with pip (``pip download --no-deps
--no-binary :all:``) into ``<kvpatch cache>/downstream/`` and unpacks it there; ``run_tests`` runs some of
its test files in a fresh interpreter (this bucket's, with kvpatch on or ``KVPATCH=off``) and returns
each test's outcome, so that the two runs can be compared test by test.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

try:  # kvpatch.maint.envs from the maintainer-subpackage move on; kvpatch.envs before it
    from kvpatch.maint.envs import cache_dir
except ImportError:  # pragma: no cover - older layout
    from kvpatch.envs import cache_dir  # type: ignore[no-redef]

#: Test files run by default (KVPATCH_COEXIST=1): the ones aimed at the attributes both the server and
#: kvpatch patch. KVPATCH_COEXIST=full runs every test file that touches mlx-lm / mlx-vlm caches,
#: the batch generator or quantized attention (OVERLAP below).
DEFAULT_FILES = {
    "vllm-mlx": [
        "tests/test_scheduler_max_kv_size.py",
        "tests/test_specprefill_rotating_cache.py",
        "tests/test_prefix_cache_untrimmable.py",
    ],
    "rapid-mlx": [
        "tests/test_mixed_batch_logits_processor_slots.py",
        "tests/test_quantized_batch_cache.py",
        "tests/test_mlx_vlm_vendored_cache.py",
    ],
}

OVERLAP = re.compile(
    r"mlx_lm\.(models\.cache|generate|models\.base)|from mlx_lm\.models\.cache|from mlx_lm\.generate|"
    r"make_prompt_cache|BatchGenerator|_make_cache|PromptProcessingBatch|quantized_scaled_dot_product_attention|"
    r"install_batch_slot_guard|mlx_vlm\.(models\.cache|turboquant)|mlx_vlm_vendored[. ].*cache"
)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def sdist_tree(distribution: str, version: str) -> Path:
    """The unpacked sdist of ``distribution==version`` (downloaded and unpacked once, under a lock)."""
    root = cache_dir() / "downstream"
    final = root / f"{distribution}-{version}"
    if (final / ".complete").is_file():
        return final
    with _locked(root / ".locks" / f"{distribution}-{version}.lock"):
        if (final / ".complete").is_file():
            return final
        shutil.rmtree(final, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="kvpatch-sdist-", dir=root) as tmp:
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_TARGET")}
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "-d", tmp, f"{distribution}=={version}", "--cache-dir", str(cache_dir() / "pip")],
                capture_output=True, text=True, env=env,
            )  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"pip download of the {distribution} {version} sdist failed:\n{proc.stderr[-3000:]}")
            archive = next(Path(tmp).glob("*.tar.gz"))
            unpacked = Path(tmp) / "tree"
            with tarfile.open(archive) as tar:
                tar.extractall(unpacked, filter="data")
            (top,) = list(unpacked.iterdir())
            top.rename(final)
        (final / ".complete").write_text(f"{distribution}=={version}\n")
    return final


def overlapping_files(tree: Path) -> list[str]:
    out = []
    for path in sorted((tree / "tests").glob("test_*.py")):
        if OVERLAP.search(path.read_text(encoding="utf-8", errors="replace")):
            out.append(str(path.relative_to(tree)))
    return out


def pytest_command(files: list[str], xml: Path) -> list[str]:
    """pytest over a server's test files from its tree, writing a junit report to ``xml`` (every runner of a
    server's suite starts from this one command line)."""
    return [
        sys.executable, "-m", "pytest", *files, "-p", "no:cacheprovider", "-p", "no:randomly",
        "--continue-on-collection-errors", f"--junitxml={xml}", "-o", "junit_family=xunit2",
    ]  # fmt: skip


def run_tests(tree: Path, files: list[str], env: dict[str, str], timeout: int = 3000) -> dict[str, str]:
    """``{test id: passed|failed|error|skipped}`` for ``files`` run with pytest from ``tree``."""
    with tempfile.TemporaryDirectory(prefix="kvpatch-junit-") as tmp:
        xml = Path(tmp) / "junit.xml"
        subprocess.run(
            [*pytest_command(files, xml), "-q"], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
        if not xml.is_file():
            raise AssertionError(f"pytest wrote no report for {files}")
        return _outcomes(xml)


def _outcomes(xml: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                break
        out[name] = outcome
    return out


def tally(outcomes: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
