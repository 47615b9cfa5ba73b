"""The function name a run's model is offered for each upstream MCP tool.

MCP lets a server name a tool with characters and lengths engines refuse as a function
name: the 2025-11-25 spec says a name SHOULD be 1-128 of `[A-Za-z0-9_.-]` (`files.read`),
older servers send anything (`github/create_issue`); OpenAI and Anthropic take
`^[a-zA-Z0-9_-]{1,64}$` and answer 400 to the whole request otherwise, Gemini wants a
letter or `_` first, and the open engines' text parsers read a call only when the name
is an identifier (vLLM's and SGLang's `pythonic` parsers, llama.cpp's Functionary v3.2
`\\w+`).  The gateway, not the run, picks the engine, so the name must suit them all.

A tool whose name is an identifier of at most 64 characters (`FUNCTION_NAME`) keeps it.
Another gets its name with every other character made `_`, `t_` in front unless it then
starts with a letter, cut past 64 to 55 characters and `_` and 8 hex digits of its
server's and name's SHA-256; one that would then be named as another tool of the listing
gets those 8 digits instead, of (server, name, n) for the first n that is free.  When
two servers offer one name, the first listed keeps it and each other's is offered as
`<server>__<name>` (Claude Code's `mcp__<server>__<tool>` without its prefix), by the
same rules: a run reaches every server's tool, and names the one it wants.  A pure
function of the listing, whatever its order, decided in the tool-listing activity: a
run's listing is in its history, so its names never change across turns, replays and
restarts, and a rule changed later changes no run already going.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

__all__ = ["FUNCTION_NAME", "function_names"]

MAX_FUNCTION_NAME = 64
FUNCTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")
_DIGITS = 8


def _hashed(name: str, *key: object) -> str:
    digest = hashlib.sha256("\0".join(map(str, key)).encode()).hexdigest()[:_DIGITS]
    return f"{name[: MAX_FUNCTION_NAME - _DIGITS - 1]}_{digest}"


def function_names(
    tools: Iterable[tuple[str, str]], qualified: Iterable[tuple[str, str]] = ()
) -> dict[tuple[str, str], str]:
    """(server, tool name) -> the function name the model is offered and calls, for the
    tools that need one other than their own (the others keep theirs).  A `qualified`
    tool (one whose name an earlier server's tool has) is offered as `<server>__<name>`,
    made a name engines take by the same rules."""
    keys = sorted(set(tools) | set(qualified))
    q = set(qualified)
    taken = {n for s, n in keys if (s, n) not in q and FUNCTION_NAME.fullmatch(n)}
    names: dict[tuple[str, str], str] = {}
    for server, name in keys:
        if (server, name) not in q and name in taken:
            continue
        alias = _UNSAFE.sub("_", f"{server}__{name}" if (server, name) in q else name)
        if not alias[:1].isalpha() or not alias[:1].isascii():
            alias = f"t_{alias}"
        if len(alias) > MAX_FUNCTION_NAME:
            alias = _hashed(alias, server, name)
        n = 0
        wanted = alias
        while alias in taken:
            n += 1
            alias = _hashed(wanted, server, name, n)
        taken.add(alias)
        names[(server, name)] = alias
    return names
