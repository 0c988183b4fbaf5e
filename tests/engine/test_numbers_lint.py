"""Numbers are compared one way (kvpatch/patches/_numbers.py): no literal threshold in a patch unit, a shared helper
or a test. A float literal decides nothing: not as a side of a comparison (``err > 1e-4``, ``err <= 0.05 * s + 1e-3``,
``max(tol, 1e-3) < err``), not as a tolerance keyword (``atol=1e-5``), not in an ``isclose`` / ``allclose`` /
``approx`` call, not through a name bound to one (``TOL = 1e-4`` ... ``err < TOL``). Integer literals (counts,
shapes, indices) are fine, and so are float literals that are data (a mask value, a model's ``rms_norm_eps``).
``_numbers.py`` is the one place its constants live."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import REPO

#: Keyword arguments that are tolerances wherever they appear.
TOLERANCE_KEYWORDS = frozenset({"atol", "rtol", "tol", "tolerance", "threshold"})
#: Calls whose every float argument is a tolerance.
CLOSENESS_CALLS = frozenset({"isclose", "allclose", "assert_allclose", "approx"})
#: Calls looked into when a comparison's side is searched for a literal (their value is made of their arguments).
ARITHMETIC_CALLS = frozenset({"max", "min", "abs", "float"})
ALLOWED = {REPO / "kvpatch" / "patches" / "_numbers.py"}


def _is_float(node: ast.AST) -> bool:
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, float)


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _parts(node: ast.AST):
    """``node`` and what its value is computed from: operands of arithmetic, arguments of ``max`` / ``min`` / ...,
    not the arguments of any other call (``mx.where(mask, 0.0, x)`` is data) nor lambdas or comprehensions."""
    yield node
    if isinstance(node, ast.Call):
        if _call_name(node) not in ARITHMETIC_CALLS:
            return
        children: list[ast.AST] = [*node.args, *(k.value for k in node.keywords)]
    elif isinstance(node, (ast.BinOp, ast.BoolOp, ast.UnaryOp, ast.IfExp, ast.Tuple, ast.List, ast.Dict)):
        children = list(ast.iter_child_nodes(node))
    elif isinstance(node, ast.Subscript):  # ``TOL[dtype]``: the table's values
        children = [node.value]
    else:
        return
    for child in children:
        yield from _parts(child)


def _float_names(tree: ast.AST) -> set[str]:
    """Names bound to a value made of a float literal: assignments and parameters' defaults."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if any(_is_float(part) for part in _parts(node.value)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.arguments):
            positional = [*node.posonlyargs, *node.args]
            for arg, default in zip(positional[len(positional) - len(node.defaults) :], node.defaults, strict=True):
                if any(_is_float(part) for part in _parts(default)):
                    names.add(arg.arg)
            for arg, kw_default in zip(node.kwonlyargs, node.kw_defaults, strict=True):
                if kw_default is not None and any(_is_float(part) for part in _parts(kw_default)):
                    names.add(arg.arg)
    return names


def literal_thresholds(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` compares numbers against a float literal: ``line: what``."""
    tree = ast.parse(source, filename)
    bound = _float_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                parts = list(_parts(side))
                if any(_is_float(p) for p in parts):
                    found.append(f"{node.lineno}: a comparison with a float literal")
                elif named := sorted({p.id for p in parts if isinstance(p, ast.Name) and p.id in bound}):
                    found.append(f"{node.lineno}: a comparison with {', '.join(named)}, bound to a float literal")
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg in TOLERANCE_KEYWORDS and any(_is_float(p) for p in _parts(keyword.value)):
                    found.append(f"{node.lineno}: {keyword.arg}= a float literal")
            if _call_name(node) in CLOSENESS_CALLS:
                values = [*node.args, *(k.value for k in node.keywords)]
                if any(_is_float(p) for value in values for p in _parts(value)):
                    found.append(f"{node.lineno}: {_call_name(node)}() with a float literal")
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


def _checked_files() -> list[Path]:
    files = [*(REPO / "kvpatch" / "patches").rglob("*.py"), *(REPO / "tests").rglob("*.py")]
    return sorted(p for p in files if p not in ALLOWED)


def test_no_literal_threshold_in_units_or_tests():
    found = {
        str(path.relative_to(REPO)): hits
        for path in _checked_files()
        if (hits := literal_thresholds(path.read_text(encoding="utf-8"), str(path)))
    }
    assert not found, (
        f"compare numbers with kvpatch.patches._numbers (exact, difference, judge), not a literal: {found}"
    )


@pytest.mark.parametrize(
    "source",
    [
        "if err > 1e-4:\n    pass",
        "assert err < -1e-4",
        "assert 0.5 >= err",
        "ok = err <= 0.05 * scale + 1e-3",
        "assert any(err > max(tol, 1e-3) for err, tol in errors)",
        "assert x.item() == 4.0",
        "mx.allclose(a, b, 1e-5)",
        "np.testing.assert_allclose(a, b, atol=1e-6)",
        "assert a == pytest.approx(b, rel=1e-3)",
        "check(a, b, tol=1e-4)",
        "TOL = 1e-4\nassert err < TOL",
        "TOL = {'bf16': 0.08}\nassert err < TOL['bf16']",
        "def close(a, b, tol=1e-4):\n    return abs(a - b) < tol",
        "def close(a, b, *, tol: float = 1e-4):\n    return abs(a - b) < tol",
    ],
)
def test_a_planted_literal_fails(source):
    assert literal_thresholds(source), source


@pytest.mark.parametrize(
    "source",
    [
        "assert len(rows) > 3 and shape == (2, 3)",
        "args = ModelArgs(rms_norm_eps=1e-5, rope_theta=10000.0)",
        "mask = mx.where(keep, 0.0, -1e9)",
        "scores = q * D**-0.5",
        "assert found.within, found",
        "if offset != [0, 3]:\n    pass",
        "keep = mx.random.bernoulli(0.7, shape)",
    ],
)
def test_data_literals_pass(source):
    assert literal_thresholds(source) == [], source


def test_every_unit_and_test_file_is_checked():
    """The walk reaches the units, the shared helpers and the tests (a moved folder would silently pass)."""
    names = {p.relative_to(REPO).as_posix() for p in _checked_files()}
    assert "kvpatch/patches/_rows.py" in names and "kvpatch/patches/mlx_vlm/glm4v_batch_positions.py" in names
    assert "tests/upstream/test_regressions.py" in names and "tests/engine/test_numbers_lint.py" in names
