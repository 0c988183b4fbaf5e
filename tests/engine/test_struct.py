"""kvpatch._kvstruct.struct behaves as dataclasses.dataclass for what kvpatch's record classes use."""

from __future__ import annotations

import dataclasses
from dataclasses import field

import pytest

from kvpatch._kvstruct import struct


def _pair(**options):
    """The same class body decorated both ways."""

    def body():
        class Thing:
            a: int
            b: str = "x"
            c: list[int] = field(default_factory=list)
            d: object = field(default=None, repr=False)

            def __post_init__(self) -> None:
                seen.append(self.a)

            @property
            def doubled(self) -> int:
                return 2 * self.a

        return Thing

    seen: list[int] = []
    return dataclasses.dataclass(**options)(body()), struct(**options)(body()), seen


@pytest.mark.parametrize("options", [{}, {"frozen": True}, {"eq": False}])
def test_same_behaviour_as_dataclass(options):
    ref, mine, seen = _pair(**options)
    for cls in (ref, mine):
        one, two = cls(1), cls(1, "y", [2], d=3)
        assert (one.a, one.b, one.c, one.d, one.doubled) == (1, "x", [], None, 2)
        assert (two.a, two.b, two.c, two.d) == (1, "y", [2], 3)
        assert cls(a=1, b="y", c=[2], d=3).b == "y"
        assert cls(1).c is not cls(1).c  # a fresh default per instance
    assert seen == [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    assert repr(mine(1, "y")).replace(mine.__qualname__, "T") == repr(ref(1, "y")).replace(ref.__qualname__, "T")
    for cls in (ref, mine):
        eq = options.get("eq", True)
        assert (cls(1) == cls(1)) is eq
        assert cls(1) != cls(2)
        if eq and options.get("frozen"):
            assert hash(cls(1, "y", ())) == hash(cls(1, "y", ()))
        elif eq:
            with pytest.raises(TypeError):
                hash(cls(1))
        else:
            assert hash(cls(1)) != hash(cls(1)) or cls(1) is not cls(1)
        if options.get("frozen"):
            with pytest.raises(dataclasses.FrozenInstanceError):
                cls(1).a = 2
            with pytest.raises(dataclasses.FrozenInstanceError):
                del cls(1).a
        else:
            thing = cls(1)
            thing.a = 5
            assert thing.a == 5


@pytest.mark.parametrize(
    "call",
    [lambda c: c(), lambda c: c(1, b="y", zz=2), lambda c: c(1, a=2), lambda c: c(1, "y", [], None, 5)],
    ids=["missing", "unexpected", "repeated", "too-many"],
)
def test_same_type_errors(call):
    ref, mine, _ = _pair()
    with pytest.raises(TypeError):
        call(ref)
    with pytest.raises(TypeError):
        call(mine)


def test_rejects_what_it_does_not_support():
    with pytest.raises(ValueError):

        @struct
        class Shared:
            a: list[int] = []  # noqa: RUF012

    with pytest.raises(TypeError):

        @struct
        class Order:
            a: int = 1
            b: int

    @struct
    class Base:
        a: int

    with pytest.raises(TypeError):

        @struct
        class Child(Base):
            b: int = 0


def test_kvpatch_records_are_structs_not_dataclasses():
    """The import path defines no dataclass (each costs ~0.7 ms of every ``import mlx_lm`` on Python 3.11)."""
    from kvpatch import config, detect, engine, gate, record, surgery, verdicts

    for module in (config, detect, engine, gate, record, surgery, verdicts):
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__:
                assert not dataclasses.is_dataclass(value), f"{module.__name__}.{value.__qualname__}"
