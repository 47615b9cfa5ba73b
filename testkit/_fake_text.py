"""What the fake engine says: deterministic filler, tool calls and label logprobs.

Everything here is a pure function of the conversation and the seed, so a load generator
sees the same run shape every time: `key` hashes with BLAKE2b (stable across processes,
unlike `hash()`).  Every filler token is a space plus a three-letter word, four
characters, so a reply of n tokens re-tokenizes (4 characters per token) to n tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHARS_PER_TOKEN",
    "LONG_ARGS_END",
    "FillerPool",
    "Reply",
    "directives",
    "key",
    "parse_labels",
    "plan_reply",
    "render_message",
    "tool_arguments",
]

CHARS_PER_TOKEN = 4
# Replies are at most 256 tokens (text) or TOOL_CALL_TOKENS; the pool is sliced at an offset
# chosen by the conversation, so it must hold the longest reply past the last offset.
_POOL_OFFSETS = 4096
_MAX_REPLY_TOKENS = 256
# A text reply's length under the `long` directive (some 4,000 characters).
LONG_REPLY_TOKENS = 1024
TOOL_CALL_TOKENS = 20
# How a string argument ends under the `long-args` directive.
LONG_ARGS_END = " «fin»"
DEFAULT_MAX_TOOL_CALLS = 3
MAX_PARALLEL_TOOL_CALLS = 4

# fmt: off
_WORDS = (
    "the", "and", "for", "you", "all", "can", "had", "was", "one", "our", "out", "day", "get",
    "has", "him", "his", "how", "man", "new", "now", "old", "see", "two", "way", "who", "did",
    "its", "let", "put", "say", "she", "too", "use", "map", "log", "key", "run", "set", "end",
    "top", "bit", "cup", "dog", "sun", "sea", "sky", "art", "box", "car", "fan", "hat", "ink",
    "jam", "kit", "lab", "mud", "net", "oak", "pen", "ray", "tea", "van", "web",
)
# fmt: on


def key(seed: int, *parts: str) -> int:
    """A stable 64-bit hash of `parts` under `seed`."""
    h = hashlib.blake2b(digest_size=8, key=(seed & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little")


class FillerPool:
    """Seeded filler tokens; a reply is a slice of the pool at a conversation's offset."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.tokens = tuple(
            " " + rng.choice(_WORDS) for _ in range(_POOL_OFFSETS + _MAX_REPLY_TOKENS)
        )

    def take(self, offset: int, n: int) -> tuple[str, ...]:
        start = offset % _POOL_OFFSETS
        if n <= _MAX_REPLY_TOKENS:
            return self.tokens[start : start + n]
        return tuple(self.tokens[(start + i) % len(self.tokens)] for i in range(n))


def content_text(content: object) -> str:
    """The text of an OpenAI message `content` (a string or a list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def render_message(message: Mapping[str, Any]) -> str:
    """A message as prompt text: the same message always renders the same, so a growing
    conversation's rendering starts with the previous turn's rendering."""
    parts = [f"<|{message.get('role')}|>", content_text(message.get("content"))]
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            if isinstance(call, dict):
                fn = call.get("function")
                fn = fn if isinstance(fn, dict) else {}
                parts.append(f"[{call.get('id')} {fn.get('name')} {fn.get('arguments')}]")
    call_id = message.get("tool_call_id")
    if isinstance(call_id, str):
        parts.append(f"[{call_id}]")
    parts.append("\n")
    return "".join(parts)


def parse_labels(text: str) -> list[str]:
    """Labels from a line `Labels: a, b, c` (the last such line), or the lines after
    `Labels (one per line):` (as /v1/decide lists labels with commas), else []."""
    labels: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        head, sep, rest = line.strip().partition(":")
        if sep and head.strip().lower() == "labels":
            labels = [lab.strip() for lab in rest.split(",") if lab.strip()]
        elif sep and head.strip().lower() == "labels (one per line)" and not rest.strip():
            labels = [lab.strip() for lab in lines[i + 1 :] if lab.strip()]
    return labels


def _plausible(schema: object, salt: str) -> object:
    if not isinstance(schema, dict):
        return None
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    # Strings carry the call's salt, so every call's arguments differ: a test can tell a
    # repeated call from a new one by its arguments alone.
    return {"string": salt, "integer": 1, "number": 1.0, "boolean": True}.get(str(kind))


def tool_arguments(parameters: object, salt: str = "x") -> str:
    """JSON arguments filling the required properties of a JSON schema with plausible values."""
    args: dict[str, object] = {}
    if isinstance(parameters, dict):
        props = parameters.get("properties")
        props = props if isinstance(props, dict) else {}
        required = parameters.get("required")
        for name in required if isinstance(required, list) else []:
            if isinstance(name, str):
                args[name] = _plausible(props.get(name), salt)
    return json.dumps(args)


def directives(text: str) -> tuple[str, frozenset[str]]:
    """Test directives in a run's first user message, e.g. `[fake: text-tools]`, and the
    message without them (the run's shape is hashed from that, so a directive changes how
    calls are written, not how many there are).

    `text-tools`: tool calls are written as text (`<tool_call>{...}</tool_call>`), as small
    models without a tool-call parser do. `malformed-args`: tool call arguments are `{}`.
    `long`: a text reply is LONG_REPLY_TOKENS long (max_tokens allowing), not 40..256.
    `long-args`: a tool call's string arguments are its salt and LONG_REPLY_TOKENS of
    filler, ending in LONG_ARGS_END (not ASCII), as a call writing a file's content; the
    call takes that many tokens more.
    """
    found: set[str] = set()
    kept: list[str] = []
    rest = text
    while (i := rest.find("[fake:")) >= 0 and (j := rest.find("]", i)) >= 0:
        found.update(w.strip() for w in rest[i + 6 : j].split(",") if w.strip())
        kept.append(rest[:i])
        rest = rest[j + 1 :]
    return "".join(kept + [rest]).strip(), frozenset(found)


@dataclass(frozen=True, slots=True)
class Reply:
    """A planned reply: text tokens or one tool call, with its finish reason."""

    tokens: tuple[str, ...]  # text tokens (empty for a tool call)
    n_tokens: int  # completion tokens the engine generates
    finish_reason: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    labels: tuple[str, ...] = ()  # labels in preference order, if the prompt named them

    @property
    def content(self) -> str | None:
        return None if self.tool_calls else "".join(self.tokens)

    def cut(self, tokens: int) -> Reply:
        """The reply as generation stopped after `tokens` (max_tokens, or a full KV
        pool): "length"; tool calls cut off are their text so far, as an engine's tool
        parser that finds no whole call answers it."""
        if self.tool_calls:
            text = calls_text(self.tool_calls)[: tokens * CHARS_PER_TOKEN]
            return Reply((text,), tokens, "length")
        return Reply(self.tokens[:tokens], tokens, "length", labels=self.labels)

    def logprobs(self, start: int, stop: int, top: int, conv: int) -> list[dict[str, Any]]:
        """OpenAI `logprobs.content` entries for tokens [start, stop), deterministic."""
        out = []
        for i in range(start, min(stop, len(self.tokens))):
            tok = self.tokens[i]
            h = (conv >> (i % 40)) & 0xFFFF
            lp = -0.01 - (h % 500) / 1000
            if i == 0 and self.labels:
                # The first label 0.94, the others 2 %, 1 %, ...: the alternatives of
                # one token are one distribution (helper-127: they summed to 1.2, and
                # so did a decision's mass).
                alts = [
                    (lab, -0.06 if r == 0 else math.log(0.02) - math.log(2) * (r - 1))
                    for r, lab in enumerate(self.labels)
                ]
                lp = alts[0][1]
                for j in range(max(0, top - len(alts))):
                    alts.append((_WORDS[(h + j) % len(_WORDS)], -5.0 - j))
                alts = alts[: max(top, 1)]  # as many as asked: the likeliest labels
            else:
                alts = [(tok, lp)]
                for j in range(1, top):
                    word = " " + _WORDS[(h + j) % len(_WORDS)]
                    if word != tok:
                        alts.append((word, lp - 1.0 - 0.7 * j))
            out.append(
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alts
                    ],
                }
            )
        return out


def calls_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """Tool calls as a model without a tool-call parser writes them (Hermes tags)."""
    return "".join(
        "<tool_call>"
        + json.dumps({"name": c["function"]["name"], "arguments": json.loads(a)})
        + "</tool_call>"
        for c in calls
        if (a := c["function"]["arguments"])
    )


def plan_reply(
    *,
    seed: int,
    pool: FillerPool,
    conv: int,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    max_tool_calls: int,
    max_tokens: int,
    parallel: bool = False,
    tool_choice: str = "auto",
    forced: str | None = None,
) -> Reply:
    """Decide the reply to a conversation whose hash is `conv`.

    With tools, a run makes k = hash(first user message) % (max_tool_calls + 1) tool calls:
    while fewer than k tool results are in the conversation, reply with one tool call (with
    `parallel`, with every remaining call, at most MAX_PARALLEL_TOOL_CALLS). Directives in
    the first user message change how calls are written (`directives`).
    `tool_choice` "none" makes no call; "required" makes at least one each turn (of
    the function `forced` names, when one does).  Calls that take more than
    `max_tokens` (TOOL_CALL_TOKENS each) are cut off: their text so far, "length".
    Otherwise a text reply of min(max_tokens, 40..256) tokens (LONG_REPLY_TOKENS with the
    `long` directive; "length" when it hit max_tokens), starting with the preferred label
    when the last user message has a `Labels:` line.
    """
    first_user = next(
        (content_text(m.get("content")) for m in messages if m.get("role") == "user"), ""
    )
    task, wanted = directives(first_user)
    if tools and tool_choice != "none":
        k = key(seed, "tool-calls", task) % (max_tool_calls + 1)
        m = sum(1 for msg in messages if msg.get("role") == "tool")
        if tool_choice == "required":
            k = max(k, m + 1)
        if m < k:
            calls: list[dict[str, Any]] = []
            for i in range(m, min(k, m + MAX_PARALLEL_TOOL_CALLS) if parallel else m + 1):
                pick = key(seed, "tool", str(conv), str(i))
                fn = next(
                    (t["function"] for t in tools if t["function"]["name"] == forced),
                    tools[pick % len(tools)]["function"],
                )
                salt = f"{fn['name']}-{pick % 16**10:010x}"
                if "long-args" in wanted:
                    filler = "".join(pool.take(pick >> 16, LONG_REPLY_TOKENS))
                    salt = f"{salt}{filler}{LONG_ARGS_END}"
                args = (
                    "{}"
                    if "malformed-args" in wanted
                    else tool_arguments(fn.get("parameters"), salt)
                )
                call = {"name": str(fn["name"]), "arguments": args}
                calls.append({"id": f"call_{pick:016x}", "type": "function", "function": call})
            per_call = TOOL_CALL_TOKENS + (LONG_REPLY_TOKENS if "long-args" in wanted else 0)
            whole = Reply((), per_call * len(calls), "tool_calls", tuple(calls))
            if whole.n_tokens > max_tokens:
                return whole.cut(max_tokens)
            if "text-tools" in wanted:
                return Reply((calls_text(calls),), whole.n_tokens, "stop")
            return whole
    length = 40 + conv % (_MAX_REPLY_TOKENS - 40 + 1)
    if "long" in wanted:
        length = LONG_REPLY_TOKENS
    n = min(max_tokens, length)
    finish = "length" if n == max_tokens else "stop"
    last_user = next(
        (content_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"),
        "",
    )
    labels = parse_labels(last_user)
    if labels:
        first = conv % len(labels)
        ordered = (labels[first], *labels[:first], *labels[first + 1 :])
        return Reply((ordered[0], *pool.take(conv >> 16, n - 1)), n, finish, labels=ordered)
    return Reply(pool.take(conv >> 16, n), n, finish)
