"""Tool call arguments as a small model writes them, made fit for the tool or refused.

Models write `"limit": "5"` for an integer and `"exact": "true"` for a boolean; the
scalar values are coerced to the types the schema names, then the whole object is
validated with jsonschema.  A call that still does not fit is never executed: the model
is told what was wrong and the shape that was expected, and can try again.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

__all__ = ["MAX_DEPTH", "ArgumentsError", "depth", "expected_shape", "prepare_arguments"]


class ArgumentsError(ValueError):
    """The arguments cannot be made to fit the tool's input schema; the message says why
    and what shape was expected, for the model to read."""


def _types(schema: Mapping[str, Any]) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for branch in ("anyOf", "oneOf"):
        options = schema.get(branch)
        if isinstance(options, list):
            return [t for o in options if isinstance(o, Mapping) for t in _types(o)]
    return []


def _valid(value: Any, schema: Mapping[str, Any]) -> bool:
    """Whether the value already fits its (sub-)schema: it is then left as it is (a
    `string | integer` "007" stays a string, a `string | null` "None" a string).  A
    sub-schema that cannot be checked alone (a `$ref` to the root's `$defs`) is coerced
    as before."""
    try:
        return bool(jsonschema.validators.validator_for(schema)(schema).is_valid(value))
    except Exception:
        return False


def _coerce(value: Any, schema: Any) -> Any:
    # `true` / `false` sub-schemas: nothing to coerce
    if not isinstance(schema, Mapping) or _valid(value, schema):
        return value
    if isinstance(value, dict):  # an object's own properties, as the top level's
        props = schema.get("properties")
        if isinstance(props, Mapping):
            return {k: _coerce(v, props[k]) if k in props else v for k, v in value.items()}
        return value
    if isinstance(value, list):
        items = schema.get("items")
        return [_coerce(v, items) for v in value] if isinstance(items, Mapping) else value
    types = _types(schema)
    if not types:
        return value
    if isinstance(value, str):
        text = value.strip()
        if "integer" in types and _INTEGER.fullmatch(text) and len(text) <= _DIGITS_MAX:
            return int(text)
        if "number" in types and _DECIMAL.fullmatch(text) and math.isfinite(float(text)):
            return float(text)
        if "boolean" in types and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if "null" in types and text.lower() in ("null", "none"):
            return None
        return value
    if "integer" in types and isinstance(value, float) and value.is_integer():
        return int(value)
    if "string" in types and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


# Numbers as a model writes them in a string (not "1_000", "nan", "inf" or "0x10", which
# Python's int() and float() read but JSON cannot carry on to the tool).
_INTEGER = re.compile(r"-?[0-9]+")
_DIGITS_MAX = 4_300  # what int() reads of a string (sys.get_int_max_str_digits)
_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def _label(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "any"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return " | ".join(json.dumps(v) for v in enum)
    types = _types(schema)
    if "array" in types:
        return f"array of {_label(schema.get('items'))}"
    if "object" in types and isinstance(schema.get("properties"), Mapping):
        return expected_shape(schema)
    return " | ".join(types) or "any"


def expected_shape(schema: Mapping[str, Any]) -> str:
    """A one-line rendering a model can follow: `{"query": string, "limit"?: integer}`."""
    props = schema.get("properties")
    if not isinstance(props, Mapping) or not props:
        return "{}"
    required = schema.get("required")
    required = set(required) if isinstance(required, list) else set()
    parts = [
        f"{json.dumps(name)}{'' if name in required else '?'}: {_label(sub)}"
        for name, sub in props.items()
    ]
    return "{" + ", ".join(parts) + "}"


def _no_constant(name: str) -> Any:
    """`NaN` and `Infinity` are Python's JSON, not JSON: no tool could be sent them."""
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def _finite(text: str) -> float:
    """A JSON number Python can carry on as JSON: `1e400` would become `inf`."""
    value = float(text)
    if not math.isfinite(value):
        raise json.JSONDecodeError(f"{text} is too large for a number", text, 0)
    return value


# How deep a call's arguments may nest.  Temporal's converter recurses about twice a
# level and fails past about 450: a call nested deeper could not be carried (nor its
# approval question shown: helper-182).  No tool's input needs a tenth of this.
MAX_DEPTH = 64


def depth(value: Any) -> int:
    """How deeply a JSON value nests its arrays and objects (a scalar: 0)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, level)
        todo.extend((child, level + 1) for child in children)
    return deepest


def prepare_arguments(tool: str, raw: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    """Parse, coerce and validate a call's arguments; `ArgumentsError` names the problem."""
    shape = expected_shape(schema)
    try:
        args = (
            json.loads(raw, parse_constant=_no_constant, parse_float=_finite) if raw.strip() else {}
        )
    except json.JSONDecodeError as exc:
        raise ArgumentsError(
            f"the arguments for tool '{tool}' are not valid JSON ({exc.msg}); "
            f"expected a JSON object {shape}"
        ) from None
    except RecursionError:
        raise ArgumentsError(
            f"the arguments for tool '{tool}' are nested too deeply; expected a JSON object {shape}"
        ) from None
    except ValueError as exc:  # an integer past Python's 4,300 digits (helper-160)
        raise ArgumentsError(
            f"the arguments for tool '{tool}' could not be read ({exc}); "
            f"expected a JSON object {shape}"
        ) from None
    if not isinstance(args, dict):
        raise ArgumentsError(
            f"the arguments for tool '{tool}' must be a JSON object {shape}, "
            f"not {type(args).__name__}"
        )
    if depth(args) > MAX_DEPTH:
        raise ArgumentsError(
            f"the arguments for tool '{tool}' are nested too deeply (past {MAX_DEPTH} "
            f"levels); expected a JSON object {shape}"
        )
    try:  # what the MCP SDK will do to send them
        json.dumps(args, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        # Valid JSON text ("\ud83d"), but half a character: no UTF-8 carries it, so the
        # call could never be sent (helper-114: taken for an unreachable server and
        # sent again for 15 minutes).  The model can write the character whole.
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise ArgumentsError(
            f"the arguments for tool '{tool}' contain half of a character ({bad}, a lone "
            f"UTF-16 surrogate) that cannot be sent; write the character whole"
        ) from None
    args = dict(_coerce(args, schema))
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = best_match(validator.iter_errors(args))
    except jsonschema.SchemaError as exc:
        raise ArgumentsError(f"tool '{tool}' has an invalid input schema: {exc.message}") from None
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        at = f" at '{where}'" if where else ""
        raise ArgumentsError(
            f"the arguments for tool '{tool}' do not fit its input schema{at}: "
            f"{error.message}; expected {shape}"
        )
    return args
