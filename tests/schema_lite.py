"""A JSON Schema validator for the subset kvpatch's published schemas use (draft 2020-12 semantics).

Supported keywords: type, const, enum, properties, required, additionalProperties, items, minimum, $ref
(to ``#/$defs/...``); annotations ($schema, $id, $defs, title, description) are ignored.
:func:`unsupported` lists any other keyword a schema uses, so that a schema never relies on a
keyword this validator would silently skip (a test asserts it is empty).
"""

from __future__ import annotations

from typing import Any

SUPPORTED = frozenset(
    {"type", "const", "enum", "properties", "required", "additionalProperties", "items", "minimum", "$ref"}
)
ANNOTATIONS = frozenset({"$schema", "$id", "$defs", "title", "description", "examples"})

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def unsupported(schema: Any, where: str = "#") -> list[str]:
    """Keywords in ``schema`` that :func:`validate` does not implement."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    for key, value in schema.items():
        if key not in SUPPORTED and key not in ANNOTATIONS:
            found.append(f"{where}/{key}")
        if key in ("properties", "$defs") or (key == "additionalProperties" and isinstance(value, dict)):
            children = value.items() if key != "additionalProperties" else [("", value)]
            for name, sub in children:
                found += unsupported(sub, f"{where}/{key}/{name}".rstrip("/"))
        elif key == "items":
            found += unsupported(value, f"{where}/items")
    return found


def validate(instance: Any, schema: dict[str, Any], root: dict[str, Any] | None = None, path: str = "$") -> list[str]:
    """Every violation of ``schema`` by ``instance`` (an empty list: valid)."""
    root = schema if root is None else root
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            return [f"{path}: unsupported $ref {ref}"]
        return validate(instance, root["$defs"][ref.removeprefix("#/$defs/")], root, path)
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](instance) for t in types):
            return [f"{path}: {instance!r:.80} is not of type {' | '.join(types)}"]
    if "const" in schema and instance != schema["const"]:
        errors.append(f"{path}: {instance!r:.80} is not {schema['const']!r}")
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: {instance!r:.80} is not one of {schema['enum']}")
    if "minimum" in schema and _TYPES["number"](instance) and instance < schema["minimum"]:
        errors.append(f"{path}: {instance} < {schema['minimum']}")
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        errors += [f"{path}: missing required key {key!r}" for key in schema.get("required", []) if key not in instance]
        for key, value in instance.items():
            if key in props:
                errors += validate(value, props[key], root, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected key {key!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += validate(value, schema["additionalProperties"], root, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            errors += validate(item, schema["items"], root, f"{path}[{i}]")
    return errors
