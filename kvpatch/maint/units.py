"""The unit index, ``kvpatch/data/units.json``: each unit's gate facts, so that auto-activation imports only
the units that can apply (:func:`kvpatch.registry.index`). Maintainer code: the runtime only reads the file.

    python -m kvpatch.maint.units            # exit 1, saying so, when the index is not what the units say
    python -m kvpatch.maint.units --write    # rewrite it from the units
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

from kvpatch import registry

#: What ``units.json`` holds per unit module.
INDEXED = tuple(f.name for f in fields(registry.Stub) if f.name != "module")


def expected() -> dict[str, Any]:
    """What the index must hold, from importing every unit (a broken unit is an error here)."""
    reg = registry.load()
    if reg.broken:
        raise RuntimeError(f"units that do not load: {reg.broken}")
    patches = sorted(reg.patches, key=lambda p: p.module)
    return {"units": {p.module: {name: getattr(p, name) for name in INDEXED} for p in patches}}


def render(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpatch.maint.units", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the index from the units")
    args = parser.parse_args(argv)
    data = expected()
    text, path = render(data), registry.INDEX
    if args.write:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path} ({len(data['units'])} units)")
        return 0
    current = path.read_text(encoding="utf-8") if path.is_file() else ""
    if current != text:
        print(f"{path} is stale: run `python -m kvpatch.maint.regenerate`", file=sys.stderr)
        return 1
    print(f"{path}: up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
