"""What the tool-call formats that write values their own way (server/tools_xml.py, server/tools_gemma.py) read of a
tool's JSON schema: a property's schema with its references followed, and the JSON types it takes.
"""

from __future__ import annotations

# The root keywords a reference may point into (JSON schema's, and the older draft's that pydantic v1 and zod write).
DEFINITIONS = ("$defs", "definitions")


def property_schema(prop, root: dict) -> dict:
    """A property's schema with its references into the arguments' schema (``root``) replaced by what they point to;
    where that cannot be done (a reference that recurs, or points outside ``root``), the property's own schema with
    ``root``'s definitions beside it, which a JSON grammar resolves itself."""
    if not isinstance(prop, dict):
        return {}
    try:
        return _inline(prop, root, ())
    except ValueError:
        return {**prop, **{key: root[key] for key in DEFINITIONS if key in root}}


def _inline(node, root: dict, seen: tuple[str, ...]):
    if isinstance(node, list):
        return [_inline(item, root, seen) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#") or ref in seen:
            raise ValueError(f"cannot inline {ref}")
        target = _pointer(root, ref[1:])
        return _inline({**target, **{k: v for k, v in node.items() if k != "$ref"}}, root, (*seen, ref))
    return {key: value if key in DEFINITIONS else _inline(value, root, seen) for key, value in node.items()}


def _pointer(root: dict, pointer: str) -> dict:
    """The part of ``root`` a JSON pointer (``/definitions/A``) names; ValueError where there is none."""
    node = root
    for part in filter(None, pointer.split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"no {pointer} in the schema")
    if not isinstance(node, dict):
        raise ValueError(f"{pointer} is no schema")
    return node


def union_branches(schema: dict) -> list[dict]:
    """A schema's ``anyOf`` and ``oneOf`` branches (none where it is no such union)."""
    return [branch for key in ("anyOf", "oneOf") for branch in schema.get(key) or () if isinstance(branch, dict)]


def listed_values(schema: dict) -> list | None:
    """The values a schema lists: its ``enum``'s, or its ``const``; None where it lists none."""
    return schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)


def json_kinds(schema: dict) -> frozenset[str] | None:
    """The JSON types a schema (references followed) takes: its ``type``, its enum's or const's values', the union
    of its ``anyOf`` / ``oneOf`` branches, what its ``allOf`` branches share; None where it says none (any value)."""
    kinds: set[str] = set()
    said = False
    kind = schema.get("type")
    if isinstance(kind, str) or isinstance(kind, list):
        kinds.update([kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)])
        said = True
    elif "enum" in schema or "const" in schema:
        values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema.get("const")]
        kinds.update(_json_kind(value) for value in values)
        said = True
    for key in ("anyOf", "oneOf"):
        branches = [json_kinds(branch) for branch in schema.get(key) or () if isinstance(branch, dict)]
        if branches:
            if None in branches:
                return None
            kinds.update(*branches)
            said = True
    shared = [json_kinds(branch) for branch in schema.get("allOf") or () if isinstance(branch, dict)]
    shared = [branch for branch in shared if branch is not None]
    if shared:
        kinds = set.intersection(*(set(branch) for branch in shared), *([kinds] if said else []))
        said = True
    return frozenset(kinds) if said else None


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "string")
