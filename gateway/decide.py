"""`POST /v1/decide`: pick one label for an input.

Without `labels` the input goes to a single-pass `classifier` endpoint's `/classify`
(vLLM format); such turns never enter run state.  With 2-20 `labels` it becomes one
`max_tokens: 1` interactive chat turn on a generative replica, admitted by the core like
any chat turn (in a run of its own, ended afterwards), and each label is scored by the
first token's `top_logprobs`: a token matches a label when, stripped of leading
whitespace and compared case-insensitively, it is a non-empty prefix of the label; the
label's score is the sum of the probabilities of the tokens that begin it and no other
label (the tokens are distinct answers: "Yes", " Yes" and " yes" are each a way to
begin it; helper-115: the best of them alone under-counted a label whose mass the model
spread over its spellings).

One token decides, so what it cannot tell apart is refused rather than guessed: a
label another begins where tokens split ("no" and "no idea", "1" and "10": the second
could never win) at parse time
(400), and tokens that begin several labels and could decide between them ("Ne" of
"Negative" and "Neutral" first; or "N" taking Negative past Positive) at scoring time
(422).  So is an answer whose first token
put less than MIN_LABEL_MASS on the labels at all (a reasoning model's `<think>`): the
labels' probabilities, normalised among themselves, would read as certain.  `mass`
in the answer is the probability the first token put on the labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import unicodedata
import uuid
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Receive

from gateway._http import (
    credentials_refused,
    describe_http_error,
    no_answer_of,
    wait_disconnect,
)
from gateway._proxy import (
    ENGINE_IDLE_TIMEOUT_S,
    UNAVAILABLE_RETRY_AFTER_S,
    StreamWatch,
    TurnRequest,
    engine_fault,
    error_response,
    hold,
    left_while_held,
)
from gateway._shell import AdmissionShell, Awaited, Rejected
from gateway.prober import auth_headers
from luftpause import telemetry
from luftpause.config import DP_RANK_HEADER, MODEL_MAX_CHARS, Endpoint
from luftpause.headers import RUN_HEADER
from scheduler import (
    Event,
    RunEnded,
    ServiceClass,
    TurnAbandoned,
    TurnFailed,
    TurnFinished,
    TurnStarted,
)

__all__ = [
    "CLIENT_LEFT",
    "MAX_LABELS",
    "MIN_LABELS",
    "SYSTEM_PROMPT",
    "TOP_LOGPROBS",
    "DecideError",
    "DecideRequest",
    "Spread",
    "Unanswered",
    "chat_body",
    "classify",
    "decide",
    "decision",
    "parse_decide",
    "run_turn",
    "score_labels",
    "untold",
]

SYSTEM_PROMPT = "Answer with exactly one of the labels."
MIN_LABELS, MAX_LABELS = 2, 20
# Below this much of the first token's probability on the labels, the model answered
# something else (a `<think>`, "Maybe"): no label is picked (422).
MIN_LABEL_MASS = 0.05
TOP_LOGPROBS = 20
_FIELDS = ("input", "labels", "model")
# Status the route answers when its client left (nobody reads it; nginx's convention).
CLIENT_LEFT = 499

# Told of an engine request that got no answer at all (refused, broken off, timed out,
# its client gone), the one the route's answer is about: the failure's name, semconv's
# `error.type` for an HTTP request without a response (the httpx exception's type, as
# OpenTelemetry's httpx instrumentation names it; `timeout` for the gateway's own
# deadline and `client_left`, which raise none), and what the client is told.  The
# decide span says so instead of the 502, 504 or 499 the gateway answered, which no
# engine did (helper-200).
Unanswered = Callable[[str, str], None]


def untold(error: str, message: str) -> None:
    """No one to tell (no span: the MCP door's decide, a test)."""


class DecideError(Exception):
    """The request cannot be decided: status and message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class DecideRequest:
    input: str
    labels: tuple[str, ...] | None  # None: ask a classifier endpoint
    model: str | None


# --------------------------------------------------------------------------- parsing


def parse_decide(raw: bytes) -> DecideRequest:
    """Validate a `/v1/decide` body strictly; errors (400) name the field."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecideError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise DecideError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise DecideError(400, "request body: expected a JSON object")
    return decide_request(body)


def decide_request(body: dict[str, Any]) -> DecideRequest:
    """Validate a decision's fields (the HTTP body's, or the MCP tool's arguments)."""
    unknown = sorted(k for k in body if k not in _FIELDS)
    if unknown:
        raise DecideError(
            400,
            f"unknown field(s) {', '.join(repr(k) for k in unknown)}: "
            f"expected only {', '.join(_FIELDS)}",
        )
    text = body.get("input")
    if not isinstance(text, str) or not text:
        raise DecideError(400, "input: expected a non-empty string")
    model = body.get("model")
    if model is not None and (
        not isinstance(model, str) or not model or len(model) > MODEL_MAX_CHARS
    ):
        raise DecideError(400, f"model: expected a non-empty string of at most {MODEL_MAX_CHARS}")
    labels = body.get("labels")
    if labels is None:
        return DecideRequest(text, None, model)
    if not isinstance(labels, list):
        raise DecideError(
            400, f"labels: expected a list of {MIN_LABELS} to {MAX_LABELS} distinct strings"
        )
    for i, label in enumerate(labels):
        if not isinstance(label, str) or not label.strip():
            raise DecideError(400, f"labels[{i}]: expected a non-empty string")
        if len(label.strip().splitlines()) > 1:
            # Listed to the model one per line where one has a comma: a line break
            # inside a label would make two.
            raise DecideError(400, f"labels[{i}]: expected one line, got {label!r}")
    if not MIN_LABELS <= len(labels) <= MAX_LABELS:
        raise DecideError(
            400,
            f"labels: expected {MIN_LABELS} to {MAX_LABELS} distinct labels, got {len(labels)}",
        )
    # Scoring compares a label with the model's first token without case and without
    # the spaces around it, so labels equal that way could never be told apart.
    folded = [_folded(lab) for lab in labels]
    repeated = [lab for i, lab in enumerate(labels) if folded.index(folded[i]) != i]
    if repeated:
        raise DecideError(
            400,
            "labels: expected distinct labels (compared without case and surrounding "
            f"spaces); repeated: {', '.join(map(repr, repeated))}",
        )
    # The first token that spells a whole label counts for it alone: a label that
    # another begins, where tokenizers split ("no" in "no idea" or "no, never"; "1" in
    # "10" or "1st": Qwen and sentencepiece models split every digit), could never be
    # scored (helper-115, helper-117, helper-118).  One whose letters go on with
    # letters ("Not sure" beside "No", "All of the above" beside "A") has a first
    # token of its own.
    begins = [
        f"{a!r} begins {b!r}"
        for a, fa in zip(labels, folded, strict=True)
        for b, fb in zip(labels, folded, strict=True)
        if fb != fa
        and fb.startswith(fa)
        and not (_spaced_letter(fa[-1]) and _spaced_letter(fb[len(fa)]))
    ]
    if begins:
        raise DecideError(
            400,
            "labels: the model's first token decides, and a label that begins another "
            f"cannot be told from it ({'; '.join(begins)}); give labels that start "
            "differently",
        )
    return DecideRequest(text, tuple(labels), model)


# Scripts written without spaces between words, outside East Asia's wide characters:
# Thai, Lao, Tibetan, Myanmar, Khmer.
_UNSPACED = ((0x0E00, 0x0FFF), (0x1000, 0x109F), (0x1780, 0x17FF))


def _spaced_letter(ch: str) -> bool:
    """A letter of a script that puts spaces between words: there, letters going on
    with letters make a first token of their own ("Not" beside "No").  Not so in
    Chinese, Japanese, Thai, ...: "是" beside "是的" (helper-121)."""
    if not ch.isalpha() or unicodedata.east_asian_width(ch) in ("W", "F"):
        return False
    return not any(lo <= ord(ch) <= hi for lo, hi in _UNSPACED)


def _folded(label: str) -> str:
    """A label as scoring compares it with a token."""
    return label.strip().casefold()


def chat_body(request: DecideRequest, model: str) -> bytes:
    """The one-token chat turn that asks the model for a label."""
    assert request.labels is not None
    return json.dumps(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{request.input}\n\n{_listed(request.labels)}"},
            ],
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": TOP_LOGPROBS,
            "temperature": 0,
            "stream": False,
        }
    ).encode()


# What reads as a list's separator: the comma, and the full-width and ideographic ones.
_COMMAS = (",", "\uff0c", "\u3001")


def _listed(labels: Sequence[str]) -> str:
    """The labels as the model reads them: on one line between commas, or one per line
    where a label has a comma of its own (helper-115: "yes, definitely" read as two)."""
    if any(comma in label for label in labels for comma in _COMMAS):
        return "Labels (one per line):\n" + "\n".join(label.strip() for label in labels)
    return f"Labels: {', '.join(labels)}"


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True, slots=True)
class _Partial:
    """A token that ends inside a character: its whole characters (stripped of leading
    whitespace and case-folded) and the first bytes of the character it cut."""

    text: str
    tail: bytes

    def __repr__(self) -> str:
        return repr(self.text + self.tail.decode("utf-8", "backslashreplace"))


_Token = str | _Partial


def _partial(entry: Mapping[str, Any]) -> _Partial | None:
    """The entry as a token that ends inside a character, if its `bytes` do: a
    byte-fallback token (the first bytes of "是" or of "é", which its tokenizer split).
    llama.cpp and OpenAI give a token's own bytes, and text only up to its last whole
    character; vLLM and SGLang give the bytes of the text they decoded, a replacement
    character for the cut one, so such a token matches nothing there."""
    raw = entry.get("bytes")
    if not isinstance(raw, list) or not raw:
        return None
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in raw):
        return None
    data = bytes(raw)
    try:
        data.decode("utf-8")
        return None  # whole characters: the token's text says it
    except UnicodeDecodeError as exc:
        if exc.end != len(data) or exc.reason != "unexpected end of data":
            return None  # bytes that are no UTF-8 at all
        whole, tail = data[: exc.start].decode("utf-8"), data[exc.start :]
    return _Partial(whole.lstrip().casefold(), tail)


def _tokens(top_logprobs: Sequence[Any]) -> list[tuple[_Token, float]]:
    """(token stripped of leading whitespace and case-folded, or a `_Partial`;
    probability) of each well-formed entry."""
    tokens: list[tuple[_Token, float]] = []
    for entry in top_logprobs:
        if not isinstance(entry, dict):
            continue
        token, logprob = entry.get("token"), entry.get("logprob")
        if not isinstance(token, str) or isinstance(logprob, bool):
            continue
        if not isinstance(logprob, int | float) or math.isnan(logprob):
            continue
        p = math.exp(min(float(logprob), 0.0))
        partial = _partial(entry)
        stripped = token.lstrip().casefold()
        if partial is not None:
            tokens.append((partial, p))
        elif stripped:
            tokens.append((stripped, p))
    return tokens


def _matches(token: _Token, folded: str, exact: set[str]) -> bool:
    """Whether a token counts for a label: it begins the label, and a token that is a
    whole label counts for that label only ("yes" is not the start of "yesterday").  A
    token that ends inside a character begins the labels whose next character, in any
    case, begins with its bytes (helper-115: a label in Chinese, or with an accent
    first, never matched)."""
    if isinstance(token, _Partial):
        if not folded.startswith(token.text) or len(folded) == len(token.text):
            return False
        c = folded[len(token.text)]
        return any(form.encode("utf-8").startswith(token.tail) for form in {c, c.upper()})
    return folded.startswith(token) and (token == folded or token not in exact)


def score_labels(
    labels: Sequence[str], top_logprobs: Sequence[Any]
) -> tuple[dict[str, float], list[str]]:
    """(scores of the labels some token spoke for alone, in label order; the others)."""
    scores, unscored, _, _ = _score(labels, _tokens(top_logprobs))
    return scores, unscored


def _score(
    labels: Sequence[str], tokens: list[tuple[_Token, float]]
) -> tuple[dict[str, float], list[str], list[tuple[_Token, float, list[str]]], float]:
    """Each label's score, the sum of the tokens that begin it and no other label (the
    first-token answers are distinct, so a label spread over "Yes", " yes" and " Y"
    adds up; helper-115); the labels no token spoke for alone; the tokens that begin
    several labels, with those labels (they tell none of them apart); and the mass,
    the probability of the tokens that begin any label."""
    folded = [_folded(label) for label in labels]
    exact = set(folded)
    sums: dict[str, list[float]] = {}
    shared: list[tuple[_Token, float, list[str]]] = []
    mass = 0.0
    for token, p in tokens:
        begun = [lb for lb, f in zip(labels, folded, strict=True) if _matches(token, f, exact)]
        if begun:
            mass += p
        if len(begun) == 1:
            sums.setdefault(begun[0], []).append(p)
        elif begun:
            shared.append((token, p, begun))
    scores = {lb: min(1.0, math.fsum(sums[lb])) for lb in labels if lb in sums}
    unscored = [lb for lb in labels if lb not in scores]
    return scores, unscored, shared, min(1.0, mass)  # (an engine's rounding: at most 1)


def decision(labels: Sequence[str], top_logprobs: Sequence[Any]) -> dict[str, Any]:
    """`{label, probabilities, unscored, mass}`; 422 when no label matched any token,
    when the labels got less than MIN_LABEL_MASS of the first token, or when tokens
    that begin several labels could decide between them (see the module docstring)."""
    tokens = _tokens(top_logprobs)
    scores, unscored, shared, mass = _score(labels, tokens)
    if not scores and not shared:
        raise DecideError(
            422,
            f"the model's first token matched none of the labels (unscored: {', '.join(unscored)})",
        )
    if mass < MIN_LABEL_MASS:
        first = max(tokens, key=lambda t: t[1])[0] if tokens else ""
        raise DecideError(
            422,
            f"the model's first token put {mass:.1%} of its probability on the labels "
            f"(its likeliest token: {first!r}): it answered something else; a reasoning "
            "model is asked with its thinking off",
        )
    best = max(scores, key=lambda lab: scores[lab]) if scores else labels[0]
    lead = scores.get(best, 0.0)
    # A label that the tokens it shares with others could take past the best one: one
    # token cannot tell them apart ("Ne" of Negative and Neutral, or "N" making
    # Negative's 0.30 more than Positive's 0.45; helper-121), whatever the labels' order.
    for label in labels:
        if label == best and scores:
            continue
        could = [(tok, p, begun) for tok, p, begun in shared if label in begun]
        if could and scores.get(label, 0.0) + math.fsum(p for _, p, _ in could) >= lead:
            token, _, begun = max(could, key=lambda c: c[1])
            raise DecideError(
                422,
                f"the model's first token {token!r} begins "
                f"{' and '.join(map(repr, begun))} alike: one token cannot tell them "
                "apart; give labels that start differently",
            )
    total = math.fsum(scores.values())
    probabilities = {label: p / total for label, p in scores.items()}
    return {"label": best, "probabilities": probabilities, "unscored": unscored, "mass": mass}


def first_top_logprobs(answer: object) -> list[Any] | None:
    """`choices[0].logprobs.content[0].top_logprobs` of a chat completion, if there."""
    try:
        top = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return None
    return top if isinstance(top, list) else None


# --------------------------------------------------------------------------- upstream


def passed_through(upstream: httpx.Response, run_id: str, replica: str) -> Response:
    """An engine's error answer, unchanged: status, body, content type, Retry-After;
    but a 401, to luftpause's own credentials, is a 502 that says so (its body, which
    may quote the key, goes to the log)."""
    if upstream.status_code == 401:
        return error_response(502, credentials_refused(replica, upstream.text), run_id)
    headers = {RUN_HEADER: run_id}
    retry = upstream.headers.get("retry-after")
    if retry is not None:
        headers["retry-after"] = retry
    return Response(
        upstream.content,
        upstream.status_code,
        headers=headers,
        media_type=upstream.headers.get("content-type"),
    )


async def classify(
    endpoint: Endpoint,
    model: str,
    text: str,
    client: httpx.AsyncClient,
    run_id: str,
    answer_timeout: float = ENGINE_IDLE_TIMEOUT_S,
    unanswered: Unanswered = untold,
) -> Response:
    """Ask a classifier endpoint's `/classify`; `{label, probabilities}` or the error.
    Raises _Unreached when the request could not be sent (another endpoint may take it)."""
    headers = {"content-type": "application/json", **auth_headers(endpoint)}
    telemetry.inject(headers)  # the decide span, when tracing is on
    payload = json.dumps({"model": model, "input": text}).encode()
    # The client's own connect timeout stays; an engine that accepts and never answers
    # is given up after `answer_timeout`, as a proxied turn is.
    timeout = httpx.Timeout(answer_timeout, connect=client.timeout.connect)
    try:
        upstream = await client.post(
            endpoint.url + "/classify", content=payload, headers=headers, timeout=timeout
        )
    except httpx.ReadTimeout as exc:
        message = f"engine {endpoint.name}: no answer within {answer_timeout:g} s"
        unanswered(type(exc).__name__, message)
        return error_response(504, message, run_id)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        message = f"engine {endpoint.name}: {describe_http_error(exc)}"
        raise _Unreached(message, type(exc).__name__) from None
    except httpx.HTTPError as exc:
        message = f"engine {endpoint.name}: {describe_http_error(exc)}"
        unanswered(type(exc).__name__, message)
        return error_response(502, message, run_id)
    if upstream.status_code >= 400:
        return passed_through(upstream, run_id, endpoint.name)
    try:
        first = upstream.json()["data"][0]
        label, probs = first["label"], first["probs"]
    except (ValueError, KeyError, IndexError, TypeError):
        first, label, probs = None, None, None
    probabilities = _named(probs, endpoint.labels)
    if not isinstance(label, str) or probabilities is None:
        message = f"engine {endpoint.name}: /classify answered without data[0].label and probs"
        return error_response(502, message, run_id)
    wrong = [f"{k}: {p!r}" for k, p in probabilities.items() if not 0.0 <= p <= 1.0]
    if wrong:  # NaN too, which would go out as JSON no strict parser reads
        message = (
            f"engine {endpoint.name}: /classify answered probabilities that are not numbers "
            f"from 0 to 1 ({', '.join(wrong[:5])})"
        )
        return error_response(502, message, run_id)
    if isinstance(probs, list) and endpoint.labels and len(probs) != len(endpoint.labels):
        message = (
            f"engine {endpoint.name}: /classify answered {len(probs)} probabilities, but the "
            f"configuration names {len(endpoint.labels)} labels"
        )
        return error_response(502, message, run_id)
    if endpoint.labels and isinstance(probs, list):
        # The probabilities are named by the configuration, which an engine's own names
        # (vLLM's id2label: often LABEL_0, LABEL_1, why `labels` is set) are not: the
        # label is the most probable of them, so that it is a key of `probabilities`.
        label = max(probabilities, key=lambda k: probabilities[k])
    # A classifier scores every one of its labels: none is left unscored.
    body = json.dumps({"label": label, "probabilities": probabilities, "unscored": []})
    return Response(body, headers={RUN_HEADER: run_id}, media_type="application/json")


def _named(probs: object, labels: Sequence[str] = ()) -> dict[str, float] | None:
    """vLLM's probs: a list, named by the endpoint's configured `labels` (by index when
    it has none: the response carries no names), or, from servers that name them, a
    mapping."""
    items: list[tuple[str, object]]
    if isinstance(probs, list):
        names = labels if len(labels) == len(probs) else [str(i) for i in range(len(probs))]
        items = list(zip(names, probs, strict=True))
    elif isinstance(probs, dict):
        items = [(str(k), p) for k, p in probs.items()]
    else:
        return None
    out: dict[str, float] = {}
    for name, p in items:
        if isinstance(p, bool) or not isinstance(p, int | float):
            return None
        out[name] = float(p)
    return out


# --------------------------------------------------------------------------- a turn


async def run_turn(
    turn: TurnRequest,
    *,
    shell: AdmissionShell,
    client: httpx.AsyncClient,
    endpoints: Mapping[str, Endpoint],
    clock: Callable[[], float],
    receive: Receive,
    retry_after: str = UNAVAILABLE_RETRY_AFTER_S,
    awaited: Callable[[str], Awaited | None] = lambda model: None,
    unanswered: Unanswered = untold,
) -> Response | dict[str, Any]:
    """One non-streaming chat turn through the core: held until admitted, posted to the
    admitted replica; its parsed JSON answer, or the response for the client.  Exactly one
    terminal event is reported per arrived turn (none for a rejected one).  An engine
    that has not answered the core's `turn_timeout_s` (as it is at admission: a reload's
    holds for a turn held across it) after admission fails the turn (504).
    `awaited`: as `hold`'s (a 404 for a model whose engines all left is a 503);
    `unanswered`: told of an engine request that got no answer."""
    disconnected = asyncio.ensure_future(wait_disconnect(receive))
    arrived = ended = False

    def end(event: Event) -> None:
        nonlocal ended
        if not ended:
            ended = True
            shell.forget_turn(turn.turn_id)
            shell.apply(event)

    def fail(
        reason: str, engine: bool = False, client_left: bool = False, silent: bool = False
    ) -> None:
        end(
            TurnFailed(
                now=clock(),
                turn_id=turn.turn_id,
                reason=reason,
                engine_fault=engine,
                client_left=client_left,
                timed_out=silent,
            )
        )

    try:
        arrived = True  # an abandon of a turn the core never saw is ignored by it
        outcome = await hold(shell, turn, clock, disconnected, awaited)
        if outcome is None:
            end(left_while_held(shell, turn.turn_id, clock()))
            unanswered("client_left", "client disconnected while held")
            return error_response(CLIENT_LEFT, "client disconnected while held", turn.run_id)
        if isinstance(outcome, Rejected):
            ended = True  # never queued: nothing to report
            return error_response(
                outcome.status,
                outcome.message,
                turn.run_id,
                retry_after=outcome.retry_after or retry_after,
            )
        answer_timeout = shell.turn_timeout(turn.turn_id)
        endpoint = endpoints[outcome]
        headers = {
            "content-type": turn.content_type,
            "accept-encoding": "identity",
            **auth_headers(endpoint),
        }
        if endpoint.dp_rank is not None:  # a rank of a data-parallel server: pin it there
            headers[DP_RANK_HEADER] = str(endpoint.dp_rank)
        telemetry.inject(headers)  # the decide span, when tracing is on
        request = client.build_request(
            "POST", endpoint.api_url("chat"), content=turn.body, headers=headers
        )

        async def exchange() -> httpx.Response:
            upstream = await client.send(request, stream=True)
            try:
                if upstream.status_code < 400:  # an error's head is no first token
                    shell.apply(TurnStarted(now=clock(), turn_id=turn.turn_id))
                await upstream.aread()
            finally:
                await upstream.aclose()
            return upstream

        task = asyncio.ensure_future(exchange())
        try:
            await asyncio.wait(
                (task, disconnected), timeout=answer_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            task.cancel()  # cancelled from outside (shutdown): close the engine request
            raise
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            if disconnected.done():
                fail("client disconnected before the engine answered", client_left=True)
                # Named as a turn's and a count's, not as the 499 nobody read.
                unanswered("client_left", "client disconnected")
                return error_response(CLIENT_LEFT, "client disconnected", turn.run_id)
            # Not the engine's fault (toward ejecting it): the answer is not streamed, so
            # its head comes with its end, and an engine that reports no load may hold it
            # in its queue (helper-128, as on the proxy: _sent_into_room).
            message = f"engine {outcome}: no answer within {answer_timeout:g} s"
            fail(message, engine=False, silent=True)
            unanswered("timeout", message)
            return error_response(504, message, turn.run_id)
        try:
            upstream = task.result()
        except httpx.HTTPError as exc:
            message = f"engine {outcome}: {describe_http_error(exc)}"
            fail(message, engine=True)
            unanswered(type(exc).__name__, message)
            return error_response(502, message, turn.run_id)
        why = no_answer_of(upstream)
        if why is not None:  # a redirect: turns are posted to the endpoint's URL only
            message = f"engine {outcome}: {why}"
            fail(message, engine=True)
            return error_response(502, message, turn.run_id)
        if upstream.status_code >= 400:
            status = upstream.status_code
            fail(f"engine answered {status}", engine_fault(status) or status == 401)
            return passed_through(upstream, turn.run_id, outcome)
        try:
            answer = upstream.json()
        except ValueError:
            message = f"engine {outcome}: answer is not JSON"
            fail(message, engine=True)
            return error_response(502, message, turn.run_id)
        watch = StreamWatch(sse=False)
        watch.feed(upstream.content)
        watch.close()
        end(
            TurnFinished(
                now=clock(),
                turn_id=turn.turn_id,
                finish_reason=watch.finish_reason or "",
                prompt_tokens=watch.prompt_tokens,
                completion_tokens=watch.completion_tokens,
                cached_tokens=watch.cached_tokens,
            )
        )
        return answer if isinstance(answer, dict) else {}
    finally:
        disconnected.cancel()
        if arrived and not ended:
            # Cancelled from outside (server shutdown) or a bug: free the slot.
            end(TurnAbandoned(now=clock(), turn_id=turn.turn_id))


# --------------------------------------------------------------------------- the route


async def decide(
    request: DecideRequest,
    *,
    run_id: str,
    caller: str,
    service_class: ServiceClass = ServiceClass.INTERACTIVE,
    shell: AdmissionShell,
    client: httpx.AsyncClient,
    endpoints: Mapping[str, Endpoint],
    models: Sequence[str],
    classifiers: Sequence[Endpoint],
    clock: Callable[[], float],
    receive: Receive,
    down: Container[str],
    load: ClassifierLoad,
    answer_timeout: float = ENGINE_IDLE_TIMEOUT_S,
    retry_after: str = UNAVAILABLE_RETRY_AFTER_S,
    awaited: Callable[[str], Awaited | None] = lambda model: None,
    refused: Callable[[int], None] = lambda status: None,
    unanswered: Unanswered = untold,
) -> Response:
    """Answer one validated `/v1/decide` request (see the module docstring).
    `endpoints`: where an admitted turn may be; `models`: the pool's, the first the
    default.  `retry_after`: a 503's (the gateway's probe period).  `down`: the
    classifiers the last probe found unhealthy; `load`: the gateway's spread of
    classify requests; `awaited`: why a model has no engine now (`Pool.awaited`, for
    the core's refusal of it); `refused`: told of a generative turn refused before it
    reaches the core, with no model to ask for (metrics count it as they count the
    core's refusals); `unanswered`: told of the engine request, if any, that got no
    answer (the decide span names its failure)."""
    if request.labels is None:
        return await _by_classifier(
            request, classifiers, down, load, client, run_id, answer_timeout, unanswered
        )
    model = request.model
    if model is None:
        if not models:
            refused(404)
            return error_response(404, "no generative endpoint is configured", run_id)
        model = models[0]
    # (A model whose discovered engines are all gone goes on to the core, which refuses
    # it as one not served, answered 503 to be retried (`hold`, `as_answered`), as the
    # proxy's turns are: counted and traced as a turn.)
    body = chat_body(request, model)
    turn = TurnRequest(
        turn_id=uuid.uuid4().hex,
        run_id=run_id,
        service_class=service_class,
        caller=caller,
        model=model,
        body=body,
        content_type="application/json",
        accept="application/json",
        prompt_tokens=len(body) // 4,
        max_tokens=1,
    )
    try:
        answer = await run_turn(
            turn,
            shell=shell,
            client=client,
            endpoints=endpoints,
            clock=clock,
            receive=receive,
            retry_after=retry_after,
            awaited=awaited,
            unanswered=unanswered,
        )
    finally:
        shell.apply(RunEnded(now=clock(), run_id=run_id))
    if isinstance(answer, Response):
        return answer
    top = first_top_logprobs(answer)
    if top is None:
        message = "the engine's answer has no choices[0].logprobs.content[0].top_logprobs"
        return error_response(502, message, run_id)
    try:
        result = decision(request.labels, top)
    except DecideError as exc:
        return error_response(exc.status, exc.message, run_id)
    return Response(json.dumps(result), headers={RUN_HEADER: run_id}, media_type="application/json")


class Spread:
    """Requests that are no turns (no admission, no run to keep together) spread over
    endpoints: each one's requests in flight, and when it was last chosen, so that ties
    are taken in turn.  (A counter shared by every set of endpoints, taken modulo the
    set's size, gave one endpoint of each of two models every request when their
    requests alternated, and two of three tied endpoints 2:1: helper-194.)"""

    __slots__ = ("_chosen", "_in_flight", "_last")

    # Endpoints whose last choice is remembered, the least recent forgotten first
    # (helper-195: under DNS discovery every pod address ever seen is a name).
    KEPT = 1024

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._last: dict[str, int] = {}  # name -> when last chosen (-1: never)
        self._chosen = 0

    def busy(self, name: str) -> int:
        return self._in_flight.get(name, 0)

    def last(self, name: str) -> int:
        """When `name` was last chosen: the least recent of tied endpoints goes first."""
        return self._last.get(name, -1)

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """A request in flight on `name` while the block runs."""
        self._chosen += 1
        self._last.pop(name, None)  # (to the end: the dict keeps the order of choice)
        self._last[name] = self._chosen
        if len(self._last) > self.KEPT:
            del self._last[next(iter(self._last))]
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        try:
            yield
        finally:
            left = self._in_flight[name] - 1
            if left:
                self._in_flight[name] = left
            else:
                del self._in_flight[name]


class ClassifierLoad(Spread):
    """Spreads `/v1/decide` requests over the classifier endpoints that serve their
    model: the ones the last probe found healthy first, then the one with the fewest
    requests in flight, ties taken in turn.  A `/classify` request is one forward pass,
    so it takes no admission (as the SGLang router's least-load policy has it); an
    endpoint that refuses the connection is passed over for the next."""

    __slots__ = ()

    def order(self, endpoints: Sequence[Endpoint], down: Container[str]) -> list[Endpoint]:
        return sorted(
            endpoints, key=lambda e: (e.name in down, self.busy(e.name), self.last(e.name))
        )


class _Unreached(Exception):
    """The request never reached the classifier (refused, or no connection in time);
    `error`: the failure's name (`Unanswered`)."""

    def __init__(self, message: str, error: str) -> None:
        super().__init__(message)
        self.error = error


async def _by_classifier(
    request: DecideRequest,
    classifiers: Sequence[Endpoint],
    down: Container[str],
    load: ClassifierLoad,
    client: httpx.AsyncClient,
    run_id: str,
    answer_timeout: float,
    unanswered: Unanswered,
) -> Response:
    if not classifiers:
        return error_response(404, "no classifier endpoint is configured", run_id)
    # The default is the first classifier's first model, whichever endpoint answers.
    model = classifiers[0].models[0] if request.model is None else request.model
    serving = [e for e in classifiers if model in e.models]
    if not serving:
        return error_response(404, f"no classifier serves model {model!r}", run_id)
    unreached = []
    error = ""
    for endpoint in load.order(serving, down):
        with load.using(endpoint.name):
            try:
                return await classify(
                    endpoint, model, request.input, client, run_id, answer_timeout, unanswered
                )
            except _Unreached as exc:
                unreached.append(str(exc))
                error = exc.error  # the last, as the answer's message ends
    message = "; ".join(unreached)
    unanswered(error, message)
    return error_response(502, message, run_id)
