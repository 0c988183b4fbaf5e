"""Issue 11, items 1-5: kvpatch next to the real monkey patches of vllm-mlx 0.6.0 and Rapid-MLX 0.16.10.

Both import orders: ``kvpatch-first`` (the installed bootstrap activates kvpatch when mlx_lm is
imported, then the server patches on top) and ``server-first`` (the server patches upstream, then
kvpatch activates late). Every scenario runs in a fresh interpreter (``scenarios.py``).

- item 1: ``status``/``records()``/``require_applied()`` tell the truth when a server replaced kvpatch's
  replacement without calling it (vllm-mlx's ``patch_mlx_lm_for_mamba`` and ``_make_cache``).
- item 2: ``deactivate()``, ``suspend()``, ``kvpatch.testing.without`` and an in-process ``status
  --verify`` never put upstream's original over a server's wrapper (Rapid-MLX's slot guard on
  ``PromptProcessingBatch.extend`` and its quantized-SDPA wrapper; vllm-mlx's ``_make_cache``).
- item 3: a server's own fix underneath kvpatch is not credited to upstream (no "update the record").
- item 4: a verify that cannot run (vllm-mlx's ``_merge_caches`` breaks ``BatchGenerator``) is not
  reported as "bug absent upstream", and is a ``--check`` failure.
- item 5: module-level copies outside mlx_lm/mlx_vlm (``vllm_mlx.specprefill.make_prompt_cache``) follow
  activation and deactivation.

vllm-mlx's ``patch_mlx_lm_for_mamba`` is dead code in vllm-mlx itself (``ensure_mamba_support()`` only logs):
items 1-2 use it as a real foreign replacement of kvpatch's targets, not as the server's behaviour. The
code vllm-mlx runs is tested at the end (issue 29 item 7): its None-slot sanitizer, its bounding and its
metadata sweep (not needed with kvpatch's churn-metadata-detach), each next to kvpatch; Rapid-MLX's live patches (the slot guard and the quantized-SDPA
wrapper) are the ones items 1-2 use.
"""

from __future__ import annotations

import pytest
from coexist_support import needs, run_scenario

ORDERS = ("kvpatch-first", "server-first")
ABSENT = "bug absent upstream"
FIXED = "bug present, fixed by patch"


# -- item 1 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
def test_status_tells_whether_the_fix_is_still_reached(order):
    needs("vllm-mlx")
    r = run_scenario("make_cache", order=order)
    st = r["status"]
    if order == "kvpatch-first":
        # vllm-mlx's _patched_make_cache replaced kvpatch's replacement and never calls it: unbounded again.
        assert not r["bounded"], r
        assert st["state"] == "overridden", r
        assert "overridden by" in st["reason"] and "_patched_make_cache" in st["reason"], r
        assert r["require_applied"] is not None and "max-kv-size-ignored" in r["require_applied"], r
    else:
        # The server replaced upstream's function before kvpatch came, with code that never calls upstream's:
        # kvpatch does not patch blindly over code it never validated (no verdict can vouch for it either:
        # a verification measures upstream's code), says so, and require_applied() fails.
        assert not r["bounded"], r
        assert st["state"] == "drifted", r
        assert "_patched_make_cache" in st["reason"] and "another library's replacement" in st["reason"], r
        assert r["require_applied"] is not None and "max-kv-size-ignored" in r["require_applied"], r
    # The invariant either way: "applied" only while the fix is reached.
    assert (st["state"] == "applied") == r["bounded"], r


def test_status_counts_a_wrapper_that_calls_the_fix_through_its_closure():
    """Rapid-MLX wraps kvpatch's replacements (kvpatch first) and calls them from a closure, with no
    ``__wrapped__``: the fix still runs (the mixed batch decodes), so the patch is not "overridden" and
    ``require_applied()`` passes. (A ``__wrapped__``-only check reports both patches overridden.)"""
    needs("rapid-mlx")
    r = run_scenario("liveness", "rapid-mlx", order="kvpatch-first")
    assert r["mixed_batch_error"] is None, r
    for patch_id, st in r["status"].items():
        assert st["state"] == "applied", f"{patch_id}: the fix is reached through the server's closure: {r}"
    assert r["require_applied"] is None, r


# -- item 2 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("operation", ["deactivate", "suspend", "without", "verify"])
@pytest.mark.parametrize("server", ["vllm-mlx", "rapid-mlx"])
def test_restore_leaves_server_wrappers_in_place(server, operation):
    needs(server)
    r = run_scenario("restore", server, operation, order="kvpatch-first")
    for attribute, wrapper in r["before"].items():
        assert "kvpatch" not in wrapper, r  # the server's wrapper is on top
        assert r["after"][attribute] == wrapper, f"{operation} replaced the server's {attribute}: {r}"
        if r["inside"]:
            assert r["inside"][attribute] == wrapper, f"{operation} took the server's {attribute} away: {r}"
    if server == "rapid-mlx":
        # The crash Rapid-MLX guards against (None logits-processor slots in a mixed batch) stays away.
        assert r["mixed_batch_error"] is None, r


@pytest.mark.parametrize("server", ["vllm-mlx", "rapid-mlx"])
def test_deactivate_after_late_activation_gives_back_the_server_function(server):
    """The other order: kvpatch activated late, on top of the server's functions; deactivate() must put the
    server's functions back (not upstream's)."""
    needs(server)
    r = run_scenario("restore", server, "deactivate", order="server-first")
    for attribute, function in r["server"].items():
        assert "kvpatch" not in function, r
        assert r["after"][attribute] == function, f"deactivate() left {r['after'][attribute]} on {attribute}: {r}"
    if server == "rapid-mlx":
        assert r["mixed_batch_error"] is None, r


# -- items 3 and 4 ---------------------------------------------------------------------------------
def _advice_for(r: dict, patch_id: str) -> list[str]:
    return [reason for reason in r["reasons"] if reason.startswith(f"{patch_id}:")]


@pytest.mark.slow
def test_verify_does_not_credit_a_server_fix_to_upstream():
    """Rapid-MLX guards PromptProcessingBatch.extend and wraps quantized SDPA before kvpatch activates:
    with kvpatch's patch taken out the bug is gone because of Rapid-MLX, not upstream."""
    needs("rapid-mlx")
    r = run_scenario("verify", "rapid-mlx", order="server-first", timeout=1500)
    for patch_id in ("batch-logits-processors", "qsdpa-gqa-batch-mask"):
        outcome = r["patches"][patch_id]["verify"]
        assert outcome != ABSENT, f"{patch_id}: a server's fix credited to upstream: {r}"
        advice = _advice_for(r, patch_id)
        assert not any("update" in a and "record" in a for a in advice), advice


@pytest.mark.slow
def test_verify_that_cannot_run_is_not_a_clean_absent():
    """vllm-mlx's patch_mlx_lm_for_mamba replaces _merge_caches with one that breaks BatchGenerator
    (batch-logits-processors' reproduction runs a BatchGenerator): either the reproduction ran against the
    pristine upstream (a child process / the saved original) and found the bug fixed by the patch, or it
    could not run, which must fail --check without advising a record edit."""
    needs("vllm-mlx")
    r = run_scenario("verify", "vllm-mlx", order="kvpatch-first", timeout=1500)
    outcome = r["patches"]["batch-logits-processors"]["verify"]
    assert outcome != ABSENT, f"an error in the reproduction reported as 'bug absent upstream': {r}"
    advice = _advice_for(r, "batch-logits-processors")
    assert not any("update" in a and "record" in a for a in advice), advice
    if outcome != FIXED:
        assert r["exit"] != 0, f"verify could not run ({outcome}) and --check is clean: {r}"
        assert advice, f"--check gives no reason for batch-logits-processors: {r}"


# -- item 5 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
def test_module_level_copies_outside_upstream_follow(order):
    """vllm_mlx.specprefill does ``from mlx_lm.models.cache import make_prompt_cache``."""
    needs("vllm-mlx")
    r = run_scenario("alias", order=order)
    active, restored = r["active"], r["deactivated"]
    bounded = ["RotatingKVCache", "RotatingKVCache"]
    assert active["owner_layout"] == bounded, r  # max-kv-size-ignored (opted in) is in
    assert active["same"] and active["alias_layout"] == bounded, f"the name-imported copy missed the patch: {r}"
    assert restored["owner_layout"] != bounded, r
    assert restored["same"] and restored["alias_layout"] == restored["owner_layout"], (
        f"the name-imported copy kept kvpatch's replacement after deactivate(): {r}"
    )


# -- issue 29 item 7: vllm-mlx's live hand patches ------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
def test_vllm_sanitizer_does_not_reach_the_pinned_batch_generator_kvpatch_does(order):
    """vllm-mlx's ``_sanitize_batch_generator_logits_processors`` before every step, as ``Scheduler.step`` runs
    it: mlx-lm 0.31.3's BatchGenerator has no ``active_batch`` / ``_partial``, so a mixed batch still dies
    without kvpatch's ``batch-logits-processors`` and decodes with it."""
    needs("vllm-mlx")
    on = run_scenario("vllm_sanitizer", order=order)
    assert on["error"] is None and on["is_fixed"], on
    assert not on["sanitizer_reaches_batch"] and not on["has_active_batch"], on
    off = run_scenario("vllm_sanitizer", order=order, env={"KVPATCH_DISABLE": "batch-logits-processors"})
    assert off["error"] is not None and "not iterable" in off["error"], off
    assert off["is_fixed"] is False, off


@pytest.mark.parametrize("order", ORDERS)
def test_vllm_bounding_and_kvpatch_bounding_agree(order):
    """``Scheduler._bound_cache_layers`` and ``kvpatch.bounded_prompt_cache`` / ``bound_layout`` build the same
    caches (keep=0, CacheList children bounded, non-attention caches kept), and upstream's own
    ``make_prompt_cache`` keeps its documented behaviour (the opt-in is off)."""
    needs("vllm-mlx")
    r = run_scenario("vllm_bounding", order=order, env={"KVPATCH_ENABLE": ""})
    assert r["server_llama"] == r["kvpatch_llama"] == [["RotatingKVCache", 16, 0]] * 2, r
    assert r["server_nested"] == r["kvpatch_nested"], r
    assert r["kvpatch_nested"][0] == ["CacheList", [["RotatingKVCache", 16, 0], ["RotatingKVCache", 128, 0]]], r
    assert r["upstream_unchanged"] == [["KVCache", None, None]] * 2, r


@pytest.mark.parametrize("order", ORDERS)
def test_vllm_metadata_sweep_is_not_needed_with_kvpatch(order):
    """200 cycles of ``MLLMBatch.extend`` (one row) + a decode step + ``MLLMBatch.filter`` (the oldest row):
    the batch cache's offset / left_padding hold no lazy graph with vllm-mlx's ``_sync_reshuffle_metadata``,
    and none without it while kvpatch's churn-metadata-detach is in; with that patch left out, the graph grows
    without the sweep."""
    needs("vllm-mlx")
    r = run_scenario("vllm_sweep", "200", order=order)
    assert r == {"with_sweep": 0, "without_sweep": 0}, r
    off = run_scenario(
        "vllm_sweep", "200", order=order, env={"KVPATCH_DISABLE": "churn-metadata-detach,churn-metadata-detach-vlm"}
    )
    assert off["with_sweep"] == 0, off
    assert off["without_sweep"] > 1000, off
