"""Put first on ``PYTHONPATH`` by ``server_fixes.off_environ``: turns the servers' overlapping hand patches
off in this process (see ../server_fixes.py). Loaded by file path: nothing of tests/coexist goes on sys.path."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parent.parent / "server_fixes.py"
_spec = importlib.util.spec_from_file_location("_kvpatch_coexist_server_fixes", _path)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module  # dataclasses look their module up there
    _spec.loader.exec_module(_module)
    _module.install_off_switch()
