"""``struct``: ``dataclasses.dataclass`` for the classes on kvpatch's import path, without generating code.

kvpatch is imported inside every ``import mlx_lm`` of an environment. On Python 3.10-3.12 ``@dataclass``
compiles each generated method from source (``exec``): the 11 record classes the import path defines cost
7.6-7.8 ms of it here (2 cores, Python 3.11), more than half of importing kvpatch's own modules. ``struct``
gives the same class behaviour from plain functions over the field table instead:

* ``__init__`` with the fields as positional or keyword parameters, defaults, ``field(default_factory=...)``
  and ``__post_init__``; the same ``TypeError`` cases (missing, unexpected or repeated arguments);
* ``__repr__`` (``Name(field=value, ...)``, without the ``field(repr=False)`` fields);
* ``eq=True`` (default): ``__eq__`` over the fields for instances of exactly the same class; then
  ``frozen=True`` gives ``__hash__`` over the fields and ``frozen=False`` makes instances unhashable, as
  dataclasses do; ``eq=False`` keeps identity equality and hashing;
* ``frozen=True``: assigning or deleting a field raises ``dataclasses.FrozenInstanceError``.

Not supported (and not used by kvpatch; :func:`struct` raises on them): inheritance from another struct,
``InitVar``, ``ClassVar`` fields, ``field(init=False)``, ``kw_only``, ``order``. ``dataclasses.fields`` and
``dataclasses.replace`` do not apply. Type checkers see ``dataclasses.dataclass`` (this module's
``TYPE_CHECKING`` branch). ``tests/engine/test_struct.py`` compares it with ``dataclass``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["struct"]

_MISSING = dataclasses.MISSING


if TYPE_CHECKING:  # type checkers read the classes as the dataclasses they behave as
    from dataclasses import dataclass as struct
else:

    def struct(cls: type | None = None, /, *, frozen: bool = False, eq: bool = True) -> Any:
        """Class decorator: see the module docstring."""

        def wrap(cls: type) -> type:
            return _build(cls, frozen=frozen, eq=eq)

        return wrap if cls is None else wrap(cls)


def _fields(cls: type) -> list[tuple[str, Any, Any, bool]]:
    """``[(name, default, default_factory, shown in repr)]`` in declaration order; class attributes that held
    a default are set to it (as dataclasses leave them), ``field()`` objects without one are removed."""
    for base in cls.__mro__[1:]:
        if "__struct_fields__" in vars(base) or dataclasses.is_dataclass(base):
            raise TypeError(f"{cls.__qualname__}: struct does not support inheriting fields ({base.__qualname__})")
    table: list[tuple[str, Any, Any, bool]] = []
    for name, annotation in vars(cls).get("__annotations__", {}).items():
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
        if "ClassVar" in text or "InitVar" in text:
            raise TypeError(f"{cls.__qualname__}.{name}: struct does not support ClassVar / InitVar")
        value = vars(cls).get(name, _MISSING)
        default: Any = value
        factory: Any = _MISSING
        shown = True
        if isinstance(value, dataclasses.Field):
            if not value.init or value.kw_only is True:
                raise TypeError(f"{cls.__qualname__}.{name}: struct does not support init=False / kw_only")
            default, factory, shown = value.default, value.default_factory, value.repr
            if default is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, default)
        if isinstance(default, (list, dict, set)):
            raise ValueError(f"mutable default {type(default)} for field {name} is not allowed: use default_factory")
        if default is _MISSING and factory is _MISSING and table and (table[-1][1], table[-1][2]) != (_MISSING,) * 2:
            raise TypeError(f"non-default argument {name!r} follows default argument")
        table.append((name, default, factory, shown))
    return table


def _build(cls: type, *, frozen: bool, eq: bool) -> type:
    table = _fields(cls)
    names = tuple(row[0] for row in table)
    known = frozenset(names)
    count = len(table)
    qualname = cls.__qualname__
    put: Callable[[Any, str, Any], None] = object.__setattr__
    post_init = "__post_init__" in dir(cls)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > count:
            raise TypeError(
                f"{qualname}.__init__() takes {count + 1} positional arguments but {len(args) + 1} were given"
            )
        if kwargs:
            unknown = [k for k in kwargs if k not in known]
            if unknown:
                raise TypeError(f"{qualname}.__init__() got an unexpected keyword argument {unknown[0]!r}")
        for i, (name, default, factory, _) in enumerate(table):
            if i < len(args):
                if name in kwargs:
                    raise TypeError(f"{qualname}.__init__() got multiple values for argument {name!r}")
                value = args[i]
            elif name in kwargs:
                value = kwargs[name]
            elif default is not _MISSING:
                value = default
            elif factory is not _MISSING:
                value = factory()
            else:
                raise TypeError(f"{qualname}.__init__() missing 1 required positional argument: {name!r}")
            put(self, name, value)
        if post_init:
            self.__post_init__()

    shown = tuple(row[0] for row in table if row[3])

    def __repr__(self: Any) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in shown)
        return f"{type(self).__qualname__}({inner})"

    methods: dict[str, Any] = {"__init__": __init__, "__repr__": __repr__, "__struct_fields__": names}
    if eq:

        def __eq__(self: Any, other: object) -> bool:
            if other.__class__ is self.__class__:
                return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)
            return NotImplemented

        methods["__eq__"] = __eq__
        if frozen:

            def __hash__(self: Any) -> int:
                return hash(tuple(getattr(self, n) for n in names))

            methods["__hash__"] = __hash__
        elif "__hash__" not in vars(cls):
            methods["__hash__"] = None
    if frozen:

        def __setattr__(self: Any, name: str, value: Any) -> None:
            if type(self) is cls or name in known:
                raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
            object.__setattr__(self, name, value)

        def __delattr__(self: Any, name: str) -> None:
            if type(self) is cls or name in known:
                raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
            object.__delattr__(self, name)

        methods["__setattr__"] = __setattr__
        methods["__delattr__"] = __delattr__
    for attr, method in methods.items():
        if callable(method):
            method.__qualname__ = f"{qualname}.{attr}"
        setattr(cls, attr, method)
    return cls
