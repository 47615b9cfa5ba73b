"""A proxied run's `invoke_agent` span (DESIGN.md "Observability": a span per run).

A sub-agent's turns come with the `traceparent` of its workflow's `invoke_agent` span, and
an own-loop agent that traces sends its own; their `chat` spans continue those.  Turns that
come without one (Claude Code, Codex, an agent without OpenTelemetry) would each start a
trace of their own.  Their run gets an `invoke_agent` span here instead, the parent of each
such turn's `chat` span, so one agent invocation is one trace:

- opened at the run's first turn without a `traceparent`;
- ended when the invocation is over, with `luftpause.end` saying how:
  - `answered`: its last turn finished with an answer, not a tool call (the core put the
    run IDLE), and no other turn of it is open; also when that turn came with a trace
    of its own;
  - `rejected` (an error): refused before queueing (unknown model, no healthy replica, 429);
  - `abandoned`: the client left while its turn was held (at once, or once the run
    expires if it was paused on a tool: the client may still send the tool's result),
    or while its turn was answered (once the run expires: it may still send the turn
    again); not an error, as pressing Esc in a harness is none;
  - `ended`: the client ended the run (`DELETE /v1/runs/{id}`);
  - `expired`: paused on a tool, or after a turn that failed (then an error), and not
    resumed within `idle_run_expiry_s`: the span ends at the run's last activity, but is
    only exported then;
  - `gateway_stopped`: still open when the gateway stopped.
- It carries the run's totals: turns, and the GenAI usage of its finished turns.
- Its `gen_ai.provider.name` (required by the GenAI conventions) is set when its first
  turn is forwarded, to that engine's (`forwarded`): the span opens before a replica is
  chosen.  A run whose turns go to engines of different kinds keeps the first; each
  turn's `chat` span names its own.  A run no turn of which reached an engine (refused)
  names none, as its `chat` spans do not: none was chosen.

A run answered and then continued under the same id (a caller's `x-luftpause-run-id`)
opens a new span, one trace per invocation; a Claude Code session's next prompt echoes no
tool call id, so it is a new run anyway.  Only made with tracing on: the proxy calls in
here only when it has a tracer, and the core's `Forget` of a run without a span is one
dict lookup.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer, set_span_in_context

from gateway._shell import Rejected
from scheduler import Event, RunState, TurnAbandoned, TurnFailed, TurnFinished

__all__ = ["RunSpans", "TurnOutcome"]

TurnOutcome = Event | Rejected | None
"""How a turn ended: its terminal event, the core's refusal, or None (no report: the
gateway stopped with it open)."""


@dataclass(slots=True)
class _Open:
    span: Span
    context: Context
    open_turns: int = 0
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    last: TurnOutcome = None
    last_ns: int = 0  # when a turn of it last ended (time.time_ns)
    provider: str | None = None  # gen_ai.provider.name: its first forwarded turn's engine's
    forgotten: bool = False  # the core forgot the run while a turn of it was open


def _goes_on(state: RunState | None) -> bool:
    """Whether the core's view of a run says its invocation goes on: paused on a tool,
    retrying a failed turn, or generating (a turn that came with a trace of its own)."""
    return state is not None and state.keeps_replica


class RunSpans:
    """The `invoke_agent` spans of the runs whose turns came without a trace."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}

    def __len__(self) -> int:
        return len(self._open)

    def turn_began(
        self, tracer: Tracer, run_id: str, model: str, caller: str, service_class: str
    ) -> Context:
        """A turn of the run arrived: the context its `chat` span is a child of."""
        run = self._open.get(run_id)
        if run is None:
            span = tracer.start_span(
                "invoke_agent",
                kind=SpanKind.INTERNAL,
                attributes={
                    "gen_ai.operation.name": "invoke_agent",
                    "gen_ai.conversation.id": run_id,
                    "gen_ai.request.model": model,
                    "luftpause.run_id": run_id,
                    "luftpause.caller": caller,
                    "luftpause.class": service_class,
                },
            )
            run = self._open[run_id] = _Open(span, set_span_in_context(span))
        run.open_turns += 1
        run.turns += 1
        return run.context

    def forwarded(self, run_id: str, provider: str) -> None:
        """A turn of the run goes to an engine of `provider` (its `gen_ai.provider.name`,
        as the turn's `chat` span names it).  The run's span takes the first: it opens
        before a replica is chosen, and the conventions' value is one discriminator
        that should be known as early as it can be; a later turn that goes to another
        kind of engine says so on its own span."""
        run = self._open.get(run_id)
        if run is None or run.provider is not None:
            return
        run.provider = provider
        run.span.set_attribute("gen_ai.provider.name", provider)

    def turn_ended(self, run_id: str, outcome: TurnOutcome, state: RunState | None) -> None:
        """A turn of the run is over; `state`: the core's view of the run after it (None:
        the core does not know the run, or no longer)."""
        run = self._open.get(run_id)
        if run is None:
            return
        run.open_turns -= 1
        run.last = outcome
        run.last_ns = time.time_ns()
        if isinstance(outcome, TurnFinished):
            run.input_tokens += outcome.prompt_tokens
            run.output_tokens += outcome.completion_tokens
            run.cached_tokens += outcome.cached_tokens or 0
        if run.open_turns > 0:
            return
        if run.forgotten:
            self._end(run_id, "ended")
        elif not _goes_on(state):
            if isinstance(outcome, Rejected):
                self._end(run_id, "rejected", error=(str(outcome.status), outcome.message))
            elif isinstance(outcome, TurnAbandoned):
                self._end(run_id, "abandoned")
            else:
                self._end(run_id, "ended" if state is None else "answered")

    def settle(self, run_id: str, outcome: TurnOutcome, state: RunState | None) -> None:
        """A turn of the run that came with a trace of its own is over: it is the run's
        last (how the span ends if the run expires, and when), and it may have given the
        run's answer (the run went IDLE), which ends the run's span too."""
        run = self._open.get(run_id)
        if run is None:
            return
        run.last, run.last_ns = outcome, time.time_ns()
        if run.open_turns == 0 and state is not None and not _goes_on(state):
            self._end(run_id, "answered")

    def forgotten(self, run_id: str, *, expired: bool) -> None:
        """The core forgot the run (its `Forget` action)."""
        run = self._open.get(run_id)
        if run is None:
            return
        if run.open_turns > 0:
            # Ended by the client while a turn of it is open: that turn's end ends the
            # span.  (The core expires no run with a turn held or in flight.)
            run.forgotten = True
            return
        last = run.last
        if not expired:
            self._end(run_id, "ended", at=run.last_ns)
        elif isinstance(last, TurnFailed) and not last.client_left:
            self._end(run_id, "expired", error=("turn_failed", last.reason), at=run.last_ns)
        elif isinstance(last, (TurnAbandoned, TurnFailed)):  # the client left
            self._end(run_id, "abandoned", at=run.last_ns)
        else:
            self._end(run_id, "expired", at=run.last_ns)

    def close(self) -> None:
        """End every open span (the gateway is stopping)."""
        for run_id in list(self._open):
            self._end(run_id, "gateway_stopped")

    def _end(
        self, run_id: str, how: str, *, error: tuple[str, str] | None = None, at: int | None = None
    ) -> None:
        run = self._open.pop(run_id)
        attributes: dict[str, str | int] = {"luftpause.end": how, "luftpause.turns": run.turns}
        if run.input_tokens or run.output_tokens:
            attributes["gen_ai.usage.input_tokens"] = run.input_tokens
            attributes["gen_ai.usage.output_tokens"] = run.output_tokens
        if run.cached_tokens:
            attributes["gen_ai.usage.cache_read.input_tokens"] = run.cached_tokens
        if error is not None:
            attributes["error.type"] = error[0]
            run.span.set_status(StatusCode.ERROR, error[1])
        run.span.set_attributes(attributes)
        run.span.end(end_time=at or None)
