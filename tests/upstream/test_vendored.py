"""kvpatch.vendored against the installed upstream (every bucket): fingerprints read from source files
agree with ``kvpatch.fingerprints.fingerprint``, and a vendored copy of upstream's cache module (made here, in a
temporary directory, from the installed wheel's file; never committed) is found by the scan and patched
with ``KVPATCH_VENDORED``. Rapid-MLX's real copy is tested in tests/coexist."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

CHILD_FINGERPRINTS = """
import importlib, json, sys
import kvpatch
from kvpatch import vendored
from kvpatch.fingerprints import fingerprint
from kvpatch.locate import module_file
from kvpatch.record import Kind
out = {}
for patch in kvpatch.get_engine().materialise():
    for t in patch.targets:
        if t.kind is not Kind.REPLACE:
            continue
        try:
            obj = importlib.import_module(t.module)
            for part in t.qualname.split("."):
                obj = vars(obj)[part] if part in vars(obj) else getattr(obj, part)
        except Exception:
            continue
        obj = getattr(obj, "__func__", obj)
        if getattr(obj, "__module__", "") != t.module or getattr(obj, "__qualname__", "") != t.qualname:
            continue  # inherited (a mixin's method) or re-exported: not defined under this name in the file
        found = vendored._definitions(vendored._read(module_file(t.module)), frozenset([t.attribute]))
        out[t.path] = [fingerprint(obj), found.get(t.qualname, [None])[0]]
print(json.dumps(out))
"""


def test_source_fingerprints_match_engine_fingerprint(run_py):
    if importlib.util.find_spec("mlx_lm") is None and importlib.util.find_spec("mlx_vlm") is None:
        pytest.skip("no upstream here")
    pairs = json.loads(run_py(CHILD_FINGERPRINTS, env={"KVPATCH": "off"}).strip().splitlines()[-1])
    assert pairs, "no target resolved"
    differ = {path: fp for path, fp in pairs.items() if fp[0] != fp[1]}
    assert not differ, differ


CHILD_COPY = """
import importlib, io, json, sys
import mlx.core as mx
import {package}.models.cache  # kvpatch activates (the copy imports upstream modules itself)
import kvpatch
from kvpatch import vendored
copy = importlib.import_module("kvpatch_test_vendor.cache")
if {apply}:
    vendored.apply()
found = {{f"{{c.patch_id}} {{c.qualname}}": c.state for c in vendored.scan(kvpatch.get_engine(), modules=["kvpatch_test_vendor.cache"])}}
edges = None
cls = getattr(copy, "BatchKVCache", None)
if cls is not None:
    def count(a):
        buf = io.StringIO(); mx.export_to_dot(buf, a); return buf.getvalue().count("->")
    cache = cls([2, 0])
    x = mx.random.normal((2, 2, 3, 16), key=mx.random.key(0))
    mx.eval(cache.update_and_fetch(x, x + 1))
    edges = []
    for i in range(30):
        s = mx.random.normal((2, 2, 1, 16), key=mx.random.key(i + 1))
        mx.eval(cache.update_and_fetch(s, s + 1))
        if i + 1 in (5, 30):
            edges.append(count(cache.offset))
print(json.dumps({{"found": found, "edges": edges}}))
"""


def _make_copy(tmp_path, package: str) -> None:
    """kvpatch_test_vendor/cache.py: the installed <package>/models/cache.py, relative imports made absolute."""
    spec = importlib.util.find_spec(package)
    source = (spec.submodule_search_locations[0] + "/models/cache.py") if spec else None
    text = open(source, encoding="utf-8").read()
    text = re.sub(r"^from \.\.(\w*)", lambda m: f"from {package}.{m.group(1)}".rstrip("."), text, flags=re.M)
    text = re.sub(r"^from \.(\w+)", lambda m: f"from {package}.models.{m.group(1)}", text, flags=re.M)
    pkg = tmp_path / "vendor" / "kvpatch_test_vendor"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cache.py").write_text(text)


#: Releases the copy test runs on (the two ends of each line's offset-detach range): enough to pin the
#: behaviour without a child process per bucket for all 29 buckets.
COPY_RELEASES = {"mlx_lm": ("0.28.0", "0.32.2"), "mlx_vlm": ("0.6.4", "0.7.10")}


@pytest.mark.parametrize("package", ["mlx_lm", "mlx_vlm"])
def test_vendored_copy_found_and_patched_on_request(run_py, tmp_path, package):
    import importlib.metadata
    import os

    import kvpatch
    from kvpatch.gate import Action
    from kvpatch.testing import natural_decision

    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed here")
    if importlib.metadata.version(package.replace("_", "-")) not in COPY_RELEASES[package]:
        pytest.skip(f"the copy test runs on {package} {', '.join(COPY_RELEASES[package])}")
    from kvpatch.locate import module_file
    from kvpatch.vendored import _definitions, _read

    engine = kvpatch.get_engine()
    module = f"{package}.models.cache"
    names = frozenset(t.attribute for patch in engine.materialise() for t in patch.targets if t.module == module)
    defined = _definitions(_read(module_file(module)), names)  # as the scan reads upstream's file
    expected = set()
    for patch in engine.patches:
        if natural_decision(patch).action is not Action.APPLY or patch.opt_in:
            continue
        for t in patch.targets:
            if t.module == module and t.kind.value == "replace" and t.qualname in defined:
                expected.add(f"{patch.id} {t.qualname}")
    if not expected:
        pytest.skip(f"no patch applies to {module} here")
    _make_copy(tmp_path, package)
    path = str(tmp_path / "vendor") + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": path}
    off = json.loads(run_py(CHILD_COPY.format(package=package, apply=False), env=env).strip().splitlines()[-1])
    assert expected <= set(off["found"]), (sorted(expected), off)
    assert all(s.startswith("found") for s in off["found"].values()), off
    on = json.loads(
        run_py(CHILD_COPY.format(package=package, apply=True), env={**env, "KVPATCH_VENDORED": "1"})
        .strip()
        .splitlines()[-1]
    )
    for key in expected:
        # patched, or declined by the patch's own builder exactly as for upstream's class (e.g. a target whose
        # fix needs a method this release lacks: BatchQuantizedKVCache.extract arrives in mlx-vlm 0.6.5)
        state = on["found"][key]
        assert state == "patched" or (state.startswith("not patched") and "declined" in state), (key, state)
    patched_offset = {"offset-detach BatchKVCache.update_and_fetch", "offset-detach-vlm BatchKVCache.update_and_fetch"}
    if patched_offset & expected and on["edges"] is not None:
        assert off["edges"][1] > off["edges"][0], off  # the copy has the bug
        # and the fix reached it: the offset's graph stays bounded (ties every _lazy.EVERY steps, so it need
        # not be constant between checkpoints), far below the unpatched copy's
        from _edges import MAX_EDGES

        assert max(on["edges"]) <= MAX_EDGES < off["edges"][1], (on, off, MAX_EDGES)


CHILD_REGISTERED = """
import importlib, importlib.metadata, io, json, sys
import mlx.core as mx
import kvpatch
import {package}.models.cache as upstream

version = importlib.metadata.version("{package}".replace("_", "-"))
kvpatch.register_copy("kvpatch_test_vendor.cache", of="{package}.models.cache", version=version,
                      patches={patches})
kvpatch.register_copy("kvpatch_test_vendor.other", of="{package}.models.cache", version=version,
                      patches=["no-such-patch"])
def copies():
    return {{r.patch.id: r.state.value for r in kvpatch.records() if r.copy == "kvpatch_test_vendor.cache"}}
mine = {{r.patch.id: r.state.value for r in kvpatch.records() if r.copy is None}}
pending = copies()
copy = importlib.import_module("kvpatch_test_vendor.cache")
applied = copies()
edges = None
if applied.get("{offset}") == "applied":
    def count(a):
        buf = io.StringIO(); mx.export_to_dot(buf, a); return buf.getvalue().count("->")
    cache = copy.BatchKVCache([2, 0])
    x = mx.random.normal((2, 2, 3, 16), key=mx.random.key(0))
    mx.eval(cache.update_and_fetch(x, x + 1))
    for i in range(30):
        s = mx.random.normal((2, 2, 1, 16), key=mx.random.key(i + 1))
        mx.eval(cache.update_and_fetch(s, s + 1))
    edges = count(cache.offset)
    copy.BatchKVCache.update_and_fetch = lambda self, k, v: (k, v)  # the server replaces it: not kvpatch's fix
overridden = copies()
others = [(r.patch.id, r.state.value) for r in kvpatch.records() if r.copy == "kvpatch_test_vendor.other"]
try:
    kvpatch.require_applied()
    problems = []
except kvpatch.NotApplied as exc:
    problems = [p.patch_id for p in exc.problems]
print(json.dumps({{"mine": mine, "pending": pending, "applied": applied, "overridden": overridden,
                  "edges": edges, "others": others, "problems": problems}}))
"""

OFFSET = {"mlx_lm": "offset-detach", "mlx_vlm": "offset-detach-vlm"}


@pytest.mark.parametrize("package", ["mlx_lm", "mlx_vlm"])
@pytest.mark.parametrize("chosen", [False, True], ids=["all", "chosen"])
def test_registered_copy_has_records_of_its_own(run_py, tmp_path, package, chosen):
    """A server registers its copy in code (kvpatch.register_copy): the copy's patches get statuses of their
    own, applied only while the fix is in the copy, and the fix reaches the copy's classes."""
    import importlib.metadata
    import os

    import kvpatch

    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed here")
    if importlib.metadata.version(package.replace("_", "-")) not in COPY_RELEASES[package]:
        pytest.skip(f"the copy test runs on {package} {', '.join(COPY_RELEASES[package])}")
    offset = OFFSET[package]
    st = kvpatch.get_engine().status.get(offset)
    if st is None or st.decision.action.value != "apply":
        pytest.skip(f"{offset} does not apply here")
    _make_copy(tmp_path, package)
    env = {"PYTHONPATH": str(tmp_path / "vendor") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = CHILD_REGISTERED.format(package=package, offset=offset, patches=[offset] if chosen else None)
    out = json.loads(run_py(code, env=env).strip().splitlines()[-1])
    assert out["mine"][offset] == "applied", out  # upstream's own module: its own status
    assert out["pending"][offset] == "pending", out  # the copy is not imported yet: not applied
    assert out["applied"][offset] == "applied", out
    if chosen:
        assert set(out["applied"]) == {offset}, out
    else:
        assert len(out["applied"]) > 1, out
        assert "applied" in out["mine"].values()
    from _edges import MAX_EDGES

    assert out["edges"] is not None and out["edges"] <= MAX_EDGES, out  # the fix is in the copy's class
    assert out["overridden"][offset] == "overridden", out  # replaced in the copy: no longer applied there
    assert out["others"] == [("no-such-patch", "failed")] or out["others"] == [["no-such-patch", "failed"]], out
    assert f"{offset} in kvpatch_test_vendor.cache" in out["problems"], out


CHILD_SCANNED = """
import importlib, json
import kvpatch
import {package}.models.cache
from kvpatch import vendored

copy = importlib.import_module("kvpatch_test_vendor.cache")
vendored.apply()
def mine():
    return {{r.patch.id: r.state.value for r in kvpatch.records() if r.copy == "kvpatch_test_vendor.cache"}}
def marked(qualname):
    owner = copy
    for part in qualname.split(".")[:-1]:
        owner = getattr(owner, part)
    return getattr(vars(owner)[qualname.rsplit(".", 1)[-1]], "__kvpatch__", None)
applied = mine()
kept = marked("{kept}")
offset = marked("BatchKVCache.update_and_fetch")
kvpatch.deactivate()
print(json.dumps({{"applied": applied, "kept": kept, "offset": offset, "after": mine(),
                  "restored": marked("BatchKVCache.update_and_fetch")}}))
"""


def _multi_target_patch(package: str) -> tuple[str, str, str] | None:
    """(patch id, a target the copy keeps as upstream's, a target the copy changes): a patch applied here with two
    undecorated methods of ``<package>.models.cache`` among its replaced targets."""
    import ast
    from collections import Counter

    import kvpatch
    from kvpatch.gate import Action
    from kvpatch.locate import module_file
    from kvpatch.testing import natural_decision

    module = f"{package}.models.cache"
    defs: dict[str, ast.AST] = {}
    todo = [(node, "") for node in ast.parse(open(module_file(module), encoding="utf-8").read()).body]
    while todo:
        node, prefix = todo.pop(0)
        if isinstance(node, ast.ClassDef):
            todo += [(child, f"{prefix}{node.name}.") for child in node.body]
        elif isinstance(node, ast.FunctionDef) and not node.decorator_list:
            defs[prefix + node.name] = node
    applied = [p for p in kvpatch.get_engine().materialise() if natural_decision(p).action is Action.APPLY]
    applied = [p for p in applied if not p.opt_in]
    patched = Counter(t.qualname for p in applied for t in p.targets if t.module == module)
    offset = {t.qualname for p in applied if p.id == OFFSET[package] for t in p.targets}
    for patch in applied:
        mine = [t.qualname for t in patch.targets if t.module == module and t.kind.value == "replace"]
        alone = [q for q in mine if q in defs and patched[q] == 1]  # no other patch changes it
        if patch.id != OFFSET[package] and len(alone) >= 2 and not offset & set(mine):
            return patch.id, alone[0], alone[1]
    return None


@pytest.mark.parametrize("package", ["mlx_lm", "mlx_vlm"])
def test_scanned_copy_is_registered_whole_patches_only(run_py, tmp_path, package):
    """KVPATCH_VENDORED registers what the scan finds through register_copy's path: the copy's patches have
    records of their own, a patch is applied to the copy whole or not at all (one function whose code differs from
    the installed upstream's keeps the patch's other functions unpatched too), and deactivate() restores the copy."""
    import ast
    import importlib.metadata
    import os

    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed here")
    if importlib.metadata.version(package.replace("_", "-")) not in COPY_RELEASES[package]:
        pytest.skip(f"the copy test runs on {package} {', '.join(COPY_RELEASES[package])}")
    _needs_offset_patch(package)
    chosen = _multi_target_patch(package)
    offset = OFFSET[package]
    if chosen is None:
        pytest.skip(f"no patch applied here changes two plain methods of {package}.models.cache")
    patch_id, kept, changed = chosen
    _make_copy(tmp_path, package)
    path = tmp_path / "vendor" / "kvpatch_test_vendor" / "cache.py"
    lines = path.read_text().split("\n")
    todo = [(node, "") for node in ast.parse("\n".join(lines)).body]
    while todo:  # the changed method gets a no-op decorator: same behaviour, not the installed upstream's code
        node, prefix = todo.pop(0)
        if isinstance(node, ast.ClassDef):
            todo += [(child, f"{prefix}{node.name}.") for child in node.body]
        elif prefix + getattr(node, "name", "") == changed:
            lines.insert(node.lineno - 1, " " * node.col_offset + "@(lambda function: function)")
            break
    path.write_text("\n".join(lines))
    env = {"PYTHONPATH": str(tmp_path / "vendor") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "KVPATCH_VENDORED": "1"}  # fmt: skip
    out = json.loads(run_py(CHILD_SCANNED.format(package=package, kept=kept), env=env).strip().splitlines()[-1])
    assert out["applied"].get(offset) == "applied" and out["offset"] is not None, out  # records of the copy's own
    assert patch_id not in out["applied"], (patch_id, changed, out)  # not a copy of that patch's code
    assert out["kept"] is None, (patch_id, kept, out)  # not half a patch
    assert "applied" not in out["after"].values() and out["restored"] is None, out


CHILD_TWICE = """
import importlib, importlib.metadata, json
import kvpatch
import {package}.models.cache

version = importlib.metadata.version("{package}".replace("_", "-"))
for _ in range(2):
    kvpatch.register_copy("kvpatch_test_vendor.cache", of="{package}.models.cache", version=version,
                          patches=["{offset}"])
copy = importlib.import_module("kvpatch_test_vendor.cache")
states = [r.state.value for r in kvpatch.records() if r.copy == "kvpatch_test_vendor.cache"]
kvpatch.deactivate()
print(json.dumps({{"states": states, "left": getattr(copy.BatchKVCache.update_and_fetch, "__kvpatch__", None)}}))
"""


@pytest.mark.parametrize("package", ["mlx_lm", "mlx_vlm"])
def test_copy_registered_again_replaces_the_earlier_registration(run_py, tmp_path, package):
    """Registering a copy again takes the earlier registration's place: one status per (patch, copy), applied, and
    deactivate() restores the copy's own code."""
    import importlib.metadata
    import os

    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed here")
    if importlib.metadata.version(package.replace("_", "-")) not in COPY_RELEASES[package]:
        pytest.skip(f"the copy test runs on {package} {', '.join(COPY_RELEASES[package])}")
    _needs_offset_patch(package)
    _make_copy(tmp_path, package)
    env = {"PYTHONPATH": str(tmp_path / "vendor") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = json.loads(run_py(CHILD_TWICE.format(package=package, offset=OFFSET[package]), env=env).splitlines()[-1])
    assert out == {"states": ["applied"], "left": None}, out


def _needs_offset_patch(package: str) -> None:
    import kvpatch

    st = kvpatch.get_engine().status.get(OFFSET[package])
    if st is None or st.decision.action.value != "apply":
        pytest.skip(f"{OFFSET[package]} does not apply here")
