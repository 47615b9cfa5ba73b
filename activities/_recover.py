"""Tool calls a model wrote as text, recovered into structured calls.

Small open models served without a tool-call parser answer with the call in the text:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen),
`<|python_tag|>{"name": ..., "parameters": {...}}<|eom_id|>` (Llama 3.x),
`[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name[ARGS]{...}`
(Mistral, before and after its v11 tokenizer; what comes before the first marker is the
model's words, as for `<tool_call>`), or bare JSON — one object, several (on lines, or
between `;`), or an array of them — sometimes in a ```json fence.  A reasoning model
served without a reasoning parser writes its `<think>...</think>` (`[THINK]...[/THINK]`)
first, or only the `</think>` where its template opened the block in the prompt: the
calls are read after it.  Every value must be a call of a tool that was offered, by the name
it was offered under, or nothing is recovered, so an answer that merely quotes JSON (or
is prose around it) stays an answer.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from typing import Any

from activities.contract import ToolCall

__all__ = ["recover_tool_calls"]

# A call in Hermes/Qwen tags; the last one may be left open when generation stopped.
# (No \s* around the group: on a long run of blanks it backtracks quadratically.)
_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
# A reasoning model's thoughts, written before its answer (an unclosed one: no answer):
# `<think>` (Qwen, DeepSeek) or `[THINK]` (Magistral).  A template may have opened them
# in the prompt, leaving only the close in the text.
_THOUGHTS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))
_THOUGHT_END = "</think>"
# Mistral's marker, before each call (v11+: `name[ARGS]{...}`, or
# `name[CALL_ID]id[ARGS]{...}`) or before an array of them; what the model wrote before
# the first one is its words, as its own parser (and <tool_call>'s) takes them.
_MISTRAL = "[TOOL_CALLS]"
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.:/-]+)(?:\[CALL_ID\][A-Za-z0-9_-]*)?\[ARGS\]")
_DECODER = json.JSONDecoder()


def _values(body: str) -> list[Any] | None:
    """The JSON values `body` consists of, in order: separated by blanks or `;`, an
    array counting as its items.  None when anything else is in it."""
    values: list[Any] = []
    i = 0
    while True:
        while i < len(body) and body[i] in " \t\r\n;,":
            i += 1
        if i == len(body):
            return values
        try:
            value, i = _DECODER.raw_decode(body, i)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return None
        values.extend(value if isinstance(value, list) else [value])


def _mistral(text: str) -> list[Any]:
    """The calls after Mistral's markers (`text` begins with one); [] when anything else
    is among them.  Each JSON value is read whole, so a marker inside a call's
    arguments is text, not the next call."""
    found: list[Any] = []
    i = 0
    while i < len(text):
        if not text.startswith(_MISTRAL, i):
            return []
        i += len(_MISTRAL)
        named = _MISTRAL_NAMED.match(text, i)
        if named is not None:
            i = named.end()
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            try:
                value, i = _DECODER.raw_decode(text, i)
            except (ValueError, RecursionError):
                return []
            if named is not None:
                found.append({"name": named.group(1), "arguments": value})
            else:
                found.extend(value if isinstance(value, list) else [value])
            while i < len(text) and text[i] in " \t\r\n;,":
                i += 1
            # Values without names may follow one another (`{...}; {...}`).
            if named is not None or i == len(text) or text.startswith(_MISTRAL, i):
                break
            if text[i] not in "{[":
                break
    return found


def _after_thoughts(text: str) -> str | None:
    """The text after the thoughts a reasoning model wrote first (itself when none);
    None when it was cut while thinking: no call was written."""
    body = text.lstrip()
    for opening, closing in _THOUGHTS:
        if body.startswith(opening):
            end = body.find(closing, len(opening))
            return None if end < 0 else body[end + len(closing) :]
    return text


def _candidates(text: str) -> list[Any]:
    body = _after_thoughts(text)
    if body is None:
        return []
    found = _read(body)
    head, closed, rest = body.partition(_THOUGHT_END)
    if not closed or "<think>" in head:
        return found  # no thoughts, or prose that shows some
    # Thoughts opened by the template, in the prompt: only their close is in the text,
    # and the calls come after it (thoughts may mention a <tool_call> they never make).
    # The whole text's calls only where the tag is inside one of them (its arguments).
    after = _read(rest)
    if after:
        return after
    return found if any(_THOUGHT_END in json.dumps(v) for v in found) else []


def _read(text: str) -> list[Any]:
    at = text.find(_MISTRAL)
    if at >= 0:
        found = _mistral(text[at:].strip())
        if found:
            return found
    tagged = _TAGGED.findall(text)
    if tagged:
        found = [_values(t.strip()) for t in tagged]
        return [] if any(v is None for v in found) else [x for v in found for x in v or []]
    body = text.strip().removeprefix("<|python_tag|>").strip()
    for end in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(end).strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body.startswith(("{", "[")):
        return []  # prose (which may quote JSON) is an answer
    return _values(body) or []


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
    for i, obj in enumerate(_candidates(text)):
        found = _call(obj, offered)
        if found is None:
            return []
        seen = json.dumps(obj, sort_keys=True)
        digest = hashlib.blake2b(f"{salt}\0{i}\0{seen}".encode(), digest_size=8).hexdigest()
        calls.append(ToolCall(id=f"call_recovered_{digest}", name=found[0], arguments=found[1]))
    return calls
