"""Each float reproduction's bug size against the rounding it is judged by, with and without its patch (a maintainer's
measurement: how far a verdict is from "inconclusive" on this machine).

For every patch that applies to the installed upstream (by version, or where its reproduction decides), the engine's
one "with and without" (``Engine.measure``) runs its reproduction; a reproduction whose finding carries a size
(``kvpatch.patches._numbers.judge``: ``error`` and ``rounding``) gives a row: the error without the patch (the bug),
the error with it, the rounding, their ratios, and the ratio with the patch in unit roundoffs (``SPREAD`` allows
8). Reproductions that only check structure (offsets, shapes, a raised error) are counted, not listed.

    .venv/bin/python scripts/in_bucket.py lm-0.32.2 -- python scripts/margins.py            # where verdicts run
    python scripts/margins.py --device default --json margins.json                          # also the default device

``--device cpu`` (default) runs every reproduction on the CPU stream; ``--device default`` runs each twice, on the
CPU and on mlx's default device (a GPU's TF32 there), bypassing the rule that runs logic bugs' reproductions on the
CPU. The patch's ``on_device`` rule is what verdicts use; this measures both sides of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _side(finding: Any) -> dict[str, Any] | None:
    if finding is None:
        return None
    side: dict[str, Any] = {"bug": finding.bug.value, "error": finding.error, "rounding": finding.rounding}
    if finding.error is not None and finding.rounding:
        side["ratio"] = finding.error / finding.rounding
    return side


def measure(devices: list[str]) -> dict[str, Any]:
    import mlx.core as mx

    import kvpatch
    from kvpatch.gate import Action
    from kvpatch.patches._numbers import SPREAD, arithmetic
    from kvpatch.testing import natural_decision

    engine = kvpatch.get_engine()
    rows, structural, skipped = [], [], {}
    for patch in engine.materialise():
        decision = natural_decision(patch)
        if decision.action not in (Action.APPLY, Action.VERIFY) or patch.reproduction is None:
            continue
        for device in devices:
            with mx.stream(mx.cpu if device == "cpu" else mx.default_device()):
                gpu = mx.default_device().type == mx.DeviceType.gpu
                where = f"{'gpu' if gpu else 'cpu'} {arithmetic()}"
            try:
                m = engine.measure(patch, install=True, device=device)
            except Exception as exc:  # reported, not fatal: the other patches still measure
                skipped[f"{patch.id} on {device}"] = f"{type(exc).__name__}: {exc}"
                continue
            without, with_patch = _side(m.before), _side(m.after)
            if m.before.skipped:
                skipped[f"{patch.id} on {device}"] = m.before.skipped
                continue
            if not any(s and s.get("ratio") is not None for s in (without, with_patch)):
                structural.append(f"{patch.id} on {device}")
                continue
            row = {"id": patch.id, "device": device, "where": where, "without": without, "with": with_patch}
            if with_patch and with_patch.get("ratio") is not None:
                row["with_u"] = with_patch["ratio"] * SPREAD
            rows.append(row)
    versions = {name: up.version for name, up in engine.upstream.items() if name in ("mlx-lm", "mlx-vlm")}
    return {"mlx": mx.__version__, "upstream": versions, "rows": rows, "structural": structural, "skipped": skipped}


def _fmt(value: float | None, spec: str = ".2g") -> str:
    return "-" if value is None else format(value, spec)


def table(data: dict[str, Any]) -> str:
    up = ", ".join(f"{k} {v}" for k, v in data["upstream"].items() if v)
    lines = [f"mlx {data['mlx']}; {up}"]
    head = f"{'patch':<30} {'device':<12} {'bug':>9} {'x rounding':>10} {'patched':>9} {'x rounding':>10} {'u':>5}"
    lines += [head, "-" * len(head)]
    for r in data["rows"]:
        w, p = r["without"] or {}, r["with"] or {}
        lines.append(
            f"{r['id']:<30} {r['where']:<12} {_fmt(w.get('error')):>9} {_fmt(w.get('ratio'), '.3g'):>10} "
            f"{_fmt(p.get('error')):>9} {_fmt(p.get('ratio'), '.2g'):>10} {_fmt(r.get('with_u'), '.2g'):>5}"
        )
    patched = [r["with"]["ratio"] for r in data["rows"] if r["with"] and r["with"].get("ratio") is not None]
    bugs = [r["without"]["ratio"] for r in data["rows"] if r["without"] and r["without"].get("ratio")]
    if patched:
        lines.append(f"largest patched error: {max(patched):.3g}x the rounding; smallest bug: {min(bugs or [0]):.3g}x")
    lines.append(f"structural only (no size): {len(data['structural'])}: {', '.join(data['structural']) or '-'}")
    lines += [f"skipped {k}: {v}" for k, v in data["skipped"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "default"), default="cpu", help="default: the CPU and the device")
    parser.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("KVPATCH_VERIFY", "never")  # no background verification from this process
    data = measure(["cpu"] if args.device == "cpu" else ["cpu", "default"])
    print(table(data))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
