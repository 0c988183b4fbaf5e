"""The hunt's parts that need no mlx: how a finding's candidate patches are read from the registry, how a
reproduction is measured, which findings are attributed together, documented behaviour, tiny configs by field name,
and where hypothesis is installed (unit tier)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypothesis", reason="the bug hunt needs hypothesis (the test dependency group)")

from kvpatch.maint.hunt import attribute, cli, gaps, intended, models, report, repro
from kvpatch.registry import load

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """\
# a reproduction
import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache


cache = BatchKVCache(left_padding=[1, 0])
"""


def test_candidates_are_the_applicable_patches_on_the_classes_a_reproduction_names():
    patches = load().patches
    names = attribute.candidates(SCRIPT, patches, {"mlx-lm": "0.31.3", "mlx-vlm": None})
    assert "batch-trim-capped" in names and "offset-rebind" in names  # BatchKVCache targets, in range on 0.31.3
    assert "qsdpa-gqa-batch-mask" in names  # a module-level function of mlx_lm.models.base
    assert "mask-fill" not in names  # mlx-lm < 0.24.0 only
    assert "rotating-merge-empty" not in names  # BatchRotatingKVCache: not named by the script
    assert not [n for n in names if next(p for p in patches if p.id == n).distribution == "mlx-vlm"]
    old = attribute.candidates(SCRIPT, patches, {"mlx-lm": "0.22.0"})
    assert {"mask-fill", "qsdpa-gqa-batch-mask"} <= set(old) and "batch-trim-capped" not in old


def test_model_level_candidates_take_every_target_of_the_modules_a_model_reaches():
    patches = load().patches
    script = "from mlx_lm.models import gemma3n as arch\nfrom mlx_lm.generate import BatchGenerator\n"
    plain = attribute.candidates(script, patches, {"mlx-lm": "0.31.3"})
    whole = attribute.candidates(script, patches, {"mlx-lm": "0.31.3"}, ("mlx_lm.models.cache",))
    assert "rotating-merge-empty" not in plain and "rotating-merge-empty" in whole


def test_reproduction_length_counts_lines_of_code_only():
    text = '# comment\n"""doc\nstring"""\n\nimport mlx.core as mx\n\n\ndef f():\n    """one line"""\n    return 1\n'
    assert repro.length(text) == 3


def test_findings_are_attributed_together_only_when_their_signatures_match():
    a = {"signature": ["m.C", "rows-agree", "decode", "", ""], "hunts": ["off"]}
    b = dict(a, signature=["m.C", "rows-agree", "update", "", ""])
    c = dict(a, signature=["m.C", "rows-agree", "filter", "", ""])
    d = dict(a, signature=["m.C", "no-crash", "update", "ValueError", "shape (#,#)"])
    e = dict(a, signature=["m.C", "no-crash", "update", "ValueError", "a str"])
    assert cli.kinship(a) == cli.kinship(b) != cli.kinship(c)
    assert cli.kinship(d) != cli.kinship(e)
    assert cli.kinship(a) != cli.kinship(dict(a, hunts=["off", "on"]))


def test_documented_behaviour_matches_by_class_invariant_and_detail():
    finding = {
        "target": "mlx_lm.models.cache.BatchRotatingKVCache",
        "invariant": "no-crash",
        "detail": "RuntimeError: finalize() should be called before deocoding with BatchRotatingKVCache",
    }
    assert intended.match(finding)
    assert intended.match(dict(finding, target="mlx_lm.models.cache.BatchKVCache")) is None
    assert intended.match(dict(finding, invariant="rows-agree")) is None


@dataclasses.dataclass
class _Config:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    activation_sparsity_pattern: list[float]
    unknown_count: int
    rope_scaling: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"type": "mrope", "mrope_section": [16, 24, 24]}
    )
    vocab_size: int = 262144


def test_tiny_configs_come_from_field_names():
    args = models.tiny(_Config, "demo")
    layers = models.TINY["num_hidden_layers"]
    assert args["model_type"] == "demo" and args["hidden_size"] == models.TINY["hidden_size"]
    assert args["vocab_size"] == models.TINY["vocab_size"]  # a default that is not tiny is shrunk too
    assert args["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"][:layers]
    assert len(args["activation_sparsity_pattern"]) == layers and not any(args["activation_sparsity_pattern"])
    assert args["unknown_count"] == models.BY_TYPE["int"]
    sections = args["rope_scaling"]["mrope_section"]
    assert sum(sections) == models.TINY["head_dim"] // 2 and len(sections) == 3


@dataclasses.dataclass
class _Sizes:
    altup_num_inputs: int
    altup_active_idx: int
    linear_conv_kernel_dim: int


def test_tiny_configs_keep_the_sizes_a_forward_pass_indexes_with():
    # required ints default to 1: gemma3n's active AltUp stream would index past its streams (an out-of-bounds read
    # whose garbage differs batched), a gated-delta kernel of 1 keeps every column as convolution state
    args = models.tiny(_Sizes, "demo")
    assert 0 <= args["altup_active_idx"] < args["altup_num_inputs"]
    assert args["linear_conv_kernel_dim"] > 1


def test_generation_alone_is_a_prompt_then_a_token_for_mlx_vlm_too():
    from kvpatch.maint.hunt.tape import Tape

    # a language model whose decode step fails alone: not covered, never a batched model-runs finding
    tape = Tape(
        ["import types", "mx = types.SimpleNamespace(array=list, float32=None)", "make_prompt_cache = lambda model: []"]
    )
    tape.run(
        "def model(tokens, cache):\n"
        "    cache.append(tokens)\n"
        "    if len(cache) > 1:\n"
        "        raise ValueError('[reshape] the decode step')"
    )
    tape.run("make = lambda: model")  # a fresh model (here the same function) for the run alone
    why = models._alone_runs("mlx_vlm", tape, [[3, 4, 5]])
    assert why is not None and "the decode step" in why
    assert tape.lines == ["def model(tokens, cache):\n    cache.append(tokens)\n    if len(cache) > 1:\n"
                          "        raise ValueError('[reshape] the decode step')", "make = lambda: model"]  # fmt: skip


def test_hypothesis_is_a_test_dependency_never_a_runtime_one():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert not [d for d in pyproject["project"]["dependencies"] if d.startswith("hypothesis")]
    assert [d for d in pyproject["dependency-groups"]["test"] if d.startswith("hypothesis")]


def test_a_probe_is_the_reproduction_last_step_on_the_cache_itself():
    from kvpatch.maint.hunt.machine import Caught, Violation
    from kvpatch.maint.hunt.tape import PROBE

    lines = [
        "cache = C()",
        "rows = [R()]",
        "cache.filter([0])",
        PROBE,
        "probe.finalize()",
        "x = step(probe, probe_rows)",
    ]
    violation = Violation("rows-agree", "off by 1", "filter", (), "m.C", check=["assert ok"])
    body = repro.body(Caught(violation, [], lines))
    assert body == ["cache = C()", "rows = [R()]", "cache.filter([0])", "cache.finalize()", "x = step(cache, rows)",
                    "assert ok"]  # fmt: skip


def test_a_verdict_credits_the_patches_it_names():
    assert attribute.fixed_by("fixed by batch-trim-capped") == ["batch-trim-capped"]
    assert attribute.fixed_by("fixed by a-b and c (each alone)") == ["a-b", "c"]
    assert attribute.fixed_by("fixed by x (with kvpatch on it then fails otherwise: y)") == ["x"]
    assert attribute.fixed_by("fixed by kvpatch (several of a, b)") == []
    assert attribute.fixed_by("new") == []


def _result(bucket: str, releases: dict[str, str], findings: list[dict[str, Any]]) -> dict[str, Any]:
    hunts = {"off": {"not_hunted": {}}, "on": {"not_hunted": {}}}
    return {"schema": "kvpatch.hunt/1", "bucket": bucket, "releases": releases, "budget": 30.0, "hunts": hunts,
            "findings": findings, "seconds": {"hunt": 1.0, "total": 2.0}}  # fmt: skip


def _finding(target: str, verdict: str, length: int, hunts: tuple[str, ...] = ("off",)) -> dict[str, Any]:
    return {"target": target, "invariant": "no-crash", "operation": "merge", "detail": "x", "length": length,
            "signature": [target, "no-crash", "merge", "TypeError", "msg"], "hunts": list(hunts),
            "attribution": {"verdict": verdict}}  # fmt: skip


def test_the_report_counts_only_what_the_hunt_attributed_and_writes_its_sections(tmp_path):
    patches = load().patches
    reachable = [p.id for p in patches if report.reachable(p)]
    assert "batch-merge-empty" in reachable and "qsdpa-cuda-shapes" not in reachable  # a CUDA kernel
    assert "speculative-stale-cache" not in reachable and "max-kv-size-ignored" not in reachable  # generation
    by_id = {p.id: p for p in patches}
    assert report.from_the_hunt(by_id["gemma2-batch-mask"]) and not report.from_the_hunt(by_id["batch-merge-empty"])
    cache = "mlx_lm.models.cache.BatchKVCache"
    results = [
        _result("lm-0.28.4", {"mlx-lm": "0.28.4"}, [
            _finding(cache, "fixed by batch-merge-empty", 6),
            _finding(cache, "fixed by batch-merge-empty", 9),
            _finding(cache, "fixed by batch-trim-capped", 5, hunts=("on",)),  # not found with kvpatch off
            _finding("mlx_lm.models.cache.Other", "new", 7, hunts=("off", "on")),
        ]),
    ]  # fmt: skip
    rows, hit, total = report.rediscovered(results, patches)
    assert hit == 1 and total == len(reachable)
    merge = next(r for r in rows if r[0] == "batch-merge-empty")
    assert merge[1] == "no-crash" and merge[3] == "6" and merge[4] == "lm-0.28.4"
    trim = next(r for r in rows if r[0] == "batch-trim-capped")
    assert trim[1].startswith("not rediscovered: not found in 1 hunts")
    assert next(r for r in rows if r[0] == "mask-fill")[1].startswith("not rediscovered: no bucket of its range")
    new = report.new_findings(results, [])
    assert len(new) == 1 and new[0][0].startswith("mlx_lm Other: no-crash after merge") and new[0][3] == "undocumented"
    page = tmp_path / "page.md"
    page.write_text(
        "a: prose names `<!-- hunt:gaps -->` and `<!-- hunt:new -->`\n<!-- hunt:new -->\nold\n<!-- /hunt:new -->\n"
        "b\n<!-- hunt:buckets -->\n<!-- hunt:rediscovered -->\n"
        "<!-- hunt:gaps -->\n| target | invariant | detail | releases | reason |\n|---|---|---|---|---|\n"
        "| `\\.Other$` | no-crash | `^merge: x$` | >=0.28.0,<0.30.0 | upstream's, because \\| reasons |\n\nafter\n"
    )
    documented = gaps.read(page)
    assert documented == [
        gaps.Gap(r"\.Other$", "no-crash", "^merge: x$", ">=0.28.0,<0.30.0", "upstream's, because | reasons")
    ]
    assert report.new_findings(results, documented)[0][3] == "documented gap: upstream's, because | reasons"
    later = [*results, _result("lm-0.31.3", {"mlx-lm": "0.31.3"}, [_finding("mlx_lm.models.cache.Other", "new", 7)])]
    assert report.new_findings(later, documented)[0][3] == "undocumented"  # found outside the gap's releases too
    report.write(page, report.sections(results, patches, documented))
    text = page.read_text()
    assert "old" not in text and "`\n<!-- hunt:new -->\n| finding" in text and "\nb\n" in text
    assert text.count("<!-- /hunt:rediscovered -->") == 1 and "1 of" in text and text.endswith("\nafter\n")
    report.write(page, report.sections(results, patches, gaps.read(page)))
    assert page.read_text() == text  # regenerating changes nothing
