"""Tool calls a model wrote as text, recovered into structured calls.

Small open models served without a tool-call parser answer with the call in the text:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen),
`<|python_tag|>{"name": ..., "parameters": {...}}` (Llama 3.x), or the bare JSON object,
sometimes in a ```json fence.  Only names of tools that were offered are recovered, so
an answer that merely quotes JSON stays an answer.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from typing import Any

from activities.contract import ToolCall

__all__ = ["recover_tool_calls"]

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _candidates(text: str) -> list[str]:
    tagged = _TAGGED.findall(text)
    if tagged:
        return tagged
    body = text.strip().removeprefix("<|python_tag|>").strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    return [part for part in body.split(";") if part.strip()] if body.startswith("{") else []


def _call(obj: Any, offered: Collection[str]) -> tuple[str, str] | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or name not in offered:
        return None
    if isinstance(args, str):
        return name, args
    return name, json.dumps(args)


def recover_tool_calls(text: str, offered: Collection[str], salt: str = "") -> list[ToolCall]:
    """The tool calls written in `text`, or [] when it is an answer.  `salt` (the run and
    turn) keeps ids unique when a model writes the same call twice in one run."""
    calls: list[ToolCall] = []
    for i, candidate in enumerate(_candidates(text)):
        try:
            obj = json.loads(candidate)
        except ValueError:
            return []
        found = _call(obj, offered)
        if found is None:
            return []
        digest = hashlib.blake2b(f"{salt}\0{i}\0{candidate}".encode(), digest_size=8).hexdigest()
        calls.append(ToolCall(id=f"call_recovered_{digest}", name=found[0], arguments=found[1]))
    return calls
