"""Approval questions as the MCP door asks them: one key, message and form for the
elicitation paths (legacy mid-call, 2026-07-28 input-required) and the Tasks extension."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pydantic_core
from mcp.server.elicitation import render_elicitation_schema
from mcp_types import ClientCapabilities
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workflows import RunStatus

__all__ = [
    "MODERN",
    "PREVIEW_CHARS",
    "ApprovalForm",
    "RecentKeys",
    "arguments_json",
    "can_ask",
    "elicit_params",
    "message",
    "parse_key",
    "question_key",
]

MODERN = "2026-07-28"  # the stateless protocol revision
_PREFIX = "approve:"
# The characters of a call's arguments an approval question shows (their JSON's start):
# an elicitation dialog is small; past them, it names the `status` maxChars that shows
# them whole.
PREVIEW_CHARS = 500
MAX_CHARS_LEAST = 1_000  # the least maxChars a door tool takes (mcp_door.MaxChars)


class RecentKeys:
    """Question keys remembered, the latest `kept` of them (the oldest forgotten first):
    the answers the Tasks path took, the approvals waits have shown."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._kept:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ApprovalForm(BaseModel):
    """The one-field form a user answers an approval with."""

    # (The docstring is the schema's description, which the client is sent.)  `allow`
    # defaults to false in that schema: the box shows unticked, and a client may leave
    # out a field the user did not change, so an `accept` without it is a no
    # (helper-208: `{}` was dropped, and the call answered AwaitingApproval as if
    # nobody had).  Strict: only a JSON boolean is an answer, as the schema says and
    # as the door's tools take theirs; "true" is not one, on any path.
    # Forbid: a field it does not ask for (`Allow`, a typo) answers nothing, logged,
    # rather than reading as the default's no (helper-211).
    model_config = ConfigDict(strict=True, extra="forbid")

    allow: bool = Field(False, description="let the sub-agent run this tool call")


def answer(action: object, content: object) -> bool | None:
    """A client's answer to an approval question, read alike on every path (legacy
    elicitation, 2026-07-28 input responses, Tasks): `accept` with the form's content,
    or `decline` — the user's explicit no, as MCP defines it (Claude Code's "Decline").
    `cancel` (dismissed) answers nothing, and so does an `accept` whose content is not
    the form (none at all, or `allow` not a boolean): the approval stays open, and a
    malformed answer never allows a call."""
    if action == "decline":
        return False
    if action != "accept" or not isinstance(content, dict):
        return None
    try:
        return ApprovalForm.model_validate(content).allow
    except ValidationError:
        return None


def question_key(status: RunStatus) -> str:
    """The input key of a run's pending approval: `approve:<handle>:<call id>`."""
    assert status.pending_approval is not None
    return f"{_PREFIX}{status.handle}:{status.pending_approval.call_id}"


def parse_key(key: str) -> tuple[str, str] | None:
    """(handle, call id) of a question key; None for a key not of that shape (never
    issued: ignored, as MCP asks of keys a server did not ask)."""
    if not key.startswith(_PREFIX):
        return None
    handle, _, call_id = key.removeprefix(_PREFIX).partition(":")
    return (handle, call_id) if handle and call_id else None


def can_ask(capabilities: ClientCapabilities | None) -> bool:
    """Whether a client declared form-mode elicitation (`elicitation: {}` included,
    which means form before URL mode existed): only then is it asked."""
    e = capabilities.elicitation if capabilities is not None else None
    return e is not None and (e.form is not None or e.url is None)


def arguments_json(arguments: Any) -> str:
    """A pending call's arguments as compact JSON, as the door's results write them
    (`_StringsKept.convert_result`): their length is what a result's maxChars counts,
    and what a question cut to its start says the whole is."""
    return pydantic_core.to_json(arguments).decode()


def message(status: RunStatus) -> str:
    """What the user is asked: the call's arguments whole, or their start and how long
    they are.  (They were cut at 500 characters unsaid: a user could allow a call
    having seen only its start without knowing it; and escaped to ASCII, é as \\u00e9.)"""
    p = status.pending_approval
    assert p is not None
    args = arguments_json(p.arguments)
    if len(args) > PREVIEW_CHARS:
        # The maxChars that shows them whole: a status with its default (30,000) shows
        # only the start of a file-writing call's 100,000 characters; and never one
        # below the door's least (1,000), which it would refuse.
        n = len(args)
        args = (
            f"{args[:PREVIEW_CHARS]}… ({n:,} characters in all; `status` of this run with "
            f"maxChars {max(n, MAX_CHARS_LEAST)} or more shows them whole)"
        )
    return f"Sub-agent {status.handle} wants to call {p.described} with {args}. Allow it?"


def elicit_params(status: RunStatus) -> dict[str, Any]:
    """The params of the `elicitation/create` request for a run's pending approval."""
    return {
        "mode": "form",
        "message": message(status),
        "requestedSchema": render_elicitation_schema(ApprovalForm),
    }
