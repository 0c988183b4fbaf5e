"""Values a careless caller or operator passes: a malformed setting is warned about (and ignored) where it is read,
a wrong argument raises a clear TypeError / ValueError at the call, not later and not as something else."""

from __future__ import annotations

import pytest

import kvpatch
from kvpatch import bounding, config


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("KVPATCH_VERIFY", "nevr", "KVPATCH_VERIFY='nevr' is not understood"),
        ("KVPATCH_VENDORED", "💥,../../etc", "KVPATCH_VENDORED names '💥', '../../etc', not module names"),
    ],
)
def test_a_malformed_setting_is_warned_about(variable, value, said):
    problems = config.read_config({variable: value}).problems
    assert len(problems) == 1 and said in problems[0], problems


def test_vendored_modules_keeps_module_names_only(monkeypatch):
    monkeypatch.setenv("KVPATCH_VENDORED", "1, my.server.cache ,💥,../../etc")
    assert config.vendored_modules() == ["my.server.cache"]
    assert config.read_config({"KVPATCH_VENDORED": "1,my.server.cache"}).problems == ()
    assert config.read_config({"KVPATCH_VERIFY": "never"}).problems == ()


@pytest.mark.parametrize(
    "call",
    [
        lambda: kvpatch.is_fixed(None),
        lambda: kvpatch.is_fixed(["offset-detach"]),
        lambda: kvpatch.require(None),
        lambda: kvpatch.register_copy("my.copy", of="mlx_lm.models.cache", version="0.30.0", patches="offset-detach"),
        lambda: kvpatch.register_copy("my.copy", of="mlx_lm.models.cache", version=0.3),
        lambda: bounding.bounded_prompt_cache(object(), 8, keep=2.5),
        lambda: bounding.bounded_prompt_cache(object(), None, keep="4"),
        lambda: bounding.bound_layout([], None),
        lambda: bounding.bound_layout([], 8.0),
        lambda: bounding.bound_layout([], 8, keep=True),
    ],
    ids=[
        "is_fixed(None)",
        "is_fixed(list)",
        "require(None)",
        "register_copy(patches=str)",
        "register_copy(version=float)",
        "bounded_prompt_cache(keep=2.5)",
        "bounded_prompt_cache(None, keep=str)",
        "bound_layout(None)",
        "bound_layout(8.0)",
        "bound_layout(keep=True)",
    ],
)
def test_a_wrong_type_raises_TypeError_at_the_call(call):
    with pytest.raises(TypeError):
        call()


@pytest.mark.parametrize(
    "call",
    [lambda: bounding.bounded_prompt_cache(object(), 8, keep=8), lambda: bounding.bound_layout([], 0)],
    ids=["keep=max_kv_size", "max_kv_size=0"],
)
def test_a_value_out_of_range_raises_ValueError_at_the_call(call):
    with pytest.raises(ValueError):
        call()
