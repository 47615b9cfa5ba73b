"""Tool call arguments as a small model writes them, made fit for the tool or refused.

Models write `"limit": "5"` for an integer and `"exact": "true"` for a boolean; the
scalar values are coerced to the types the schema names, then the whole object is
validated with jsonschema.  A call that still does not fit is never executed: the model
is told what was wrong and the shape that was expected, and can try again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

__all__ = ["ArgumentsError", "expected_shape", "prepare_arguments"]


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


def _coerce(value: Any, schema: Mapping[str, Any]) -> Any:
    types = _types(schema)
    if not types or isinstance(value, (dict, list)):
        return value
    if isinstance(value, str):
        text = value.strip()
        if "integer" in types:
            try:
                return int(text)
            except ValueError:
                pass
        if "number" in types:
            try:
                return float(text)
            except ValueError:
                pass
        if "boolean" in types and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if "null" in types and text.lower() in ("null", "none"):
            return None
        return value
    if "string" in types and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if "integer" in types and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


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


def prepare_arguments(tool: str, raw: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    """Parse, coerce and validate a call's arguments; `ArgumentsError` names the problem."""
    shape = expected_shape(schema)
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ArgumentsError(
            f"the arguments for tool '{tool}' are not valid JSON ({exc.msg}); "
            f"expected a JSON object {shape}"
        ) from None
    if not isinstance(args, dict):
        raise ArgumentsError(
            f"the arguments for tool '{tool}' must be a JSON object {shape}, "
            f"not {type(args).__name__}"
        )
    props = schema.get("properties")
    if isinstance(props, Mapping):
        args = {k: _coerce(v, props[k]) if k in props else v for k, v in args.items()}
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
