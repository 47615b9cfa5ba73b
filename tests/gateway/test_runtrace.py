"""When a proxied run's `invoke_agent` span ends (gateway/_runtrace.py), for the cases a
test over HTTP cannot set up on cue: turns of one run in parallel, a failed turn never
retried, a run ended by its client mid-turn, a paused run whose turn was abandoned, a
traced turn that failed last.  The real-HTTP cases (answered, rejected, expired, ended,
gateway stopped, a client leaving mid-stream) are in tests/luftpause/test_telemetry.py."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gateway._runtrace import RunSpans
from gateway._shell import Rejected
from scheduler import RunPhase, RunState, ServiceClass, TurnAbandoned, TurnFailed, TurnFinished


class Bed:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("test")
        self.runs = RunSpans()

    def begin(self, run_id: str = "r") -> None:
        self.runs.turn_began(self.tracer, run_id, "m", "alice", "interactive")

    def ended(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


def state(phase: RunPhase, *, in_flight: int = 0, retrying: bool = False) -> RunState:
    return RunState(
        run_id="r", service_class=ServiceClass.INTERACTIVE, caller="alice", model="m",
        phase=phase, replica="a", in_flight=in_flight, context_tokens=0, reply_tokens=0,
        last_active=0.0, bound=True, ws_claim=0, counted_paused=False, retrying=retrying,
    )  # fmt: skip


def finished(reason: str, prompt: int = 10, completion: int = 2) -> TurnFinished:
    return TurnFinished(
        now=0.0,
        turn_id="t",
        finish_reason=reason,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_parallel_turns_end_the_run_at_the_last_one() -> None:
    bed = Bed()
    bed.begin()
    bed.begin()
    bed.runs.turn_ended("r", finished("stop"), state(RunPhase.GENERATING, in_flight=1))
    assert not bed.ended() and len(bed.runs) == 1
    bed.runs.turn_ended("r", finished("stop", 20, 3), state(RunPhase.IDLE))
    (agent,) = bed.ended()
    a = attrs(agent)
    assert a["luftpause.end"] == "answered" and a["luftpause.turns"] == 2
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (30, 5)
    assert len(bed.runs) == 0


def test_a_failed_turn_never_retried_ends_the_run_as_an_error_once_it_expires() -> None:
    bed = Bed()
    bed.begin()
    failed = TurnFailed(now=0.0, turn_id="t", reason="engine a answered 500")
    bed.runs.turn_ended("r", failed, state(RunPhase.IDLE, retrying=True))
    assert not bed.ended()  # the client may retry it
    bed.runs.forgotten("r", expired=True)
    (agent,) = bed.ended()
    assert attrs(agent)["luftpause.end"] == "expired"
    assert attrs(agent)["error.type"] == "turn_failed"
    assert agent.status.status_code is StatusCode.ERROR
    assert agent.status.description == "engine a answered 500"
    assert "gen_ai.usage.input_tokens" not in attrs(agent)  # no turn was answered


def test_a_run_ended_mid_turn_ends_with_that_turn() -> None:
    bed = Bed()
    bed.begin()
    bed.runs.forgotten("r", expired=False)  # DELETE /v1/runs/r while the turn streams
    assert not bed.ended()
    bed.runs.turn_ended("r", finished("tool_calls"), None)
    (agent,) = bed.ended()
    assert attrs(agent)["luftpause.end"] == "ended"


def test_a_client_that_leaves_mid_answer_abandons_the_run_once_it_expires() -> None:
    # Esc in a harness while the turn streams: the core keeps the run (the client may
    # send the turn again); once it expires the invocation was abandoned, not an error.
    bed = Bed()
    bed.begin()
    left = TurnFailed(now=0.0, turn_id="t", reason="client disconnected mid-stream",
                      client_left=True)  # fmt: skip
    bed.runs.turn_ended("r", left, state(RunPhase.IDLE, retrying=True))
    assert not bed.ended()
    bed.runs.forgotten("r", expired=True)
    (agent,) = bed.ended()
    assert attrs(agent)["luftpause.end"] == "abandoned" and "error.type" not in attrs(agent)
    assert agent.status.status_code is not StatusCode.ERROR


def test_a_paused_runs_abandoned_turn_waits_for_the_run_to_expire() -> None:
    bed = Bed()
    bed.begin()
    bed.runs.turn_ended("r", finished("tool_calls"), state(RunPhase.PAUSED))
    bed.begin()  # the tool's result comes back, and the client leaves while it is held
    bed.runs.turn_ended("r", TurnAbandoned(now=0.0, turn_id="t2"), state(RunPhase.PAUSED))
    assert not bed.ended()
    bed.runs.forgotten("r", expired=True)
    (agent,) = bed.ended()
    assert attrs(agent)["luftpause.end"] == "abandoned" and attrs(agent)["luftpause.turns"] == 2
    assert agent.status.status_code is not StatusCode.ERROR


def test_a_run_refused_mid_way_goes_on_and_a_new_one_refused_ends() -> None:
    bed = Bed()
    bed.begin()
    bed.runs.turn_ended("r", finished("tool_calls"), state(RunPhase.PAUSED))
    bed.begin()
    refused = Rejected(404, "no generative replica serves model 'm'")
    bed.runs.turn_ended("r", refused, state(RunPhase.PAUSED))
    assert not bed.ended()  # paused on its replica: the client may try again
    bed.begin("new")
    bed.runs.turn_ended("new", refused, None)
    (agent,) = bed.ended()
    assert attrs(agent)["luftpause.run_id"] == "new"
    assert attrs(agent)["luftpause.end"] == "rejected" and attrs(agent)["error.type"] == "404"
    bed.runs.close()
    (_, stopped) = bed.ended()
    assert attrs(stopped)["luftpause.run_id"] == "r"
    assert attrs(stopped)["luftpause.end"] == "gateway_stopped"


def test_an_answer_in_the_callers_own_trace_ends_the_runs_span() -> None:
    bed = Bed()
    bed.begin()
    bed.runs.turn_ended("r", finished("tool_calls"), state(RunPhase.PAUSED))
    bed.runs.settle("r", finished("tool_calls"), state(RunPhase.GENERATING, in_flight=1))
    assert not bed.ended()  # still going
    bed.runs.settle("r", finished("stop"), state(RunPhase.IDLE))  # answered in a traced turn
    (agent,) = bed.ended()
    assert attrs(agent)["luftpause.end"] == "answered" and attrs(agent)["luftpause.turns"] == 1
    bed.runs.settle("unknown", finished("stop"), state(RunPhase.IDLE))  # no span: nothing
    assert len(bed.ended()) == 1


def test_a_traced_turn_that_fails_last_is_how_the_run_expires() -> None:
    # The run's span is open (its first turn came without a trace); its next turn came
    # in the caller's trace and failed, and nothing followed: the run expires with that
    # failure, at its time (it ended as expired without an error, at the earlier turn).
    bed = Bed()
    bed.begin()
    bed.runs.turn_ended("r", finished("tool_calls"), state(RunPhase.PAUSED))
    (opened,) = bed.runs._open.values()
    before = opened.last_ns
    failed = TurnFailed(now=0.0, turn_id="t2", reason="engine a answered 500")
    bed.runs.settle("r", failed, state(RunPhase.IDLE, retrying=True))
    bed.runs.forgotten("r", expired=True)
    (agent,) = bed.ended()
    assert (
        attrs(agent)["luftpause.end"] == "expired" and attrs(agent)["error.type"] == "turn_failed"
    )
    assert agent.status.description == "engine a answered 500"
    assert agent.end_time is not None and agent.end_time > before
