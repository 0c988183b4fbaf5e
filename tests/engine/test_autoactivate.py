"""Auto-activation through the installed bootstrap (``kvpatch.pth`` / ``kvpatch.start``), in fresh interpreters.

These need kvpatch *installed* (the bootstrap lives at the top of site-packages); from a bare source
checkout they are skipped. Upstream is not needed: the bootstrap's trigger is the import of a package
named ``mlx_lm`` / ``mlx_vlm``, which the tests provide as a stand-in package (with a ``.dist-info`` of
a release in range where the engine must see one installed) only to watch the trigger fire and the
engine decide; no patch logic runs against it (the real upstream runs in tests/upstream).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import child_env

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("_kvpatch_boot") is None, reason="kvpatch is not installed (no .pth bootstrap)"
)

SITE = (
    Path(importlib.util.find_spec("_kvpatch_boot").origin).parent if importlib.util.find_spec("_kvpatch_boot") else None
)
PROBE = "import sys, json; {body}; print(json.dumps({{'kvpatch': 'kvpatch' in sys.modules, 'wrapt': 'wrapt' in sys.modules, 'hooks': '_kvpatch_hooks' in sys.modules}}))"


def _trigger_dir(tmp_path, version: str | None = None, name: str = "mlx_lm") -> str:
    """A folder holding an empty stand-in ``name`` package (and its dist-info when ``version`` is given)."""
    root = tmp_path / "trigger"
    pkg = root / name
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    if version is not None:
        dist = root / f"{name}-{version}.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    return str(root)


def _shadows(folder: Path) -> None:
    """``kvpatch.py`` and ``wrapt.py`` that announce themselves if anything executes them."""
    for name in ("kvpatch", "wrapt"):
        (folder / f"{name}.py").write_text(f"import sys\nsys.stderr.write('SHADOW {name} EXECUTED\\n')\n")


def _run(args, *, cwd, env=None):
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=child_env(env), capture_output=True, text=True, timeout=600
    )


def test_plain_process_pays_nothing(run_py):
    out = json.loads(run_py(PROBE.format(body="pass")))
    assert out == {"kvpatch": False, "wrapt": False, "hooks": False}


def test_plain_process_imports_nothing_of_kvpatch(tmp_path):
    """Where mlx is never imported, start-up imports no module of kvpatch's (kvpatch.pth's one line
    compiles a small lambda; from 3.15 kvpatch.start imports the small _kvpatch_boot)."""
    out = _run(["-X", "importtime", "-c", "import json, os"], cwd=tmp_path, env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert out.returncode == 0, out.stderr
    loaded = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line]
    mine = [name for name in loaded if "kvpatch" in name or name == "wrapt"]
    if sys.version_info >= (3, 15):
        assert mine == ["_kvpatch_boot"], mine
    else:
        assert mine == [], mine
    assert (SITE / "_kvpatch_boot.py").stat().st_size < 4500, "what kvpatch.start imports at every start stays small"


def test_importing_upstream_activates(run_py, tmp_path):
    out = json.loads(run_py(PROBE.format(body="import mlx_lm"), env={"PYTHONPATH": _trigger_dir(tmp_path)}))
    assert out["kvpatch"] is True


def test_kvpatch_off_disables_bootstrap(run_py, tmp_path):
    env = {"PYTHONPATH": _trigger_dir(tmp_path), "KVPATCH": "off"}
    out = json.loads(run_py(PROBE.format(body="import mlx_lm"), env=env))
    assert out == {"kvpatch": False, "wrapt": False, "hooks": False}


def test_finder_stays_first_and_loader_is_upstreams(run_py, tmp_path):
    """After activation kvpatch's finder is still first on sys.meta_path (wrapt inserts its own at the
    front), and the imported package keeps its real loader."""
    code = (
        "import sys, json, mlx_lm, _kvpatch_boot\n"
        "first = sys.meta_path[0] is _kvpatch_boot.KvpatchBootstrapFinder\n"
        "loader = type(mlx_lm.__loader__).__name__, type(mlx_lm.__spec__.loader).__name__\n"
        "print(json.dumps({'first': first, 'loader': loader, 'kvpatch': 'kvpatch' in sys.modules}))"
    )
    out = json.loads(run_py(code, env={"PYTHONPATH": _trigger_dir(tmp_path, "0.32.2")}).strip().splitlines()[-1])
    assert out == {"first": True, "loader": ["SourceFileLoader", "SourceFileLoader"], "kvpatch": True}


@pytest.mark.parametrize("how", ["-c", "script"])
def test_working_directory_does_not_shadow_kvpatch_or_wrapt(tmp_path, how):
    """A ``kvpatch.py`` or ``wrapt.py`` in the working directory (``python -c``) or beside the script is
    not executed by ``import mlx_lm``: the bootstrap imports kvpatch and what kvpatch imports from its
    own site directory and the start-up path (mlx-lm is made to look installed, so the engine has
    patches pending and imports what it needs to hook them)."""
    work = tmp_path / "work"
    work.mkdir()
    _shadows(work)
    code = (
        "import sys, json, mlx_lm, kvpatch\n"
        "print(json.dumps({'kvpatch': kvpatch.__file__, 'wrapt': getattr(sys.modules.get('wrapt'), '__file__', None),"
        " 'states': sorted({s.state.value for s in kvpatch.records()})}))"
    )
    if how == "-c":
        args = ["-c", code]
    else:
        (work / "app.py").write_text(code)
        args = [str(work / "app.py")]
    proc = _run(args, cwd=work, env={"PYTHONPATH": _trigger_dir(tmp_path, "0.32.2")})
    assert proc.returncode == 0, proc.stderr
    assert "SHADOW" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["kvpatch"]).parent.parent == SITE, out
    assert out["wrapt"] is None or not out["wrapt"].startswith(str(work)), out
    assert "pending" in out["states"], out  # the engine is active and has patches waiting for their modules


def test_explicit_import_from_the_working_directory_is_the_users_business(tmp_path):
    """Only kvpatch's own activation is kept from the working directory: a user's ``import kvpatch``
    before any mlx import still gets what Python's path says (here: their own file)."""
    work = tmp_path / "work"
    work.mkdir()
    _shadows(work)
    proc = _run(["-c", "import kvpatch, mlx_lm"], cwd=work, env={"PYTHONPATH": _trigger_dir(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "SHADOW kvpatch EXECUTED" in proc.stderr


def test_warning_error_never_breaks_the_import(tmp_path):
    """``-W error`` turns every warning into an exception: a bad KVPATCH_DISABLE value must still leave
    ``import mlx_lm`` working (the bootstrap's warnings go through one guarded path)."""
    env = {"PYTHONPATH": _trigger_dir(tmp_path, "0.32.2"), "KVPATCH_DISABLE": "mask-fil"}
    proc = _run(["-W", "error", "-c", "import mlx_lm; print('imported')"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported"


def test_activation_failure_warns_once_and_import_works(tmp_path):
    """kvpatch failing to import is one warning, through ``warnings`` (filterable), never an error."""
    env = {"PYTHONPATH": _trigger_dir(tmp_path, "0.32.2")}
    code = textwrap.dedent(
        """
        import sys, warnings, json
        sys.modules["kvpatch.engine"] = None  # kvpatch cannot import its engine: its import fails
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mlx_lm
        print(json.dumps([str(w.message) for w in caught]))
        """
    )
    proc = _run(["-c", code], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    messages = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(messages) == 1 and messages[0].startswith("kvpatch could not activate"), messages


def test_threads_share_one_activation(tmp_path):
    """First imports of both packages from 8 threads at once: one activation, the finder once on
    sys.meta_path, and each package's post-import hook called once, after the package's code ran."""
    root = _trigger_dir(tmp_path, "0.32.2", "mlx_lm")
    _trigger_dir(tmp_path, "0.7.10", "mlx_vlm")
    for name in ("mlx_lm", "mlx_vlm"):
        (Path(root) / name / "__init__.py").write_text("import time\ntime.sleep(0.2)\nDONE = True\n")
    code = textwrap.dedent(
        """
        import importlib, json, sys, threading, _kvpatch_boot
        seen = []
        hooks = _kvpatch_boot.hooks()
        for name in ("mlx_lm", "mlx_vlm"):
            hooks.register_post_import_hook(lambda m: seen.append((m.__name__, getattr(m, "DONE", False))), name)
        barrier = threading.Barrier(8)
        def work(name):
            barrier.wait()
            importlib.import_module(name)
        threads = [threading.Thread(target=work, args=(("mlx_lm", "mlx_vlm")[i % 2],)) for i in range(8)]
        for t in threads: t.start()
        for t in threads: t.join(120)
        print(json.dumps({
            "alive": sum(t.is_alive() for t in threads),
            "finders": sum(f is _kvpatch_boot.KvpatchBootstrapFinder for f in sys.meta_path),
            "kvpatch": "kvpatch" in sys.modules,
            "seen": sorted(seen),
        }))
        """
    )
    proc = _run(["-c", code], cwd=tmp_path, env={"PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"alive": 0, "finders": 1, "kvpatch": True, "seen": [["mlx_lm", True], ["mlx_vlm", True]]}


def test_hook_registered_while_module_executes_fires_when_it_finishes(tmp_path):
    """A hook registered (from another thread) while its module is still executing is called once,
    after the module's code has run: never on the half-made module and then forgotten."""
    root = Path(_trigger_dir(tmp_path))
    (root / "mlx_lm" / "slow.py").write_text(
        "import builtins, time\nbuiltins.KV_STARTED.set()\ntime.sleep(0.5)\nDONE = True\n"
    )
    code = textwrap.dedent(
        """
        import builtins, importlib, json, sys, threading, time, _kvpatch_boot
        builtins.KV_STARTED = threading.Event()
        import mlx_lm
        calls = []
        t = threading.Thread(target=importlib.import_module, args=("mlx_lm.slow",))
        t.start()
        builtins.KV_STARTED.wait(30)
        _kvpatch_boot.hooks().register_post_import_hook(lambda m: calls.append(getattr(m, "DONE", False)), "mlx_lm.slow")
        t.join(30)
        print(json.dumps(calls))
        """
    )
    proc = _run(["-c", code], cwd=tmp_path, env={"PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True]


# -- PEP 829: kvpatch.start ------------------------------------------------------------------------
# Python 3.15 runs ``<name>.start`` entry points (``pkg.mod:callable``, called with no arguments) and
# skips the ``import`` lines of a ``<name>.pth`` that has a matching ``.start``; from 3.18 ``.pth``
# import lines are ignored altogether. SIMULATE_SITE does that for kvpatch's files, in a process
# started with ``-S`` (no site processing of its own).
SIMULATE_SITE = textwrap.dedent(
    """
    import os, pkgutil, sys
    SITE, MODE = sys.argv[1], sys.argv[2]
    sys.path.append(SITE)
    sitedir = SITE  # site.addpackage's local, which the .pth line reads as site runs it
    names = sorted(os.listdir(SITE))
    starts = {n[:-6] for n in names if n.endswith(".start")}
    for name in names:  # .pth files: paths always; import lines by MODE
        if name == "kvpatch.pth":
            for line in open(os.path.join(SITE, name), encoding="utf-8-sig"):
                if line.startswith(("import ", "import\\t")):
                    if MODE == "3.14" or (MODE == "3.15" and name[:-4] not in starts) or MODE == "both":
                        exec(line)
    if MODE in ("3.15", "3.18", "both"):
        for name in names:
            if name == "kvpatch.start":
                for line in open(os.path.join(SITE, name), encoding="utf-8"):
                    line = line.strip()
                    if line and not line.startswith("#"):
                        pkgutil.resolve_name(line)()
    """
)


@pytest.mark.parametrize("mode", ["3.14", "3.15", "3.18", "both"])
def test_pep_829_start_file(tmp_path, mode):
    """Whichever of kvpatch.pth's import line and kvpatch.start's entry point runs (or both), the
    bootstrap is installed once and activates kvpatch on the first mlx import."""
    assert (SITE / "kvpatch.start").read_text().strip().splitlines()[-1] == "_kvpatch_boot:install"
    code = SIMULATE_SITE + textwrap.dedent(
        """
        import json
        finders = [f for f in sys.meta_path if getattr(f, "__name__", "") == "KvpatchBootstrapFinder"]
        import mlx_lm
        print(json.dumps({"finders": len(finders), "kvpatch": "kvpatch" in sys.modules}))
        """
    )
    proc = _run(["-S", "-c", code, str(SITE), mode], cwd=tmp_path, env={"PYTHONPATH": _trigger_dir(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"finders": 1, "kvpatch": True}


# The .pth line as site runs it (exec with ``sitedir`` in scope), ``times`` times, from a copy of the
# site directory whose _kvpatch_boot.py the test may replace.
RUN_PTH_LINE = textwrap.dedent(
    """
    import json, os, sys
    sitedir, times = sys.argv[1], int(sys.argv[2])
    sys.path.append(sitedir)
    line = [x for x in open(os.path.join(sitedir, "kvpatch.pth")) if x.startswith("import ")][0]
    for _ in range(times):
        exec(line)
    stand_in = sys.meta_path[0]
    import mlx_lm
    import mlx_lm
    finders = [f for f in sys.meta_path if getattr(f, "__name__", "") == "KvpatchBootstrapFinder"]
    print(json.dumps({
        "finders": [type(f).__name__ for f in finders],
        "kvpatch": "kvpatch" in sys.modules,
        "site_globals": stand_in.__globals__ is globals(),
    }))
    """
)


def _site_copy(tmp_path, boot: str | None = None) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    for name in ("kvpatch.pth", "_kvpatch_boot.py", "_kvpatch_hooks.py"):
        (site / name).write_bytes((SITE / name).read_bytes())
    if boot is not None:
        (site / "_kvpatch_boot.py").write_text(boot)
    return site


def test_stand_in_is_taken_over_once_even_when_installed_twice(tmp_path):
    """Two stand-ins (a .pth processed twice) become one bootstrap finder; the stand-in keeps a
    globals dict of its own (not the module that ran the line: cheaper interpreter exit)."""
    site = _site_copy(tmp_path)
    path = os.pathsep.join([_trigger_dir(tmp_path), str(SITE)])  # SITE: the kvpatch package itself
    proc = _run(["-S", "-c", RUN_PTH_LINE, str(site), "2"], cwd=tmp_path, env={"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "finders": ["type"],
        "kvpatch": True,
        "site_globals": False,
    }


@pytest.mark.parametrize("warnings", [[], ["-W", "error"]])
def test_broken_bootstrap_never_breaks_imports(tmp_path, warnings):
    """A _kvpatch_boot.py that raises: the user's imports still work, the failure is reported once on
    stderr, and the stand-in stays inert (no second attempt, no second message)."""
    site = _site_copy(tmp_path, boot="raise RuntimeError('boom')\n")
    path = os.pathsep.join([_trigger_dir(tmp_path), str(SITE)])
    proc = _run([*warnings, "-S", "-c", RUN_PTH_LINE, str(site), "1"], cwd=tmp_path, env={"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("kvpatch: bootstrap disabled (RuntimeError: boom)") == 1, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kvpatch"] is False


def test_pep_829_on_a_real_interpreter(tmp_path):
    """On Python 3.15+ (where ``site`` itself reads .start files) the installed files work as they are."""
    if sys.version_info < (3, 15):
        pytest.skip("this interpreter predates PEP 829 (Python 3.15); the simulation above stands in")
    proc = _run(
        ["-c", "import sys, mlx_lm; print('kvpatch' in sys.modules)"],
        cwd=tmp_path,
        env={"PYTHONPATH": _trigger_dir(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_run_subcommand(run_py, tmp_path):
    mod = tmp_path / "trigger2"
    mod.mkdir()
    (mod / "kvpatch_demo_main.py").write_text("import sys; print('argv', sys.argv[1:], 'kvpatch' in sys.modules)")
    out = run_py(
        "import runpy, sys; sys.argv=['kvpatch','run','-m','kvpatch_demo_main','--x','1']; runpy.run_module('kvpatch', run_name='__main__')",
        env={"PYTHONPATH": str(mod)},
    )
    assert "argv ['--x', '1'] True" in out


@pytest.mark.slow
def test_editable_install_gets_the_bootstrap(tmp_path):
    """``pip install -e`` (hatchling's editable wheel) installs kvpatch.pth, kvpatch.start and the
    bootstrap modules too (as copies: reinstall after editing kvpatch/_site), and activation imports
    kvpatch from the source tree. Needs the package index for the build backend."""
    from support import REPO

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "-e", str(REPO)],
        capture_output=True,
        text=True,
        timeout=900,
        env=child_env(),
    )
    if install.returncode != 0:
        pytest.skip(f"editable install failed here (no package index?): {install.stderr[-500:]}")
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    assert {"kvpatch.pth", "kvpatch.start", "_kvpatch_boot.py", "_kvpatch_hooks.py"} <= {p.name for p in site.iterdir()}
    proc = subprocess.run(
        [python, "-c", "import sys, mlx_lm; print(sys.modules['kvpatch'].__file__)"],
        cwd=tmp_path,
        env=child_env({"PYTHONPATH": _trigger_dir(tmp_path)}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).parent == REPO / "kvpatch"


# -- the finder a person sees on sys.meta_path, and KVPATCH=off --------------------------------------------

FINDERS = (
    "import sys, json\n"
    "mine = [f for f in sys.meta_path if getattr(f, '__name__', '') == 'KvpatchBootstrapFinder' or 'kvpatch' in repr(f)]\n"
    "print(json.dumps({'finders': [repr(f) for f in mine], 'modules': [getattr(f, '__module__', None) for f in mine],"
    " 'first': repr(sys.meta_path[0]), 'kvpatch': 'kvpatch' in sys.modules, 'hooks': '_kvpatch_hooks' in sys.modules,"
    " 'boot': '_kvpatch_boot' in sys.modules}))"
)


def test_start_up_finder_has_a_recognisable_name(run_py):
    """It was ``<function <lambda>>`` with ``__module__`` None: a person debugging imports could not tell whose."""
    out = json.loads(run_py(FINDERS))
    # (one per time site processes kvpatch.pth: some virtualenvs list their site-packages twice)
    assert out["finders"] and out["first"] == out["finders"][0]
    for finder in out["finders"]:
        assert finder.startswith(
            "<function kvpatch._site finder (activates kvpatch on the first mlx_lm/mlx_vlm import) at 0x"
        ), out
    assert set(out["modules"]) == {"_kvpatch_boot"}


@pytest.mark.parametrize("value", ["off", "0", "false", "no", "disable", "Disabled", " OFF "])
def test_kvpatch_off_installs_no_finder_at_all(run_py, tmp_path, value):
    """With KVPATCH=off nothing of kvpatch's is on sys.meta_path, before or after an mlx import; what
    docs/configuration.md says runs: the .pth line reads the bootstrap file (set KVPATCH: it decides at start)."""
    env = {"PYTHONPATH": _trigger_dir(tmp_path), "KVPATCH": value}
    before = json.loads(run_py(FINDERS, env=env))
    assert before["finders"] == [] and before["kvpatch"] is False and before["boot"] is True, before
    after = json.loads(run_py("import mlx_lm\n" + FINDERS, env=env))
    assert after["finders"] == [] and after["kvpatch"] is False and after["hooks"] is False, after


@pytest.mark.parametrize("value", ["on", "1", "", "auto"])
def test_kvpatch_set_and_on_installs_the_bootstrap_finder_at_start(run_py, tmp_path, value):
    env = {"PYTHONPATH": _trigger_dir(tmp_path), "KVPATCH": value}
    out = json.loads(run_py(FINDERS, env=env))
    assert out["finders"] == ["<class '_kvpatch_boot.KvpatchBootstrapFinder'>"] == [out["first"]], out
    assert out["hooks"] is False  # the machinery still waits for the first mlx import
    assert json.loads(run_py("import mlx_lm\n" + FINDERS, env=env))["kvpatch"] is True


def test_one_reading_of_kvpatch_off():
    """The bootstrap (which cannot import kvpatch) and kvpatch.config read KVPATCH=off through one function."""
    import _kvpatch_boot

    from kvpatch import _site, config

    assert _site.boot() is sys.modules["_kvpatch_boot"] is _kvpatch_boot
    assert config.OFF_VALUES == frozenset(_kvpatch_boot.OFF_VALUES)
    for value in ("off", "OFF", " disabled ", "0", "no", "false", "disable", "on", "", "1", "auto", "offf"):
        env = {"KVPATCH": value}
        assert config.read_config(env).enabled is not _kvpatch_boot.is_off(env), value
    # the bootstrap's files hold no second list of the values
    for name in ("_kvpatch_hooks.py", "kvpatch.pth", "kvpatch.start"):
        assert '"disabled"' not in (SITE / name).read_text(), name


def test_hook_failures_warn_as_kvpatch_warnings(tmp_path):
    """The import machinery's warnings take kvpatch's one path: ``KvpatchWarning`` (a filter on it silences them;
    they were ``UserWarning``)."""
    env = {"PYTHONPATH": _trigger_dir(tmp_path, "0.32.2")}
    code = textwrap.dedent(
        """
        import json, sys, warnings
        import kvpatch, _kvpatch_boot
        def broken(module):
            raise RuntimeError("hook boom")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _kvpatch_boot.hooks().register_post_import_hook(broken, "mlx_lm")
            import mlx_lm
        with warnings.catch_warnings(record=True) as ignored:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", category=kvpatch.KvpatchWarning)
            _kvpatch_boot.hooks()._call(broken, mlx_lm)
        print(json.dumps({"caught": [(w.category.__name__, str(w.message)) for w in caught], "ignored": len(ignored)}))
        """
    )
    proc = _run(["-c", code], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["caught"] == [["KvpatchWarning", "post-import hook for mlx_lm failed: RuntimeError: hook boom"]], out
    assert out["ignored"] == 0


def test_activation_failure_warns_as_kvpatch_warning(tmp_path):
    env = {"PYTHONPATH": _trigger_dir(tmp_path, "0.32.2")}
    code = textwrap.dedent(
        """
        import sys, warnings, json
        sys.modules["kvpatch.engine"] = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mlx_lm
        print(json.dumps([w.category.__mro__[0].__module__ + "." + w.category.__name__ for w in caught]))
        """
    )
    proc = _run(["-c", code], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["kvpatch._warn.KvpatchWarning"]


def test_a_kvpatch_that_cannot_import_warns_on_stderr_not_as_user_warning(tmp_path):
    """kvpatch's warning path itself cannot load (the package fails before it): one line on stderr, no warning of
    another category that ``-W ignore::kvpatch.KvpatchWarning`` would miss (``-W error`` leaves the import alone)."""
    env = {"PYTHONPATH": _trigger_dir(tmp_path, "0.32.2")}
    code = textwrap.dedent(
        """
        import sys, warnings, json
        sys.modules["kvpatch"] = None  # `import kvpatch` raises before kvpatch._warn exists
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mlx_lm
        print(json.dumps([w.category.__name__ for w in caught]))
        """
    )
    proc = _run(["-W", "error", "-c", code], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    assert proc.stderr.count("kvpatch: warning: kvpatch could not activate: ") == 1, proc.stderr
