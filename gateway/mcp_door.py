"""The MCP door: sub-agents as tools — spawn, await, run, status, answer, cancel, approve,
tools, decide — served by the official SDK at `/mcp` (both protocol generations, one
endpoint).

Each tool is a typed function whose docstring is what the calling model reads, and
whose result is a pydantic model (structured content and an output schema).  A run is
a Temporal workflow (`workflows.AgentRun`); this module only translates: every run
operation goes through `workflows.Runs`.  Bad input never reaches Temporal: it comes
back as a tool error that names what was expected.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pydantic_core
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata
from mcp.server.request_state import RequestStateSecurity
from mcp.shared.exceptions import MCPError
from mcp.types import ToolAnnotations
from mcp_types import (
    INVALID_PARAMS,
    CallToolResult,
    ElicitRequest,
    ElicitRequestFormParams,
    InputRequiredResult,
    TextContent,
)
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)
from temporalio.service import RPCError, RPCStatusCode

from activities.contract import unknown_tools
from activities.mcp_pool import Listing
from gateway import _approval as approval
from gateway.mcp_tasks import Background, TasksExtension, cancel_quietly
from luftpause.config import MODEL_MAX_CHARS
from luftpause.headers import CALLER_HEADER, TENANT_HEADER, caller_name
from workflows import (
    AWAIT_MAX_S,
    TERMINAL_STATES,
    Budget,
    CallerRuns,
    Rounds,
    RunError,
    Runs,
    RunSpec,
    RunStatus,
    RunUnavailable,
    SpawnTurn,
)
from workflows.contract import CALL_ID_MAX_CHARS, RunState
from workflows.runs import new_handle, status_unavailable

__all__ = [
    "RESULT_ANSWER_CHARS",
    "RUN_STORE_DOWN",
    "AnswerResult",
    "AwaitResult",
    "DecideResult",
    "DoorDeps",
    "RunStoreDown",
    "RunView",
    "SpawnResult",
    "create_mcp_server",
]

log = logging.getLogger(__name__)

SESSION_HEADER = "mcp-session-id"
ANONYMOUS = "anonymous"
# How a tool error names Temporal being down.
RUN_STORE_DOWN = "the run store (Temporal)"


class RunStoreDown(ConnectionError):
    """Temporal could not be connected to; the message says where it was looked for
    (DoorDeps.runs raises it, and the tools pass its message on)."""


DEFAULT_AWAIT_S = 60.0
# The characters one await/status/run result's long texts take by default, shared by
# its runs (`answer_shares`): their answers (the `answer` tool reads the rest), their
# errors (up to some 10,000 characters each, RUN_ERROR_MAX_CHARS: 1,000 failed runs
# made an await of 10 MB; `status` of the run with a larger maxChars shows one whole),
# and the arguments of the calls runs await approval for (their JSON: `status` with a
# larger maxChars shows them whole up to 1,000,000 characters, some 250,000 tokens: a
# turn's maxTokens, 32,768 at most, writes some 130,000 characters; with maxTokens 0
# the engine's context bounds it, and only one past 250,000 tokens could write more).
# A text's share is spent on the characters it takes in the result's JSON, which is what
# a client reads (the text copy, and the structured content): a quote, backslash,
# newline, tab or carriage return is 2 there (\b and \f too) and any other control
# character 6.  Counted raw, a JSON answer took some 1.35 times its share and cut
# arguments (a JSON text in a JSON string, its quotes escaped again) 1.6 (helper-237);
# lengths and offsets (answerChars, answerNextOffset) stay in the text's own characters,
# where `answer` reads.  Claude Code warns at a result past 10,000 tokens, older versions
# refuse one past 25,000 (MAX_MCP_OUTPUT_TOKENS), and newer ones save one past 50,000
# characters to a file and show the model 2 KB of it; Gemini CLI cuts text past 40,000
# characters (its truncateToolOutputThreshold, google-gemini/gemini-cli PRs 18446 and
# 19365; helper-214).  30,000 characters are about 7,500 tokens of English.  The rest of a
# result is some 125 characters a run in `await` (250 with a budget) and 445 in
# `status`, its null fields left out (helper-230; 275 and 550 with them), and 45 more a
# run whose answer is cut (answerChars, answerNextOffset; helper-235), 20 one whose
# error is (errorChars), so with every text cut a result stays under 50,000 characters
# up to about 115 runs of `await` and 40 of `status`, and under the 10,000-token warning
# up to about 60 and 20.  Characters are code points (JSON escapes none past U+001F
# here): 30,000 of CJK text can be 20,000-30,000 tokens, so a client reading such
# answers sets a smaller maxChars.  Unbounded, a fan-out of long answers (maxTokens up to
# 32,768 a turn, up to 1,000 runs) was refused whole.
RESULT_ANSWER_CHARS = 30_000
RESULT_ANSWER_CHARS_MIN = approval.MAX_CHARS_LEAST  # (an approval question names no less)
RESULT_ANSWER_CHARS_MAX = 1_000_000
# What Claude Code reads from the tools/list entry of the tools whose results maxChars
# bounds (since 2.1.91, whole since 2.1.98; code.claude.com/docs/en/mcp, "Raise the
# limit for a specific tool"; helper-236): the characters of a result it keeps in the
# conversation before saving it to a file and showing the model 2 KB (50,000 by
# default, 500,000 at most), and for text it no longer applies MAX_MCP_OUTPUT_TOKENS.
# The door bounds these results itself: a model that asked for maxChars 100,000 got a
# file path.  200,000 keeps the default maxChars' results inline up to ~1,000 runs of
# `await` (~195,000 characters with every answer cut: 165 a run and the 30,000 of the
# answers; ~166,000 with every error cut: 136 a run, its handle 24 characters) and
# lets no result past it into the context whole; the 50,000 above is what older
# versions and Claude Code Desktop's agent (which drops `_meta`) keep.  Not less than
# the largest default-sized result: a value below 50,000 lowers the threshold.
# Other clients ignore it (MCP leaves `_meta` keys under another's prefix to their
# owners).
CLAUDE_RESULT_META = {"anthropic/maxResultSizeChars": 200_000}
PROGRESS_EVERY_S = 5.0
# Input-required rounds one 2026-07-28 await/run asks at most (the official client
# gives up a call after 10); then it answers with the runs as they are.
INPUT_ROUNDS_MAX = 8
# The approvals waits have answered with (their question keys), remembered so that a
# wait answers early for each at most once (see `_all_wait_for_approval`).
TOLD_KEPT = 10_000
STATE_TTL_SLACK_S = 60.0  # a sealed request state outlives the call's deadline by this
MAX_TOOL_CALLS_LIMIT = 64
MAX_TOKENS_LIMIT = 32_768
# A run's task and system prompt travel in its workflow's input and in every turn's,
# which Temporal refuses past 2 MiB (its default blob limit).  Its JSON escapes every
# character outside ASCII (6 bytes, 12 beyond the BMP): the two are bounded by that
# size together too (helper-150: 180k CJK characters of system prompt stuck the run
# at its continue-as-new), which 200k ASCII characters each stay under.
PROMPT_MAX_CHARS = 200_000
PROMPT_MAX_BYTES = 500_000
# A budget's clock is a workflow timer; a month is longer than any agent should run.
BUDGET_SECONDS_MAX = 30 * 86_400.0
# The counted budgets' bounds: far past what a tree spends (a quadrillion tokens), and
# exact as the floats a status carries (JSON numbers, below 2**53).  Unbounded, 10**309
# started a run whose every status then failed to render (helper-155).
BUDGET_TOKENS_MAX = 10**15
BUDGET_TOOL_CALLS_MAX = 10**9
HANDLE_MAX_CHARS = 200
# A tool's name as a run is given it: the 2025-11-25 spec's 128 characters, or
# `<server>__<name>`.  Bounded, as every string a refusal repeats: a megabyte of one
# came back in the error past the client's 1 MiB event limit (helper-126).
TOOL_NAME_MAX_CHARS = 256
TOOLS_MAX = 1000
LABEL_MAX_CHARS = 1000
ToolName = Annotated[str, Field(min_length=1, max_length=TOOL_NAME_MAX_CHARS)]


@dataclass(frozen=True, kw_only=True)
class DoorDeps:
    """What the door needs from the gateway process."""

    runs: Callable[[], Awaitable[Runs]]  # connects to Temporal on first use
    # The upstream tools (McpPool.listing): every server's, or (names given) enough
    # servers' for those names; an empty list: whatever the servers reached offer.
    upstream_tools: Callable[[Collection[str] | None], Awaitable[Listing]]
    # (status, JSON body) of a /v1/decide request: input, labels, model, caller
    decide: Callable[[str, list[str] | None, str | None, str], Awaitable[tuple[int, Any]]]
    models: Callable[[], Sequence[str]]  # the models the pool serves now, its first the default
    token_identity: str | None = None  # the caller when only the token identifies it
    # Key material sealing a 2026-07-28 call's request state between rounds (the
    # operator token): a round after a gateway restart still opens.  None: a key of
    # this process only (an open gateway), and such a round is refused after a restart.
    state_key: bytes | None = None
    # Whether the gateway began to stop: a call it cuts is not its client's leaving.
    stopping: Callable[[], bool] = lambda: False
    # Whether the `approve` tool is offered ([mcp] approve_tool): without it, approvals
    # are answered only through the client's own questions (elicitation, tasks/update).
    approve_tool: bool = True


def _client_cancelled(ctx: Context) -> bool:
    """Whether the client sent `notifications/cancelled` for this call.  (mcp 2.3 keeps
    the flag on the request's dispatch context, which the tools' Context does not
    expose; without it, False.)"""
    outbound = getattr(ctx.request_context.session, "_request_outbound", None)
    event = getattr(outbound, "cancel_requested", None)
    return bool(event is not None and event.is_set())


def _progress_asked(ctx: Context) -> bool:
    """Whether the call asked for progress (a progress token): the only kind sent any."""
    return (ctx.request_context.meta or {}).get("progress_token") is not None


async def _follow_turn(ctx: Context, turn: SpawnTurn, total: float | None = None) -> None:
    """Progress for a `spawn` or `run` call while its child waits its turn at the
    parent, and while it is sent, until cancelled: at once as either begins, then every
    PROGRESS_EVERY_S with the spawns still ahead of it.  A burst of hundreds at one
    parent takes minutes (bench/RESULTS.md), and a client gives up a call that shows
    no sign of life (the TypeScript SDK after 60 s; progress resets that clock only
    if the client asked, resetTimeoutOnProgress).  MCP's progress must increase with
    each notification: it counts them (`spawn`); or, with a `total` (`run`, whose wait
    goes on from 1), it stays below 1: 0, 1/2, 2/3, ..."""
    told = 0
    while True:
        turn.changed.clear()  # (before reading: a change after the read wakes the wait)
        what = None
        if turn.parent is not None and turn.sending:
            what = f"sent to parent run '{turn.parent}', for it to take the child"
        elif turn.parent is not None and (ahead := turn.ahead) is not None:
            what = f"waiting its turn at parent run '{turn.parent}': {ahead} ahead of it"
        if what is not None:
            value = told + 1 if total is None else told / (told + 1)
            told += 1
            with contextlib.suppress(Exception):
                await ctx.report_progress(value, total, what)
        # Not asyncio.wait_for: Python 3.11's returns when its cancel comes in the loop
        # pass the wait ended in, swallowing it, and this went on after its call's end,
        # for ever (helper-252: a spawn failed at once at its turn, the gate tripped).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PROGRESS_EVERY_S):
                await turn.changed.wait()


async def _unsent(starting: asyncio.Future[str], handle: str) -> None:
    """After a call cut before its run's request went out (`SpawnTurn.sending`), and
    `starting` cancelled: let it end (a spawn in line leaves it); an error it ended
    with before the cancel reached it (a check failed) is logged."""
    try:
        await starting
    except asyncio.CancelledError:
        pass
    except Exception as exc:
        log.info("run %s of a call that was cut was not asked for: %s", handle, exc)


async def _once_started(
    starting: asyncio.Future[str],
    runs: Callable[[], Awaitable[Runs | CallerRuns]],
    handle: str,
    parent: str | None,
) -> None:
    """After a run call cut while its run was starting: once `starting` has started it,
    cancel it (its handle never reached the client, nor a restarted one: kept going,
    the client would start it again, helper-145); one that did not start (refused,
    the store away) has nothing to cancel, and why is logged.  A child's request is
    withdrawn first: its parent may take it any time up to 30 s (or later), and a
    stop's 3 s for this work should not be spent waiting for that."""
    if parent and not starting.done():
        with contextlib.suppress(Exception):  # (logged by withdraw_child)
            await (await runs()).withdraw_child(parent, handle)
    try:
        await starting
    except Exception as exc:
        log.info("run %s of a run call that was cut did not start: %s", handle, exc)
        return
    await cancel_quietly(runs, handle)


# --------------------------------------------------------------------------- results


class _Sparse(BaseModel):
    """A result that leaves out its fields that are null, in the structured content and
    so in its text copy: a finished run in an `await` was 274 characters with them, 123
    without, and a wide await is bounded by no maxChars (helper-230).  Only fields with
    a default: the output schema (pydantic's, validation mode) does not require those,
    so the content still conforms.  False and 0 are kept, and so are nulls inside a
    field's value (a budget's `limits`: null, no bound)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for name, info in type(self).model_fields.items():
            if getattr(self, name) is None and not info.is_required():
                data.pop(name, None)
        return data


class PendingApprovalView(_Sparse):
    tool: str
    arguments: Any = Field(
        description="the call's arguments; a string, the start of their JSON, when "
        "argumentsChars is set"
    )
    argumentsChars: int | None = Field(
        None,
        description="the arguments' whole length in characters when their JSON is longer "
        "than this result's share of maxChars: `arguments` is its start; `status` with a "
        "larger maxChars (up to 1,000,000) shows them whole; absent when they are whole",
    )
    callId: str
    server: str = ""  # the tool's MCP server


class UsageView(_Sparse):
    turns: int
    toolCalls: int
    failedToolCalls: int
    promptTokens: int
    completionTokens: int
    cachedTokens: int
    turnSeconds: float
    toolSeconds: float


class BudgetView(_Sparse):
    # (int first: a count stays one, and one of a run started before the bounds, past
    # any float, still renders.)
    limits: dict[str, int | float | None]
    used: dict[str, int | float | None]
    exceeded: str | None = None
    over: str | None = None


class ChildView(_Sparse):
    handle: str
    state: str


class RunView(_Sparse):
    """A run as a harness sees it."""

    handle: str
    state: str = Field(
        description=(
            "Running | AwaitingApproval | AwaitingChildren | Stopping | Completed | Failed"
            " | Cancelled"
        )
    )
    answer: str | None = Field(None, description="the final answer, once Completed")
    answerCut: bool | None = Field(
        None,
        description="once the run has ended: whether the answer stopped at maxTokens "
        "(cut, or empty: a reasoning model cut while thinking); give the run more",
    )
    answerChars: int | None = Field(
        None,
        description="the answer's whole length in characters when the `answer` field holds "
        "only its start, to fit this result's share of maxChars; absent when it is whole",
    )
    answerNextOffset: int | None = Field(
        None,
        description="where the rest of a cut answer starts, in its characters (a quote "
        "or newline is one here, two in maxChars): the `answer` tool's offset to read it "
        "from; absent when the answer is whole",
    )
    toolCalls: int = Field(description="tool calls this run made")
    failedToolCalls: int = Field(description="of those, how many failed or were refused")
    error: str | None = Field(
        None, description="why it failed or was stopped; its start when errorChars is set"
    )
    errorChars: int | None = Field(
        None,
        description="the error's whole length in characters when `error` holds only its "
        "start, to fit this result's share of maxChars: `status` of this run alone with "
        "maxChars of twice errorChars shows it whole (in maxChars a quote or newline is 2; "
        "six times, if it is all other control characters); absent when it is whole",
    )
    pendingApproval: PendingApprovalView | None = None
    parent: str | None = None
    # Absent in `await`'s answer, which stays short for up to 1,000 runs: `status` has them.
    children: list[ChildView] | None = Field(
        None, description="the runs it spawned; absent in await's answer (ask status)"
    )
    usage: UsageView | None = Field(None, description="its own; absent in await's answer")
    subtree: UsageView | None = Field(
        None, description="its and its descendants'; absent in await's answer"
    )
    budget: BudgetView | None = None


class SpawnResult(_Sparse):
    handle: str
    state: str
    warning: str | None = Field(
        default=None,
        description="set when no worker polls the runs' task queue: the run starts when one does",
    )


class AwaitResult(_Sparse):
    runs: list[RunView]
    done: bool = Field(description="whether the wait's condition (all or any ended) was met")


class StatusResult(_Sparse):
    runs: list[RunView]


class AnswerResult(BaseModel):
    handle: str
    text: str
    offset: int
    totalChars: int = Field(description="the whole answer's length in characters")
    nextOffset: int | None = Field(
        description="the offset of the next part; null at the answer's end"
    )


class ToolView(BaseModel):
    name: str
    function: str = Field(
        description="the name a run's model is offered and calls: the tool's own, unless "
        "engines would refuse it (OpenAI and Anthropic take ^[a-zA-Z0-9_-]{1,64}$; open "
        "engines' parsers want an identifier)"
    )
    description: str
    server: str
    readOnly: bool
    destructive: bool
    idempotent: bool
    repeatable: bool = Field(
        description="a call that broke off after it may have run (its worker died, its "
        "connection broke) is sent again, 3 sends at most (readOnly or idempotent); "
        "otherwise the run's model is told its outcome is unknown"
    )
    timeoutS: float = Field(
        description="how long one call may take once sent (its server's tool_timeout_s): "
        "then it is cut, not sent again, and the run's model told"
    )
    inputSchema: dict[str, Any]


class ToolsResult(BaseModel):
    tools: list[ToolView]
    unreachable: dict[str, str] = Field(
        default_factory=dict,
        description="servers that could not be reached, with the error: their tools are "
        "not listed, and a run that names no tools waits for them",
    )


class DecideResult(_Sparse):
    label: str
    probabilities: dict[str, float]
    unscored: list[str] = []
    # With labels: the probability the model's first token put on them at all (the
    # probabilities are normalised among the labels); from a classifier, none, and
    # left out, as POST /v1/decide leaves it out (helper-250: it was null here).
    mass: float | None = None


def _usage(t: Any) -> UsageView:
    return UsageView(
        turns=t.turns,
        toolCalls=t.tool_calls,
        failedToolCalls=t.failed_tool_calls,
        promptTokens=t.prompt_tokens,
        completionTokens=t.completion_tokens,
        cachedTokens=t.cached_tokens,
        turnSeconds=round(t.turn_seconds, 3),
        toolSeconds=round(t.tool_seconds, 3),
    )


# The ends of a run that make its `run` call an error (isError), for the model to see:
# it failed, or was stopped (its budget, a cancel) before it answered.  Its view is the
# result still, `error` saying why.  `await` and `status` report many runs: their call
# succeeded whatever the runs' ends.
ERROR_ENDS = frozenset({"Failed", "Cancelled"})


def answer_shares(lengths: Sequence[int], budget: int) -> list[int]:
    """How many characters of each answer one result shows (and of each error and
    pending call's arguments: `_shares`): `budget` in all, shared max-min fairly.  An
    answer shorter than its fair share is shown whole, and what it leaves goes to the
    others; the longer ones are cut to starts of one length (where the budget does not
    divide evenly, the first of them in order a character longer).  No answer is cut
    while the budget has room for more of it."""
    shown = [0] * len(lengths)
    left = budget
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    for k, i in enumerate(order):
        share = left // (len(order) - k)
        if lengths[i] <= share:
            shown[i] = lengths[i]
            left -= lengths[i]
            continue
        # This answer and every one after it are longer than the share: each gets it.
        cut = sorted(order[k:])
        extra = left - share * len(cut)
        for n, j in enumerate(cut):
            shown[j] = share + 1 if n < extra else share
        break
    return shown


# What a JSON string writes as more than the character itself (pydantic_core.to_json,
# as the door's text copy is written; ensure_ascii=False: any other character, é and
# U+2028 too, is itself): `"`, `\` and the controls \b \t \n \f \r as 2, any other
# control as \u00XX, 6.
_ESCAPED = re.compile(r'["\\\x00-\x1f]')
_ESCAPE_CHARS = {c: 2 if c in '"\\\b\t\n\f\r' else 6 for c in map(chr, [*range(32), 34, 92])}


def json_chars(text: str) -> int:
    """How many characters `text` takes inside a JSON string in a result: what its
    share of maxChars is spent on (its quotes and newlines are 2 each there)."""
    return len(text) + sum(_ESCAPE_CHARS[m.group()] - 1 for m in _ESCAPED.finditer(text))


def json_start(text: str, chars: int) -> str:
    """The longest start of `text` that takes at most `chars` characters inside a JSON
    string (`json_chars`), never ending inside an escape: each escaped character is
    counted whole or left out."""
    text = text[:chars]  # (no longer start fits: each character takes one or more)
    extra = 0  # what the escapes before the place looked at add
    for m in _ESCAPED.finditer(text):
        at = m.start()
        if at + extra >= chars:  # the plain characters before this one fill it
            return text[: chars - extra]
        width = _ESCAPE_CHARS[m.group()]
        if at + extra + width > chars:
            return text[:at]
        extra += width - 1
    return text[: chars - extra]


def _long_texts(status: RunStatus) -> dict[str, tuple[str, int]]:
    """A run's texts that may be long, each with what it takes in a result whole: its
    answer, its pending call's arguments as JSON (a file-writing call's 100,000
    characters of content were shown whole in every result that showed its run), and
    its error (up to some 10,000 characters: 1,000 failed runs made a 10 MB await).
    An answer or error is a JSON string there, its escapes counted; whole arguments
    are their JSON itself."""
    texts: dict[str, tuple[str, int]] = {}
    if status.answer is not None:
        texts["answer"] = (status.answer, json_chars(status.answer))
    if status.pending_approval is not None:
        arguments = approval.arguments_json(status.pending_approval.arguments)
        texts["arguments"] = (arguments, len(arguments))
    if status.error is not None:
        texts["error"] = (status.error, json_chars(status.error))
    return texts


# A run's long texts by kind: each text, what it takes in the result whole, its share.
_Shares = dict[str, tuple[str, int, int]]


def _shares(statuses: Sequence[RunStatus], max_chars: int) -> dict[str, _Shares]:
    """Each run's long texts with their shares of `max_chars` (`answer_shares` over
    them all, a handle given twice counted once)."""
    texts = {(s.handle, kind): t for s in statuses for kind, t in _long_texts(s).items()}
    chars = [c for _, c in texts.values()]
    shares: dict[str, _Shares] = {}
    for ((handle, kind), (text, c)), share in zip(
        texts.items(), answer_shares(chars, max_chars), strict=True
    ):
        shares.setdefault(handle, {})[kind] = (text, c, share)
    return shares


def views(statuses: Sequence[RunStatus], max_chars: int, *, detail: bool = True) -> list[RunView]:
    """The runs one result shows, their long texts (answers, pending calls' arguments,
    errors) sharing `max_chars` (`answer_shares`); a handle given twice is shown alike
    both times, and counted once."""
    shares = _shares(statuses, max_chars)
    return [_view(s, detail, shares.get(s.handle, {})) for s in statuses]


def view(
    status: RunStatus, *, detail: bool = True, max_chars: int = RESULT_ANSWER_CHARS
) -> RunView:
    """A run status as the MCP tools return it, its long texts within `max_chars`
    characters of the result's JSON: past that, an answer's start, `answerChars`
    saying how long it is and `answerNextOffset` where the rest starts (a model
    cannot count 30,000 characters to find it); a pending call's arguments, the start
    of their JSON as a string, and `argumentsChars`; an error's start, and
    `errorChars`.  The lengths and offsets are in the text's own characters."""
    return _view(status, detail, _shares([status], max_chars).get(status.handle, {}))


def _view(status: RunStatus, detail: bool, shares: _Shares) -> RunView:
    def shown(kind: str) -> tuple[str, int | None]:
        """The text, or its start that fits its share and its whole length."""
        text, chars, share = shares[kind]
        if chars <= share:
            return text, None
        return json_start(text, share), len(text)

    pending = status.pending_approval
    answer, whole, rest = status.answer, None, None
    if answer is not None:
        answer, whole = shown("answer")
        rest = None if whole is None else len(answer)
    arguments, arguments_chars = None, None
    if pending is not None:
        arguments = pending.arguments
        start, arguments_chars = shown("arguments")
        if arguments_chars is not None:
            arguments = start
    error, error_chars = None, None
    if status.error is not None:
        error, error_chars = shown("error")
    budget = None
    if status.budget is not None:
        b = status.budget
        budget = BudgetView(
            limits={
                "tokens": b.limits.tokens,
                "toolCalls": b.limits.tool_calls,
                "seconds": b.limits.seconds,
            },
            used={
                "tokens": b.used.tokens,
                "toolCalls": b.used.tool_calls,
                "seconds": b.used.seconds,
            },
            exceeded=b.exceeded,
            over=b.over,
        )
    return RunView(
        handle=status.handle,
        state=status.state,
        answer=answer,
        # (Absent while the run goes on: no answer yet to be cut; helper-250.)
        answerCut=status.answer_cut if status.state in TERMINAL_STATES else None,
        answerChars=whole,
        answerNextOffset=rest,
        toolCalls=status.usage.tool_calls,
        failedToolCalls=status.usage.failed_tool_calls,
        error=error,
        errorChars=error_chars,
        pendingApproval=(
            PendingApprovalView(
                tool=pending.tool,
                arguments=arguments,
                argumentsChars=arguments_chars,
                callId=pending.call_id,
                server=pending.server,
            )
            if pending is not None
            else None
        ),
        parent=status.parent,
        children=[ChildView(handle=c.handle, state=c.state) for c in status.children]
        if detail
        else None,
        usage=_usage(status.usage) if detail else None,
        subtree=_usage(status.subtree) if detail else None,
        budget=budget,
    )


def _why_no_answer(status: RunStatus, max_chars: int) -> str:
    """A run's error as `answer` quotes it for a run with no answer: within `max_chars`
    characters of the result's JSON, as every other result's long texts are
    (helper-249: the whole error, up to some 10,000 characters, 60,000 in the JSON,
    came back past a maxChars of 1,000).  Past that, its start, its length, and the
    maxChars with which `status` shows the run's long texts whole."""
    if not status.error:
        return ""
    if json_chars(status.error) <= max_chars:
        return f" ({status.error})"
    whole = sum(chars for _, chars in _long_texts(status).values())
    return (
        f": {json_start(status.error, max_chars)}… (the start of its error, "
        f"{len(status.error):,} characters in all; `status` of this run with maxChars "
        f"{whole} or more shows it whole)"
    )


# --------------------------------------------------------------------------- the server


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("luftpause")
    except PackageNotFoundError:
        return "0"


def _headers(ctx: Any) -> Any:
    """A request's HTTP headers: a tool's Context has `headers`; the lowlevel context
    of an extension has the HTTP `request`."""
    headers = getattr(ctx, "headers", None)
    if headers is None:
        headers = getattr(getattr(ctx, "request", None), "headers", None) or {}
    return headers


def tenant_of(ctx: Any) -> str | None:
    """The caller whose own token sent the request (the gateway's gate says so), or
    None: the operator's token, or no token set."""
    return _headers(ctx).get(TENANT_HEADER) or None


def caller_of(ctx: Any, token_identity: str | None) -> str:
    """Who is asking, for fairness and listing: the header the harness sets, else the
    legacy session, else the token's identity, else anonymous."""
    headers = _headers(ctx)
    named = headers.get(CALLER_HEADER)
    if named:
        return caller_name(named) or ANONYMOUS
    session = headers.get(SESSION_HEADER)
    if session:
        return f"mcp-session:{session}"[:128]
    return token_identity or ANONYMOUS


APPROVAL_POLL_S = 0.5


def _ended(statuses: Sequence[RunStatus], mode: str) -> tuple[int, bool]:
    """How many of the runs an `await` covers have ended, and whether that meets its
    condition (all of them, or any)."""
    ended = sum(1 for st in statuses if st.state in TERMINAL_STATES)
    return ended, ended == len(statuses) if mode == "all" else ended > 0


def _all_wait_for_approval(statuses: Sequence[RunStatus]) -> bool:
    """Every run of an `await` that has not ended waits on an approval (and one has
    not ended): nothing it covers moves until someone answers."""
    going = [st for st in statuses if st.state not in TERMINAL_STATES]
    return bool(going) and all(st.pending_approval is not None for st in going)


async def _round(
    r: Runs, handles: list[str], mode: str, seen: Rounds, seconds: float
) -> list[RunStatus]:
    """One round of a wait: the runs' statuses once one of them ends (`any`) or all have
    (`all`), or after `seconds`; a worker is asked only about runs whose history grew."""
    return await r.wait(
        handles,
        mode="all" if mode == "all" else "any",
        timeout=max(0.001, seconds),
        rounds=seen,
        until_one_ends=True,
    )


async def _moot(
    r: Runs, handles: list[str], mode: str, handle: str, call_id: str, deadline: float
) -> None:
    """Return once a question about run `handle`'s pending call `call_id` has no point:
    the wait's condition is met (a run ended), or the run waits for that call no more
    (answered elsewhere, stopped).  Rounds of APPROVAL_POLL_S until `deadline`."""
    loop = asyncio.get_running_loop()
    seen = Rounds()
    while (left := deadline - loop.time()) > 0:
        statuses = await _round(r, handles, mode, seen, min(left, APPROVAL_POLL_S))
        if _ended(statuses, mode)[1]:
            return
        now = next(st for st in statuses if st.handle == handle)
        if status_unavailable(now):
            continue  # no worker answered: what it waits for is not known, not changed
        if now.pending_approval is None or now.pending_approval.call_id != call_id:
            return


@dataclass(frozen=True)
class _State:
    """What a 2026-07-28 `await`/`run` carries between rounds in `request_state`."""

    deadline: float | None = None  # wall-clock end of the whole call
    asked: list[str] = field(default_factory=list)
    spawned: str | None = None  # `run`: the handle it already spawned
    rounds: int = 0  # input-required results this call has returned

    @staticmethod
    def load(raw: str | None) -> _State:
        if not raw:
            return _State()
        try:
            data = json.loads(raw)
            return _State(
                deadline=float(data["deadline"]) if data.get("deadline") is not None else None,
                asked=[str(a) for a in data.get("asked", [])],
                spawned=data.get("spawned"),
                rounds=int(data.get("rounds", 0)),
            )
        except (ValueError, TypeError, KeyError):
            return _State()

    def dump(self) -> str:
        return json.dumps(
            {
                "deadline": self.deadline,
                "asked": self.asked,
                "spawned": self.spawned,
                "rounds": self.rounds,
            }
        )

    def seconds_left(self, now_wall: float, timeout: float) -> float:
        """This round's share of the call: the whole `timeout` in the first round, then
        what the carried deadline leaves.  The client hands the state back, so a
        deadline it altered is held to the most any call may wait."""
        if self.deadline is None:
            return timeout
        return min(self.deadline - now_wall, AWAIT_MAX_S)


def _answer(handle: str, action: object, content: object) -> bool | None:
    """`approval.answer`, with an `accept` it cannot read logged: the approval stays
    open (for `approve`), and whoever runs the gateway sees which client said what."""
    allow = approval.answer(action, content)
    if allow is None and action == "accept":
        log.warning(
            "the answer to run %s's approval was not taken: accept with content %.200r "
            '(expected {"allow": true|false})',
            handle,
            content,
        )
    return allow


def _elicit_request(s: RunStatus) -> ElicitRequest:
    return ElicitRequest(params=ElicitRequestFormParams.model_validate(approval.elicit_params(s)))


def _arguments(values: dict[str, Any]) -> dict[str, Any]:
    """A tool function's `locals()` at its first line: its parameters, without `ctx`."""
    return {k: v for k, v in values.items() if k != "ctx"}


def _problems(exc: ValidationError) -> str:
    """Pydantic's errors as `field: what was wrong`, without its headline and links."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors()
    )


def _each(handles: list[str], statuses: list[RunStatus]) -> list[RunStatus]:
    """The status of each handle, in order, from the statuses of the distinct ones."""
    by_handle = {s.handle: s for s in statuses}
    return [by_handle[h] for h in handles]


# What a call of `approve` is told where the operator turned it off ([mcp] approve_tool).
APPROVE_WITHHELD = (
    "approvals here are the user's alone ([mcp] approve_tool = false): `await` of the run "
    "asks the user in a client that shows forms (elicitation), as a task's tasks/get "
    "does; or cancel the run"
)


class _DoorServer(MCPServer):
    """The SDK's server, stricter and plainer about a call's arguments: a name the tool
    does not take is an error (a misspelt `maxToolcalls` would silently be the default),
    and a value out of shape says which field and why, without pydantic's headline and
    links (the SDK's `Error executing tool <name>:` prefix is kept, as on every error)."""

    # What its calls began in the background, which a stop waits for (set below).
    background: Background
    # Tools the operator turned off, and what a call of one is told (set below).
    withheld: dict[str, str]

    def tool_result(self, name: str, value: Any) -> dict[str, Any]:
        """The result a call of tool `name` that returned `value` has on the wire."""
        tool = self._tool_manager.get_tool(name)
        assert tool is not None, name
        result = tool.fn_metadata.convert_result(value)
        return result.model_dump(mode="json", by_alias=True, exclude_none=True)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        tool = self._tool_manager.get_tool(name)
        if tool is None:
            # MCP lists an unknown tool among the protocol errors (-32602), not a
            # tool's own (isError).
            known = ", ".join(t.name for t in self._tool_manager.list_tools())
            why = f" ({self.withheld[name]})" if name in self.withheld else ""
            raise MCPError(
                code=INVALID_PARAMS, message=f"Unknown tool: {name}{why}; the tools are: {known}"
            )
        takes = tool.parameters.get("properties") or {}
        unknown = sorted(set(arguments) - set(takes))
        if unknown:
            raise ToolError(
                f"Error executing tool {name}: unknown argument(s) "
                f"{', '.join(map(repr, unknown))}; it takes {', '.join(takes) or 'none'}"
            )
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            # Only the arguments' validation: a ValidationError inside a tool's body is
            # a crash (UnexpectedToolError), not the caller's mistake.
            if isinstance(exc.__cause__, ValidationError) and not isinstance(
                exc, UnexpectedToolError
            ):
                raise ToolError(
                    f"Error executing tool {name}: {_problems(exc.__cause__)}"
                ) from None
            # The SDK hides a crash's message from the client (it may say what it
            # should not).  A part that is down is no crash: the caller is told which,
            # rather than a bare "Error executing tool spawn".
            down = _unavailable(exc.__cause__) if isinstance(exc, UnexpectedToolError) else None
            if down is not None:
                raise ToolError(f"Error executing tool {name}: {down}") from exc.__cause__
            raise


class _StringsKept(FuncMetadata):
    """The SDK's arguments, but a string for a parameter that takes strings stays that
    string.  The SDK JSON-decodes a string given for any parameter not typed exactly
    `str` (for clients that send a list as its JSON text): a `system` of
    '{"format": "json"}' was refused as no string, and one of "null" dropped
    (helper-179).  Lists sent as JSON text are still decoded."""

    @classmethod
    def of(cls, m: FuncMetadata) -> _StringsKept:
        return cls.model_construct(**{k: getattr(m, k) for k in type(m).model_fields})

    def pre_parse_json(self, data: dict[str, Any]) -> dict[str, Any]:
        parsed = super().pre_parse_json(data)
        fields = self.arg_model.model_fields
        by_key = {f.alias or k: f for k, f in fields.items()} | dict(fields)
        return {
            k: v
            if isinstance(v, str) and k in by_key and _takes_str(by_key[k].annotation)
            else parsed[k]
            for k, v in data.items()
        }

    def convert_result(self, result: Any) -> CallToolResult | InputRequiredResult:
        """The SDK's result, with its text copy the structured content as compact JSON
        (the spec asks that structured content also be sent serialised as text).  The
        SDK would indent it: some 120 characters more per run an `await` shows, 260 with
        a budget (2,450 and 5,200 for 20 runs, measured before null fields were left
        out), counted against a client's bound on the result like the rest.  A
        CallToolResult the tool made itself keeps its own text."""
        if isinstance(result, CallToolResult):
            return super().convert_result(result)
        converted = super().convert_result(result)
        if isinstance(converted, CallToolResult) and converted.structured_content is not None:
            text = pydantic_core.to_json(converted.structured_content).decode()
            converted.content = [TextContent(type="text", text=text)]
        return converted


def _takes_str(annotation: Any) -> bool:
    """Whether a parameter of this type takes a string as it is."""
    if annotation is str:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in get_args(annotation))
    return any(_takes_str(a) for a in get_args(annotation) if get_origin(annotation) in _UNIONS)


_UNIONS = (Union, UnionType, Annotated)


def _causes(exc: BaseException | None) -> list[BaseException]:
    """The exception, what caused it, and the members of exception groups, in order."""
    seen: list[BaseException] = []
    ids: set[int] = set()
    todo = [exc] if exc is not None else []
    while todo and len(seen) < 32:
        e = todo.pop(0)
        if id(e) in ids:
            continue
        ids.add(id(e))
        seen.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return seen


def _unavailable(exc: BaseException | None) -> str | None:
    """Why a tool could not do its work because Temporal or a tool server is down, or
    Temporal's namespace is not set up for luftpause; None if that is not why it
    failed."""
    for e in _causes(exc):
        # UNAVAILABLE is the connection failing (connected once, gone since: "tcp
        # connect error"), but as well Temporal reached and saying it cannot serve the
        # call now (a workflow too busy to lock, "timeout locking workflow execution";
        # a namespace failing over; too few hosts up): "unreachable" sent an operator
        # to look for a server that was there (helper-249).  The client's SDK retried
        # either for some 15 s first.  DEADLINE_EXCEEDED is the call's time running
        # out, whether Temporal was away or slow.  The message says which.
        if isinstance(e, RPCError) and e.status == RPCStatusCode.UNAVAILABLE:
            return f"{RUN_STORE_DOWN} is unavailable: {e.message}"
        if isinstance(e, RPCError) and e.status == RPCStatusCode.DEADLINE_EXCEEDED:
            return f"{RUN_STORE_DOWN} did not answer in time: {e.message}"
        if isinstance(e, RPCError) and _unready(e):
            # helper-135: a namespace misspelt, or made without the search attributes,
            # was a bare "Error executing tool spawn" (the cause in the gateway's log).
            return f"{RUN_STORE_DOWN} refused it: {e.message}: {NAMESPACE_SETUP}"
        if isinstance(e, ConnectionError) and str(e).startswith("mcp server "):
            return f"a tool server is unreachable: {e}"
    return None


NAMESPACE_SETUP = (
    "the namespace ([temporal] namespace) must exist and have luftpause's search "
    "attributes (deploy/k8s/README.md, step 2)"
)


def _unready(e: RPCError) -> bool:
    """Temporal's refusal for a namespace it lacks, or one without the search
    attributes runs are listed by."""
    text = e.message.lower()
    if e.status == RPCStatusCode.NOT_FOUND:
        return "namespace" in text
    return e.status == RPCStatusCode.INVALID_ARGUMENT and "search attribute" in text


def _not_blank(what: str) -> AfterValidator:
    """A string argument that must say something: one of only whitespace passes
    `min_length` and was taken (a `parent` of "  " started a run of its own, outside
    the tree and budget it was meant for; a `task` of "  " asked the model nothing).
    The schema says so too (`pattern`, unanchored as JSON Schema's are)."""

    def check(value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"{what} (it is only whitespace)")
        return value

    return AfterValidator(check)


_SAYS_SOMETHING = {"pattern": r"\S"}
_BLANK_TASK = _not_blank("give the sub-agent's task")
Task = Annotated[
    str,
    Field(
        min_length=1,
        max_length=PROMPT_MAX_CHARS,
        description="what the sub-agent should do",
        json_schema_extra=_SAYS_SOMETHING,
    ),
    _BLANK_TASK,
]
Handle = Annotated[
    str, Field(min_length=1, max_length=HANDLE_MAX_CHARS, description="a run handle from spawn")
]
MaxChars = Annotated[
    int,
    Field(
        strict=True,
        ge=RESULT_ANSWER_CHARS_MIN,
        le=RESULT_ANSWER_CHARS_MAX,
        description="characters this result's answers, pending calls' arguments and "
        "errors take in it at most (as its JSON writes them: a quote or newline is 2), "
        "shared by its runs; read an answer's rest with the answer tool",
    ),
]

# The parameters `spawn`, `run` and RunArgs share, declared once: the two tools' schemas
# say the same, and the Tasks extension's RunArgs checks what the tools check.
Model = Annotated[
    str | None,
    Field(max_length=MODEL_MAX_CHARS, description="model name; default: the pool's first"),
]
ServiceClass = Annotated[
    Literal["interactive", "batch"],
    Field(description="interactive runs are admitted before batch runs"),
]
System = Annotated[str | None, Field(max_length=PROMPT_MAX_CHARS, description="system prompt")]
MaxToolCalls = Annotated[
    int,
    Field(strict=True, ge=0, le=MAX_TOOL_CALLS_LIMIT, description="tool-call budget of the run"),
]
Tools = Annotated[
    list[ToolName] | None,
    Field(
        max_length=TOOLS_MAX,
        description="the tools it may use, by name or by function as tools() "
        "lists them (a function picks its server's); default all",
    ),
]
MaxTokens = Annotated[
    int,
    Field(strict=True, ge=0, le=MAX_TOKENS_LIMIT, description="reply tokens per turn; 0 = engine"),
]
ParallelToolCalls = Annotated[
    bool, Field(strict=True, description="run a turn's tool calls concurrently")
]
Parent = Annotated[
    str | None,
    Field(
        min_length=1,
        max_length=HANDLE_MAX_CHARS,
        description="handle of a running run this one belongs to",
        json_schema_extra=_SAYS_SOMETHING,
    ),
    _not_blank("give a running run's handle, or leave parent out for a run of its own"),
]
BudgetTokens = Annotated[
    int | None,
    Field(strict=True, gt=0, le=BUDGET_TOKENS_MAX, description="tokens, whole subtree"),
]
BudgetToolCalls = Annotated[
    int | None,
    Field(
        strict=True,
        gt=0,
        le=BUDGET_TOOL_CALLS_MAX,
        description="tool calls, whole subtree (this run makes none over it: "
        "then it answers without tools)",
    ),
]
BudgetSeconds = Annotated[
    float | None,
    Field(
        strict=True, gt=0, le=BUDGET_SECONDS_MAX, description="seconds, whole subtree (max 30 days)"
    ),
]
ApproveTools = Annotated[
    list[ToolName] | None,
    Field(max_length=TOOLS_MAX, description="tools that wait for the user's approval"),
]


class RunArgs(BaseModel):
    """The arguments of `spawn` and `run`: one conversion to a RunSpec for both tools and
    for the Tasks extension, which takes a `run` call before the tool validates it (the
    bounds repeat the tools' parameters)."""

    # Ignored: a tool builds its RunArgs from its locals(), which hold the closures it
    # uses; names a client made up are refused before (_DoorServer, start_task_run).
    model_config = ConfigDict(extra="ignore")

    task: Annotated[str, Field(min_length=1, max_length=PROMPT_MAX_CHARS), _BLANK_TASK]
    model: Model = None
    serviceClass: ServiceClass = "interactive"
    system: System = None
    maxToolCalls: MaxToolCalls = 8
    tools: Tools = None
    maxTokens: MaxTokens = 256
    parallelToolCalls: ParallelToolCalls = False
    parent: Parent = None
    budgetTokens: BudgetTokens = None
    budgetToolCalls: BudgetToolCalls = None
    budgetSeconds: BudgetSeconds = None
    approveTools: ApproveTools = None
    timeout: float = Field(AWAIT_MAX_S, strict=True, gt=0, le=AWAIT_MAX_S)
    maxChars: MaxChars = RESULT_ANSWER_CHARS


def create_mcp_server(deps: DoorDeps) -> _DoorServer:
    """The MCP server of the door, built from its dependencies."""
    background = Background()
    told = approval.RecentKeys(TOLD_KEPT)

    def tell(statuses: Sequence[RunStatus]) -> None:
        """The approvals pending in what a wait answers: its caller has seen them."""
        for st in statuses:
            if st.pending_approval is not None:
                told.add(approval.question_key(st))

    tasks = TasksExtension(
        runs=lambda ctx: runs(ctx),
        start_run=lambda arguments, ctx: start_task_run(arguments, ctx),
        result=lambda status: run_result(status).model_dump(
            mode="json", by_alias=True, exclude_none=True
        ),
        unavailable=_unavailable,
        background=background,
        approve_tool=deps.approve_tool,
    )
    mcp = _DoorServer(
        name="luftpause",
        version=_version(),
        extensions=[tasks],
        instructions=(
            "Sub-agents on the user's own inference engines, durable across restarts. "
            "Fan out: spawn several runs, then await them in one call. Each run loops LLM "
            "turns and tool calls until it answers."
        ),
        log_level="WARNING",
        # The state lives as long as any round may (a call's deadline is at most
        # AWAIT_MAX_S away; a user answers within it).
        request_state_security=(
            RequestStateSecurity(keys=[deps.state_key], ttl=AWAIT_MAX_S + STATE_TTL_SLACK_S)
            if deps.state_key
            else RequestStateSecurity.ephemeral(ttl=AWAIT_MAX_S + STATE_TTL_SLACK_S)
        ),
    )
    mcp.background = background
    mcp.withheld = {} if deps.approve_tool else {"approve": APPROVE_WITHHELD}

    async def runs(ctx: Any) -> Runs:
        """The runs a request may see: a caller's own token, only that caller's."""
        try:
            every = await deps.runs()
        except RunStoreDown as exc:  # it names the address
            raise ToolError(str(exc)) from None
        except Exception as exc:
            raise ToolError(f"{RUN_STORE_DOWN} is unreachable: {exc}") from None
        tenant = tenant_of(ctx)
        return every if tenant is None else CallerRuns(every, tenant)

    def spec_of(a: RunArgs, ctx: Any) -> RunSpec:
        """The run a `spawn`/`run` call asks for (the model checked, the caller named)."""
        model = a.model
        models = deps.models()
        if model is None:
            if not models:
                raise ToolError("no generative endpoint is configured; there is no model to run")
            model = models[0]
        elif model not in models:
            raise ToolError(
                f"unknown model {model!r}: expected one of {', '.join(map(repr, models))}"
            )
        encoded = len(json.dumps(a.task)) + len(json.dumps(a.system or ""))
        if encoded > PROMPT_MAX_BYTES:
            raise ToolError(
                f"task and system: {encoded:,} bytes as Temporal encodes them (a character "
                f"outside ASCII takes 6 or 12); at most {PROMPT_MAX_BYTES:,} together: a "
                "run carries them in its input and in every turn's, which Temporal "
                "refuses past 2 MiB"
            )
        return RunSpec(
            task=a.task,
            model=model,
            service_class=a.serviceClass,
            system=a.system,
            max_tool_calls=a.maxToolCalls,
            tools=a.tools,
            max_tokens=a.maxTokens,
            parallel_tool_calls=a.parallelToolCalls,
            caller=caller_of(ctx, deps.token_identity),
            parent=a.parent,
            budget=Budget(
                tokens=a.budgetTokens, tool_calls=a.budgetToolCalls, seconds=a.budgetSeconds
            ),
            approve_tools=list(a.approveTools or []),
        )

    async def check_tools(names: list[str] | None) -> None:
        if not names:
            return
        try:
            # Only the servers that offer these names need be up, as for the run.
            listed = (await deps.upstream_tools(names)).tools
        except ConnectionError as exc:
            raise ToolError(f"a tool server is unreachable: {exc}") from None
        unknown = unknown_tools(listed, names)
        if unknown:
            known = sorted({t.name for t in listed} | {t.offered for t in listed})
            raise ToolError(
                f"unknown tool(s) {', '.join(map(repr, unknown))}: expected names from "
                f"the tools() list ({', '.join(known) or 'none configured'})"
            )

    async def spawn_run(
        spec: RunSpec, ctx: Any, handle: str | None = None, turn: SpawnTurn | None = None
    ) -> str:
        await check_tools(spec.tools)
        await check_tools(spec.approve_tools)
        r = await runs(ctx)
        try:
            return await r.spawn(spec, handle=handle, turn=turn)
        except RunError as exc:
            raise ToolError(str(exc)) from None

    async def start_for_the_call(
        spec: RunSpec, ctx: Any, *, follow: bool = False, total: float | None = None
    ) -> str:
        """`spawn_run` for a call that returns the run's handle once it has started
        (`spawn`), or later (`run`, and its task).  A call cut before the run's request
        went out (a child waiting its turn at its parent) cancels the start: nothing is
        sent, and the child leaves the line (helper-248: it was sent in its turn, and
        refused, at the parent that is the bottleneck).  One cut later (up to 30 s for
        the parent's worker to take the child) withdraws a child's request, lets the
        start go on, then cancels the run (helper-144: the child ran to its end, its
        handle never given; helper-152: so did a cut `spawn`'s).  `follow`: progress
        while a child waits its turn and is sent, to a call that asked for progress
        (`total`: as `_follow_turn`'s)."""
        handle = new_handle()  # known before it exists: a cut start's run is found
        turn = SpawnTurn()
        starting = asyncio.ensure_future(spawn_run(spec, ctx, handle, turn))
        following = (
            asyncio.ensure_future(_follow_turn(ctx, turn, total))
            if follow and spec.parent and _progress_asked(ctx)
            else None
        )
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            if not turn.sending:  # (read as the cut comes: no await since)
                starting.cancel()
                background.run(_unsent(starting, handle), f"the start of run {handle}")
            else:
                background.run(
                    _once_started(starting, lambda: runs(ctx), handle, spec.parent),
                    f"the cancel of run {handle}",
                )
            raise
        finally:
            if following is not None:
                following.cancel()

    async def no_worker(ctx: Any) -> str | None:
        """Why a run just spawned will not start soon: no worker polls its task queue
        (none runs, or it polls another: `luftpause worker --task-queue`, helper-113;
        the run waited in Temporal with nothing said).  None: one does, or Temporal
        could not say."""
        try:
            r = await runs(ctx)
            if await r.workers() > 0:
                return None
        except Exception:
            return None
        why = (
            f"no worker polls task queue '{r.task_queue}': the run starts when one does "
            "(is `luftpause worker` running, on the gateway's [temporal] task_queue?)"
        )
        log.warning("spawn: %s", why)
        return why

    async def start_task_run(arguments: dict[str, Any], ctx: Any) -> tuple[str | None, str]:
        """Start a `run` for the Tasks extension: (handle, "") or (None, tool error)."""
        unknown = sorted(set(arguments) - set(RunArgs.model_fields))
        if unknown:
            return None, (
                f"run: unknown argument(s) {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(RunArgs.model_fields)}"
            )
        try:
            a = RunArgs.model_validate(arguments)
        except ValidationError as exc:
            return None, f"run: {_problems(exc)}"
        if a.maxChars != RESULT_ANSWER_CHARS:
            # tasks/get builds the result later, from the run alone: the call's
            # arguments are not kept, and a maxChars it would not hold is refused.
            return None, (
                f"run: maxChars is not kept for a task: its result shows at most "
                f"{RESULT_ANSWER_CHARS:,} answer characters (the `answer` tool reads the "
                "rest); leave it out, or spawn and await with maxChars"
            )
        try:
            spec = spec_of(a, ctx)
            return await start_for_the_call(spec, ctx), ""
        except ToolError as exc:
            return None, str(exc)
        except Exception as exc:
            down = _unavailable(exc)  # as the plain tool call says it
            if down is None:
                raise
            return None, down

    async def answer_elicited(ctx: Context, r: Runs) -> list[str]:
        """Deliver the answers a 2026-07-28 client sent for our approval questions;
        return the question keys that were asked."""
        state = _State.load(ctx.request_state)
        for key, response in (ctx.input_responses or {}).items():
            # Only answers to questions this call asked (the sealed state says which):
            # any other key is ignored, as MCP asks, so an answer lands on no call the
            # user was not shown.
            parsed = approval.parse_key(key) if key in state.asked else None
            if parsed is None:
                continue
            allow = _answer(
                parsed[0], getattr(response, "action", None), getattr(response, "content", None)
            )
            if allow is not None:
                try:
                    await r.approve(parsed[0], allow, parsed[1])
                except RunUnavailable as exc:  # not taken: say so, the client may resend
                    raise ToolError(str(exc)) from None
                except RunError:
                    pass  # answered meanwhile by `approve`
        return state.asked

    async def wait(
        ctx: Context,
        handles: list[str],
        mode: str,
        timeout: float,
        *,
        spawned: str | None = None,
        named: Callable[[], None] = lambda: None,
        started: bool = False,
        before: int = 0,
    ) -> tuple[list[RunStatus], bool] | InputRequiredResult:
        """Wait as `await` does.  While a covered run waits for approval, a client that
        can answer elicitations is asked: mid-call on legacy sessions; on 2026-07-28 by
        ending this round with an input-required result (the client answers and calls
        again, and `request_state` carries the deadline and the questions asked).
        `spawned`: `run`'s run, named in the progress (then `named()` is called);
        `started` just now (a worker is looked for, once it is named).  `before`: the
        steps of the call its progress counted before the wait (`run`'s child getting
        in at its parent), each 1 of the total: the wait's progress goes on from there."""
        r = await runs(ctx)
        if not 0 < timeout <= AWAIT_MAX_S:
            raise ToolError(f"timeout: expected more than 0 and at most {AWAIT_MAX_S:g} seconds")
        loop = asyncio.get_running_loop()
        state = _State.load(ctx.request_state)
        asked = set(await answer_elicited(ctx, r)) if ctx.request_state else set()
        now_wall = time.time()
        deadline = loop.time() + state.seconds_left(now_wall, timeout)
        caps = ctx.client_capabilities
        can_elicit = approval.can_ask(caps)
        modern = ctx.protocol_version == approval.MODERN
        statuses: list[RunStatus] = []
        seen = Rounds()
        reported: tuple[int, float] = (-1, loop.time())
        beats = 0  # progress sent since the count of ended runs last changed

        async def progress(ended: int) -> None:
            """Progress: a run ended, or a heartbeat.  MCP's progress must increase with
            each notification: a heartbeat (no run ended since the last) adds a part
            short of the next run, ended + 1/2, 2/3, 3/4, ..."""
            nonlocal reported, beats
            beats = beats + 1 if ended == reported[0] else 0
            reported = (ended, loop.time())
            # `run`'s own run named in each: the client has its handle before its end,
            # to find it again if the call is cut (a gateway restart: helper-132).
            named = f" (run {spawned})" if spawned is not None else ""
            # Waiting for any: the first end is the whole of it (and ends the wait).
            total, what = (
                (1, f"waiting for the first of {len(handles)} runs to end")
                if mode == "any"
                else (len(handles), f"{ended} of {len(handles)} runs ended{named}")
            )
            value = before + ended + beats / (beats + 1)
            with contextlib.suppress(Exception):
                await ctx.report_progress(value, before + total, what)

        if spawned is not None:
            await progress(0)
            # Named only where progress goes out: to a request with a progress token
            # (helper-148: without one, the client never had the handle).
            if _progress_asked(ctx):
                named()
            if started:
                await no_worker(ctx)  # said in the gateway's log; the wait goes on

        while True:
            left = deadline - loop.time()
            # A client that can be asked needs new approvals seen soon; for any other,
            # a round ends when a run does (for progress) or after PROGRESS_EVERY_S.
            # Each round asks a worker only about runs whose history grew (`Rounds`).
            step = APPROVAL_POLL_S if can_elicit else PROGRESS_EVERY_S
            try:
                statuses = await _round(r, handles, mode, seen, min(left, step))
            except RunError as exc:
                raise ToolError(str(exc)) from None
            ended, done = _ended(statuses, mode)
            if done or loop.time() >= deadline:
                tell(statuses)
                return statuses, done
            waiting = [
                s
                for s in statuses
                if can_elicit
                and s.pending_approval is not None
                and approval.question_key(s) not in asked
            ]
            if (
                not waiting
                and _all_wait_for_approval(statuses)
                and any(
                    approval.question_key(st) not in told
                    for st in statuses
                    if st.pending_approval is not None
                )
            ):
                # Each waits on a question this call will not ask (a client that cannot
                # answer forms, or one that was asked and dismissed it), and one of
                # them no wait has shown yet: waiting on would only hold the caller,
                # `run` up to 10 minutes (helper-155).  The runs as they are, each with
                # its pendingApproval, for `approve`.  Once shown, a wait goes on to its
                # timeout as before (an answer from another client, a budget, a cancel
                # may end it: helper-158, a caller polling `await` woke every round).
                tell(statuses)
                return statuses, done
            if waiting and modern and state.rounds >= INPUT_ROUNDS_MAX:
                # Clients give up a call past a number of rounds (the official one
                # after 10): the runs as they are, each waiting one with its handle,
                # for `approve` and another `await`.
                tell(statuses)
                return statuses, done
            if waiting and modern:
                return InputRequiredResult(
                    input_requests={approval.question_key(s): _elicit_request(s) for s in waiting},
                    request_state=_State(
                        # (The wall clock now: the round's own time is spent already.)
                        deadline=time.time() + (deadline - loop.time()),
                        asked=sorted(asked | {approval.question_key(s) for s in waiting}),
                        spawned=spawned,
                        rounds=state.rounds + 1,
                    ).dump(),
                )
            if waiting:
                # One question a round (the next round reads the runs again, so no run
                # is asked about from a stale status), for as long as it has a point.
                s = waiting[0]
                asked.add(approval.question_key(s))
                pending = s.pending_approval
                assert pending is not None
                # Asked as 2026-07-28 rounds ask, the answer read as there: the SDK's
                # `ctx.elicit` read it by its own rules, so "true" allowed a call here
                # and not there, and `{}` was dropped with a line at INFO (helper-208).
                params = approval.elicit_params(s)
                question = asyncio.ensure_future(
                    ctx.request_context.session.elicit_form(
                        params["message"],
                        params["requestedSchema"],
                        related_request_id=ctx.request_id,
                    )
                )
                moot = asyncio.ensure_future(
                    _moot(r, handles, mode, s.handle, pending.call_id, deadline)
                )
                try:
                    # Within the call's timeout: a user who does not answer does not
                    # hold the call (the approval stays open, for `approve` or the
                    # next `await`); nor past the wait's end (a run ended), or an
                    # answer given elsewhere (`approve`, another client).  Progress
                    # goes on meanwhile: a client may give up a call that sends none
                    # (Claude Code after about 5 minutes) while its user reads.
                    while loop.time() < deadline:
                        answered, _ = await asyncio.wait(
                            (question, moot),
                            timeout=max(0.001, min(deadline - loop.time(), PROGRESS_EVERY_S)),
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                        if answered:
                            break
                        if loop.time() - reported[1] >= PROGRESS_EVERY_S:
                            await progress(ended)
                finally:
                    for task in (question, moot):
                        task.cancel()
                    await asyncio.gather(question, moot, return_exceptions=True)
                answer = None
                if not question.cancelled():
                    if (refused := question.exception()) is not None:
                        # The client refused the request: use `approve`.
                        log.info("elicitation for %s failed: %s", s.handle, refused)
                    else:
                        answer = question.result()
                if answer is not None:
                    allow = _answer(s.handle, answer.action, answer.content)
                    if allow is not None:
                        try:
                            await r.approve(s.handle, allow, pending.call_id)
                        except RunUnavailable as exc:  # the user's answer was not taken
                            raise ToolError(str(exc)) from None
                        except RunError:
                            pass  # answered meanwhile by `approve`
            # Progress whenever a run ends, and every PROGRESS_EVERY_S while none does.
            if ended != reported[0] or loop.time() - reported[1] >= PROGRESS_EVERY_S:
                await progress(ended)

    @mcp.tool(
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, open_world_hint=True
        )
    )
    async def spawn(
        ctx: Context,
        task: Task,
        model: Model = None,
        serviceClass: ServiceClass = "interactive",
        system: System = None,
        maxToolCalls: MaxToolCalls = 8,
        tools: Tools = None,
        maxTokens: MaxTokens = 256,
        parallelToolCalls: ParallelToolCalls = False,
        parent: Parent = None,
        budgetTokens: BudgetTokens = None,
        budgetToolCalls: BudgetToolCalls = None,
        budgetSeconds: BudgetSeconds = None,
        approveTools: ApproveTools = None,
    ) -> SpawnResult:
        """Start a sub-agent run and return its handle: at once, or with `parent` once
        the parent's worker has taken it (spawns at one parent wait their turns, 8 at a
        time: hundreds at once take minutes, progress telling how many are ahead; send
        a few at a time). Spawn several runs, then `await` them together: they run in
        parallel on the user's engines and survive restarts. Each run loops LLM turns
        and tool calls until it answers; after `maxToolCalls` calls it must answer."""
        arguments = _arguments(locals())
        spec = spec_of(RunArgs.model_validate(arguments), ctx)
        handle = await start_for_the_call(spec, ctx, follow=True)
        try:
            warning = await no_worker(ctx)
        except asyncio.CancelledError:
            # Cut after the start, before the handle went out (helper-153): as a cut start.
            background.run(cancel_quietly(lambda: runs(ctx), handle), f"the cancel of {handle}")
            raise
        return SpawnResult(handle=handle, state="Running", warning=warning)

    # Not read-only: the user's answers to the approval questions it asks let calls run.
    @mcp.tool(
        name="await",
        meta=CLAUDE_RESULT_META,
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, open_world_hint=False
        ),
    )
    async def await_(
        ctx: Context,
        handles: Annotated[list[Handle], Field(min_length=1, max_length=1000)],
        mode: Annotated[
            Literal["all", "any"], Field(description="wait for all runs, or the first to end")
        ] = "all",
        timeout: Annotated[
            float,
            Field(
                strict=True, gt=0, le=AWAIT_MAX_S, description="seconds to wait at most (max 600)"
            ),
        ] = DEFAULT_AWAIT_S,
        maxChars: MaxChars = RESULT_ANSWER_CHARS,
    ) -> AwaitResult | InputRequiredResult:
        """Wait for runs to end (all, or any), at most `timeout` seconds; return every
        run's state and, for finished runs, the answer with `toolCalls` and
        `failedToolCalls` (0 tool calls means the answer did not come from tools).
        A run waiting for the user's approval is asked about, if the client can."""
        waited = await wait(ctx, list(dict.fromkeys(handles)), mode, timeout)
        if isinstance(waited, InputRequiredResult):
            return waited
        statuses, done = waited
        runs_ = views(_each(handles, statuses), maxChars, detail=False)
        return AwaitResult(runs=runs_, done=done)

    @mcp.tool(
        meta=CLAUDE_RESULT_META,
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False),
    )
    async def run(
        ctx: Context,
        task: Task,
        model: Model = None,
        serviceClass: ServiceClass = "interactive",
        system: System = None,
        maxToolCalls: MaxToolCalls = 8,
        tools: Tools = None,
        maxTokens: MaxTokens = 256,
        parallelToolCalls: ParallelToolCalls = False,
        parent: Parent = None,
        budgetTokens: BudgetTokens = None,
        budgetToolCalls: BudgetToolCalls = None,
        budgetSeconds: BudgetSeconds = None,
        approveTools: ApproveTools = None,
        timeout: Annotated[float, Field(strict=True, gt=0, le=AWAIT_MAX_S)] = AWAIT_MAX_S,
        maxChars: MaxChars = RESULT_ANSWER_CHARS,
    ) -> Annotated[CallToolResult, RunView] | InputRequiredResult:
        """Run one sub-agent to its end (spawn + await in one call) and return its
        answer. For several at once, prefer spawn + await."""
        arguments = _arguments(locals())
        handle = _State.load(ctx.request_state).spawned  # a later round: never spawn twice
        spawned = handle is None
        # With a parent, the call's progress counts 2 steps: its child's getting in (its
        # turn at the parent, minutes in a burst there), below 1, then its run, from 1:
        # MCP's progress must rise through both, and a client showing progress/total
        # shows half once the parent has the child (every round alike, the total too).
        steps = 0 if parent is None else 1  # (a blank parent is refused: `Parent`)
        if handle is None:
            spec = spec_of(RunArgs.model_validate(arguments), ctx)
            handle = await start_for_the_call(spec, ctx, follow=True, total=steps + 1)
        given = not spawned  # its handle reached the client (in progress; a later round)

        def named() -> None:
            nonlocal given
            given = True

        try:
            waited = await wait(
                ctx,
                [handle],
                "all",
                timeout,
                spawned=handle,
                named=named,
                started=spawned,
                before=steps,
            )
        except BaseException as exc:
            # The client cancelled the call (notifications/cancelled, Esc in a harness;
            # a 2026-07-28 client cancels by closing the request, helper-144) or left:
            # the run it started goes too, as the request's work.  Not when the gateway
            # stops, once the run's handle was given: the run goes on, to be found again
            # (helper-147: cut before, it was a run no client knew of).
            left = isinstance(exc, asyncio.CancelledError) and (not deps.stopping() or not given)
            if _client_cancelled(ctx) or left:
                # Held, and waited for at a stop: the cut's cancel scope cancels this
                # wait again at once (anyio), and the cancel went on untracked, to be
                # cut by the loop's end (helper-148).
                cancel = cancel_quietly(lambda: runs(ctx), handle)
                await asyncio.shield(background.run(cancel, f"the cancel of run {handle}"))
            raise
        if isinstance(waited, InputRequiredResult):
            return waited
        return run_result(waited[0][0], maxChars)

    def run_result(status: RunStatus, max_chars: int = RESULT_ANSWER_CHARS) -> CallToolResult:
        """What `run` returns for its run (and a run's task ends with): the run's view,
        its answer cut to `max_chars`, an error if it ended in ERROR_ENDS."""
        shown = CallToolResult.model_validate(
            mcp.tool_result("run", view(status, max_chars=max_chars))
        )
        return shown.model_copy(update={"is_error": status.state in ERROR_ENDS})

    @mcp.tool(
        meta=CLAUDE_RESULT_META,
        annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
    )
    async def status(
        ctx: Context,
        handles: Annotated[
            list[Handle] | None,
            Field(
                max_length=1000,
                description="runs to show (an empty list shows none); left out: this "
                "caller's 20 most recent runs",
            ),
        ] = None,
        state: Annotated[
            RunState | None,
            Field(description="without handles: only runs in this state (e.g. AwaitingApproval)"),
        ] = None,
        root: Annotated[
            Handle | None,
            Field(description="without handles: only the runs of this run's tree"),
        ] = None,
        parent: Annotated[
            Handle | None, Field(description="without handles: only this run's children")
        ] = None,
        serviceClass: Annotated[
            Literal["interactive", "batch"] | None,
            Field(description="without handles: only runs of this class"),
        ] = None,
        model: Annotated[
            str | None,
            Field(
                max_length=MODEL_MAX_CHARS, description="without handles: only runs of this model"
            ),
        ] = None,
        allCallers: Annotated[
            bool,
            Field(
                strict=True,
                description="without handles: every caller's runs, not only yours (a "
                "caller with a token of its own sees its own still); e.g. a run whose "
                "`run` call a gateway restart cut, started from an MCP session gone since",
            ),
        ] = False,
        maxChars: MaxChars = RESULT_ANSWER_CHARS,
    ) -> StatusResult:
        """Show runs: state, parent and children, usage of the run and its subtree,
        budget, and any approval it waits for."""
        r = await runs(ctx)
        try:
            filters: dict[str, Any] = {
                "state": state,
                "root": root,
                "parent": parent,
                "service_class": serviceClass,
                "model": model,
            }
            if handles is None:
                caller = None if allCallers else caller_of(ctx, deps.token_identity)
                handles = await r.list(caller=caller, **filters)
            elif allCallers or any(v is not None for v in filters.values()):
                raise ToolError(
                    "state, root, parent, serviceClass, model and allCallers filter the "
                    "default list: give them without handles"
                )
            statuses = await r.statuses(list(dict.fromkeys(handles)))  # each asked once
            return StatusResult(runs=views(_each(handles, statuses), maxChars))
        except RunError as exc:
            raise ToolError(str(exc)) from None

    @mcp.tool(
        meta=CLAUDE_RESULT_META,
        annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False),
    )
    async def answer(
        ctx: Context,
        handle: Handle,
        offset: Annotated[
            int, Field(strict=True, ge=0, description="where to start, in characters")
        ] = 0,
        maxChars: Annotated[
            int,
            Field(
                strict=True,
                ge=RESULT_ANSWER_CHARS_MIN,
                le=RESULT_ANSWER_CHARS_MAX,
                description="characters the text takes in the result at most (as its "
                "JSON writes them: a quote or newline is 2)",
            ),
        ] = RESULT_ANSWER_CHARS,
    ) -> AnswerResult:
        """Read more of a run's answer that await, status or run cut: pass its
        answerNextOffset as `offset`.  From there, as much as takes at most `maxChars`
        characters in the result's JSON (a quote or newline is 2: a client's bound on
        the result holds for quote-heavy text too); offsets and totalChars are in the
        answer's characters (Unicode code points), nextOffset where the next part
        starts, null at the end."""
        r = await runs(ctx)
        try:
            s = await r.status(handle)
        except RunError as exc:
            raise ToolError(str(exc)) from None
        if s.answer is None:
            raise ToolError(
                f"run {handle} has no answer: it is {s.state}{_why_no_answer(s, maxChars)}"
            )
        total = len(s.answer)
        if offset > total:
            raise ToolError(f"offset {offset} is past the answer's end: it has {total} characters")
        text = json_start(s.answer[offset : offset + maxChars], maxChars)
        end = offset + len(text)
        return AnswerResult(
            handle=handle,
            text=text,
            offset=offset,
            totalChars=total,
            nextOffset=end if end < total else None,
        )

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))
    async def cancel(ctx: Context, handle: Handle) -> RunView:
        """Cancel a run and its running descendants at once (their work in flight too).
        Returns the run once it has ended, or as it is after about 10 s."""
        r = await runs(ctx)
        try:
            return view(await r.cancel(handle))
        except RunError as exc:
            raise ToolError(str(exc)) from None

    async def approve(
        ctx: Context,
        handle: Handle,
        allow: Annotated[
            bool, Field(strict=True, description="true to let the tool call run (a boolean)")
        ],
        callId: Annotated[
            str | None,
            Field(
                max_length=CALL_ID_MAX_CHARS,
                description="the pendingApproval.callId you were shown; the answer is "
                "refused if the run now waits on another call",
            ),
        ] = None,
    ) -> RunView:
        """Answer the approval a run waits for (state AwaitingApproval): allow or
        decline its pending tool call. A declined call is reported to the run's model.
        The approval is the user's to give: ask them before allowing a call they have
        not approved themselves."""
        r = await runs(ctx)
        try:
            return view(await r.approve(handle, allow, callId))
        except RunError as exc:
            raise ToolError(str(exc)) from None

    # Destructive: allowing lets the very call that waits for a person run (helper-208:
    # marked not destructive, a client that asks before such tools let its model
    # approve its sub-agents' destructive calls unasked, the question dismissed).  Not
    # listed at all where the operator wants approvals from people only: even a client
    # that asks before destructive tools may have been told to allow this one always.
    if deps.approve_tool:
        mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))(approve)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def tools(ctx: Context) -> ToolsResult:
        """The upstream tools sub-agents may use (pass names to spawn's `tools`)."""
        try:
            listing = await deps.upstream_tools(())
        except Exception as exc:  # (a server's unreachable is in the listing)
            raise ToolError(f"the upstream tools could not be listed: {exc}") from None
        return ToolsResult(
            unreachable=listing.unreachable,
            tools=[
                ToolView(
                    name=t.name,
                    function=t.offered,
                    description=t.description,
                    server=t.server,
                    readOnly=t.read_only,
                    destructive=t.destructive,
                    idempotent=t.idempotent,
                    repeatable=t.repeatable,
                    timeoutS=t.timeout_s,
                    inputSchema=t.input_schema,
                )
                for t in listing.tools
            ],
        )

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def decide(
        ctx: Context,
        input: Annotated[str, Field(min_length=1, description="the text to classify")],
        labels: Annotated[
            list[Annotated[str, Field(max_length=LABEL_MAX_CHARS)]] | None,
            Field(description="2 to 20 labels to choose from; omit for the classifier's labels"),
        ] = None,
        model: Annotated[str | None, Field(max_length=MODEL_MAX_CHARS)] = None,
    ) -> DecideResult:
        """Classify `input` in one pass: with `labels`, one 1-token turn scored from the
        first token's logprobs; without, the configured single-pass classifier."""
        status_code, body = await deps.decide(
            input, labels, model, caller_of(ctx, deps.token_identity)
        )
        if status_code != 200:
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
            raise ToolError(str(message or body))
        return DecideResult(
            label=body["label"],
            probabilities=body["probabilities"],
            unscored=body.get("unscored", []),
            mass=body.get("mass"),
        )

    # The schemas say what _DoorServer does: an argument a tool does not take is
    # refused (helper-126: a client reading the schema could not know).
    for tool in mcp._tool_manager.list_tools():
        tool.parameters["additionalProperties"] = False
        tool.fn_metadata = _StringsKept.of(tool.fn_metadata)
        # A description is the docstring as written, its lines indented by the source's
        # 8 spaces, which every client puts in its model's prompt.
        tool.description = inspect.cleandoc(tool.description)
    return mcp
