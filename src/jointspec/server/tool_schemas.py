"""What the tool-call formats that write values their own way (server/tools_xml.py, server/tools_gemma.py,
server/tools_pythonic.py) read of a tool's JSON schema: a property's schema with its references followed, and the
JSON types it takes; and the grammar of values by their schema that Gemma's and LFM2's share (:class:`ValueRules`).
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


class ValueRules:
    """The lark grammar of one tool's values, built rule by rule, each value by its schema (references into ``root``
    followed): a union's branches, the values a schema lists, a list of types, an object's properties, a list's items,
    each kind as a format spells it. A format's subclass names its rules (``prefix``), spells the kinds
    (:meth:`simple`, :meth:`literal`, :meth:`pair`, ``separator``, ``any_value``) and orders an object's properties
    (:meth:`ordered`)."""

    prefix = "v"
    separator = '", "'  # (between two items or pairs)
    any_value = "value"  # (the rule of any value: what a schema that says nothing more takes)

    def __init__(self, index: int, root: dict) -> None:
        self.index, self.root = index, root
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"{self.prefix}{self.index}_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: dict) -> str:
        """The grammar of a value ``schema`` takes (its branches', its listed values, its type's)."""
        schema = property_schema(schema, self.root)
        branches = union_branches(schema)
        if branches:
            return "(" + " | ".join(self.value(branch) for branch in branches) + ")"
        values = listed_values(schema)
        if values and self.lists(values):
            return "(" + " | ".join(self.literal(value) for value in values) + ")"
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return "(" + " | ".join(self.value({**schema, "type": one}) for one in kind) + ")"
        if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
            return self.rule(f'"{{" {self.pairs(schema)} "}}"')
        if kind == "array" and isinstance(schema.get("items"), dict):
            item = self.value(schema["items"])
            return self.rule(f'"[" ({item} ({self.separator} {item})*)? "]"')
        return self.simple(kind) or self.any_value

    def pairs(self, schema: dict) -> str:
        """An object's properties (in :meth:`ordered`'s order) as pairs, the required ones always."""
        return self.sequence({key: self.pair(key, prop) for key, prop in self.ordered(schema["properties"])},
                             set(schema.get("required") or ()))

    def sequence(self, pairs: dict[str, str], required: set[str]) -> str:
        """``pairs`` (each key's grammar) in their order, the ``required`` ones always, ``separator`` between two: a
        rule that may match nothing where none is required."""
        # tail: the pairs from here on, each after a separator; first: the same, the first of them without one
        tail, first = "", ""
        for name, pair in reversed(pairs.items()):
            after = f" {tail}" if tail else ""
            if name in required:
                first = self.rule(f"{pair}{after}")
            else:
                first = self.rule(f"{pair}{after} | {first}" if first else f"({pair}{after})?")
            tail = self.rule(f"{self.separator} {pair}{after}" if name in required
                             else f"({self.separator} {pair})?{after}")
        return first

    def lists(self, values: list) -> bool:
        """Whether the grammar holds a value to these listed values (else to its type)."""
        return True

    def ordered(self, properties: dict) -> list[tuple[str, dict]]:
        """An object's properties in the order the format writes them."""
        return list(properties.items())

    def simple(self, kind) -> str | None:
        """The grammar of a value of JSON type ``kind`` that is neither object nor list (None: any value)."""
        raise NotImplementedError

    def literal(self, value) -> str:
        """A listed value as the format spells it."""
        raise NotImplementedError

    def pair(self, key: str, prop: dict) -> str:
        """An object's property and its value as the format spells them."""
        raise NotImplementedError
