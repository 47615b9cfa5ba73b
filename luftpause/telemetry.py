"""OpenTelemetry for the gateway and the worker (DESIGN.md "Observability and security").

Tracing is on only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the traces-only
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set: `setup()` then exports spans over OTLP/HTTP,
and the standard variables apply (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_HEADERS`, ...).  Otherwise
`tracer()` is None and the code that traces skips all span work: the gateway's hot path
pays a few `is None` tests a turn (~0.1 µs).  On, a turn's two spans cost the gateway
~0.2 ms of CPU to make and about as much to export (OTLP encoding in Python): under
heavy load, sample (OTEL_TRACES_SAMPLER=parentbased_traceidratio).

The spans follow the GenAI semantic conventions: `invoke_agent AgentRun` per sub-agent
run (from its start to its close, recorded when it closes; `_InvokeAgent`),
`chat {model}` per turn and `admit` for its hold (the gateway), `invoke_agent` per
proxied run whose turns bring no trace of their own (the gateway, gateway/_runtrace.py),
`execute_tool {name}` per tool call (the worker).  W3C `traceparent` goes to engines in
a header and to MCP tool servers in the request's `_meta` (the MCP SDK puts it there
itself).

Code reads the tracer through `tracer()`, never the process-wide provider, so a test
can `use()` a provider of its own and `use(None)` afterwards: OpenTelemetry lets the
global provider be set once per process.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from temporalio import workflow
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor, TracingWorkflowInboundInterceptor
from temporalio.worker import ExecuteWorkflowInput, WorkflowInterceptorClassInput

__all__ = [
    "FLUSH_TIMEOUT_S",
    "TRACER_NAME",
    "TracedRun",
    "TracingError",
    "extract",
    "flush",
    "inject",
    "setup",
    "shutdown",
    "temporal_interceptors",
    "tracer",
    "use",
]

log = logging.getLogger(__name__)

TRACER_NAME = "luftpause"
# A collector that is down delays a stopping process by this much at most.
FLUSH_TIMEOUT_S = 5.0
# W3C TraceContext only, whatever OTEL_PROPAGATORS says: `traceparent` is what engines
# (vLLM, SGLang) and MCP servers read.
_W3C = TraceContextTextMapPropagator()

_provider: TracerProvider | None = None


class TracingError(ValueError):
    """Tracing is asked for (OTEL_EXPORTER_OTLP_ENDPOINT) with settings it cannot take."""


_tracer: Tracer | None = None


def setup(service_name: str) -> TracerProvider | None:
    """Export spans over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and make
    that provider the process-wide one too (the MCP SDK traces through it); otherwise
    do nothing and return None.  `service_name` applies unless OTEL_SERVICE_NAME (or
    `service.name` in OTEL_RESOURCE_ATTRIBUTES) names the service."""
    env = os.environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if (
        not endpoint
        or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        or env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"
    ):
        return None
    scheme = urllib.parse.urlsplit(endpoint.strip()).scheme
    if scheme not in ("http", "https"):
        # Taken, it failed every export later ("Invalid URL ...: No scheme supplied"):
        # said at start instead (helper-127).
        name = (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
            if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            else "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        raise TracingError(
            f"tracing: {name}={endpoint!r}: expected an http:// or https:// URL "
            "(e.g. http://localhost:4318)"
        )
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    ) or "http/protobuf"
    if protocol != "http/protobuf":
        log.warning("OTLP protocol %r is not supported: exporting http/protobuf", protocol)
    # Imported here: the exporter (protobuf, requests) loads only when it is used.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    try:  # the OTEL_BSP_* and OTEL_EXPORTER_OTLP_* variables are read here
        processor = BatchSpanProcessor(OTLPSpanExporter())
    except ValueError as exc:  # e.g. OTEL_BSP_SCHEDULE_DELAY=-5: a traceback at startup
        raise TracingError(f"tracing: the OTEL_* environment variables: {exc}") from None
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    use(provider)
    log.info("tracing: OTLP/HTTP spans to %s as %s", endpoint, resource.attributes[SERVICE_NAME])
    return provider


def use(provider: TracerProvider | None) -> None:
    """Trace through `provider` from now on; None turns tracing off.  `setup` calls it;
    a test calls it with a provider of its own, and with None when it is done."""
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None


def tracer() -> Tracer | None:
    """The tracer to make spans with, or None when tracing is off (skip span work)."""
    return _tracer


def _within(timeout_s: float, work: Callable[[], object]) -> None:
    """Run `work` (an export) for at most `timeout_s`: the SDK's own timeouts do not
    bound it (force_flush's stops waiting for the processor, not the exporter's HTTP
    request and its retries, 10 s by default).  Past it the spans are dropped; the
    thread is a daemon, and the process is about to leave."""
    thread = threading.Thread(target=work, name="luftpause-otlp-flush", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning(
            "tracing: the spans still buffered were not exported within %g s (is the "
            "collector up?); dropped",
            timeout_s,
        )


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Export the spans still buffered, waiting at most `timeout_s`.  The gateway's
    lifespan ends with it: uvicorn re-raises SIGTERM once it has shut down, so nothing
    after `uvicorn.run` runs (nor the SDK's atexit hook: the CLI leaves by `os._exit`)."""
    provider = _provider
    if provider is not None:
        _within(timeout_s, lambda: provider.force_flush(int(timeout_s * 1000)))


def shutdown(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Export the spans still buffered (waiting at most `timeout_s`) and stop tracing.
    The CLI leaves through `os._exit` (past the SDK's atexit hook), so its commands
    call this before."""
    provider = _provider
    if provider is not None:
        use(None)
        _within(timeout_s, provider.shutdown)


def inject(headers: MutableMapping[str, str], context: Context | None = None) -> None:
    """Add `traceparent` (and `tracestate`) for the current span, or `context`'s, to
    outgoing HTTP headers; nothing when there is no valid span."""
    _W3C.inject(headers, context)


def extract(headers: Mapping[str, str]) -> Context:
    """The context an incoming `traceparent` (lower-case header names) continues; an
    empty one, so spans start a new trace, when it is missing or malformed."""
    return _W3C.extract(headers)


# --------------------------------------------------------------------------- Temporal


def temporal_interceptors(client: Client | None = None) -> list[TracingInterceptor]:
    """The interceptor that traces Temporal calls (StartWorkflow, RunActivity, ...) and
    carries the trace across workflow and activity boundaries in Temporal headers; [] when
    tracing is off, or when `client` already has one, since a
    worker inherits its client's interceptors."""
    t = _tracer
    if t is None:
        return []
    if client is not None and any(
        isinstance(i, TracingInterceptor) for i in client.config()["interceptors"]
    ):
        return []
    return [_RunTracing(t)]


# The extern functions (run outside the workflow sandbox) that record a run's span, and
# that sample a run started without a trace (its trace's root).
_RUN_SPAN_EXTERN = "__luftpause_invoke_agent_span"
_SAMPLED_EXTERN = "__luftpause_invoke_agent_sampled"
# Runs whose spans a worker remembers having recorded (a closing workflow task that
# Temporal turns back, e.g. for a signal that arrived meanwhile, runs, and closes, again).
_RECORDED_MAX = 4096


@runtime_checkable
class TracedRun(Protocol):
    """A workflow that says how it ended on its `invoke_agent` span (`AgentRun`)."""

    def span_end(self) -> tuple[dict[str, str | int], str | None]:
        """Attributes of the closed run (its state, its usage), and the error it ended
        with, or None: the span's status is an error only then.  Asked once, at close."""
        ...

    def span_provider(self) -> str | None:
        """The `gen_ai.provider.name` the span names (the GenAI conventions require one
        on `invoke_agent` spans): the kind of engine that answered its first turn, or
        None when no turn of it was answered.  Asked at every close, a continue-as-new's
        too."""
        ...


@dataclass(frozen=True)
class _RunSpan:
    """A run's `invoke_agent` span, recorded when the run closes."""

    name: str
    context: SpanContext  # its ids, chosen when the run began (derived from its run id)
    parent: SpanContext | None  # None: the root of the run's trace
    start_ns: int
    end_ns: int
    attributes: dict[str, str | int]
    error: str | None


class _RunTracing(TracingInterceptor):
    """Temporal's tracing interceptor, whose workflow span is the GenAI `invoke_agent`."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)
        self._recorded: OrderedDict[int, None] = OrderedDict()  # span ids, oldest first
        self._lock = threading.Lock()  # workflow tasks run in threads

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[TracingWorkflowInboundInterceptor]:
        super().workflow_interceptor_class(input)  # registers the span extern function
        input.unsafe_extern_functions[_RUN_SPAN_EXTERN] = self._record_run_span
        input.unsafe_extern_functions[_SAMPLED_EXTERN] = self._sampled
        return _InvokeAgent

    def _sampled(self, trace_id: int) -> bool:
        """The configured sampler's word on a trace a run starts (no parent to follow);
        deterministic for the SDK's samplers, as a replay needs."""
        t = self.tracer
        if not isinstance(t, SdkTracer):
            return True
        decision = t.sampler.should_sample(None, trace_id, "invoke_agent").decision
        return decision is Decision.RECORD_AND_SAMPLE

    def _record_run_span(self, span: _RunSpan) -> None:
        """Hand a closed run's span to the span processors: a span whose ids were fixed
        when the run began, which the SDK's `start_span` cannot make (it draws ids).
        Once per run on this worker, however often its closing task runs."""
        t = self.tracer
        if not isinstance(t, SdkTracer) or not span.context.trace_flags.sampled:
            return
        with self._lock:
            if span.context.span_id in self._recorded:
                return
            self._recorded[span.context.span_id] = None
            if len(self._recorded) > _RECORDED_MAX:
                self._recorded.popitem(last=False)
        t.span_processor.on_end(
            ReadableSpan(
                span.name,
                context=span.context,
                parent=span.parent,
                resource=t.resource,
                attributes=span.attributes,
                kind=SpanKind.INTERNAL,
                status=Status(StatusCode.ERROR, span.error) if span.error else Status(),
                start_time=span.start_ns,
                end_time=span.end_ns,
                instrumentation_scope=InstrumentationScope(TRACER_NAME),
            )
        )


class _InvokeAgent(TracingWorkflowInboundInterceptor):
    """The run's `invoke_agent {type}` span, with GenAI attributes, from the run's start
    to its close, the parent of every span of the run: Temporal's (StartActivity,
    StartChildWorkflow, HandleSignal, CompleteWorkflow), the worker's `execute_tool`
    and the gateway's `chat`.

    Temporal's interceptor records workflow spans with no duration, since a span kept
    open across workflow tasks would not survive a replay.  This one is never open: its
    ids are derived from the run id when the run begins (on every worker that replays
    it, the same), its children are parented to them through the workflow's context,
    and the span itself is recorded once, when the run closes, with the workflow's start
    and close times.  So it is exported only then, like the gateway's run spans.

    Its parent is the span that started the run, carried in the run's Temporal headers
    (a parent run's StartChildWorkflow, the MCP door's caller).  A run started without
    one (by a client without the interceptor: the CLI, a test) is the root of a trace
    of its own, whose id is derived from its run id too, sampled as the configured
    sampler says."""

    def __init__(self, next: Any) -> None:
        super().__init__(next)
        self._run_context: SpanContext | None = None
        self._parent_context: SpanContext | None = None

    def _load_workflow_context_carrier(self) -> dict[str, Any] | None:
        if self._run_context is not None:
            return self._workflow_context_carrier
        run_id = workflow.info().run_id
        carrier = super()._load_workflow_context_carrier() or {}
        outer = self.text_map_propagator.extract(carrier)
        parent = trace.get_current_span(outer).get_span_context()
        if parent.is_valid:
            trace_id, flags, state = parent.trace_id, parent.trace_flags, parent.trace_state
            self._parent_context = parent
        else:
            trace_id, state = _derived_id(f"trace/{run_id}", 128), None
            sampled = workflow.extern_functions()[_SAMPLED_EXTERN](trace_id)
            flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        self._run_context = SpanContext(
            trace_id,
            _derived_id(f"invoke_agent/{run_id}", 64),
            is_remote=True,
            trace_flags=flags,
            trace_state=state,
        )
        inner: dict[str, Any] = {}
        self.text_map_propagator.inject(
            inner, trace.set_span_in_context(NonRecordingSpan(self._run_context), outer)
        )
        self._workflow_context_carrier = inner
        return inner

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        info = workflow.info()
        attributes: dict[str, str | int] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": info.workflow_type,
            "gen_ai.agent.id": info.workflow_id,
            "gen_ai.conversation.id": info.workflow_id,
            "luftpause.run_id": info.workflow_id,
            "temporalWorkflowID": info.workflow_id,
            "temporalRunID": info.run_id,
        }
        if info.parent is not None:
            attributes["luftpause.parent_run_id"] = info.parent.workflow_id
        # The run's model (an AgentRunInput's spec), as the gateway's run span has it.
        spec = getattr(input.args[0], "spec", None) if input.args else None
        model = getattr(spec, "model", None)
        if isinstance(model, str) and model:
            attributes["gen_ai.request.model"] = model
        with self._top_level_workflow_context(success_is_complete=True):
            try:
                result = await self.next.execute_workflow(input)
            except workflow.ContinueAsNewError:
                attributes["luftpause.end"] = "continued_as_new"
                self._close(info, attributes, None)
                raise
            except asyncio.CancelledError:  # cancelled, or evicted (then replaying)
                self._close(info, attributes, None)
                raise
            except Exception as exc:
                if workflow.is_failure_exception(exc):  # else a task failure: retried
                    self._close(info, attributes, f"{type(exc).__name__}: {exc}")
                raise
            self._close(info, attributes, None)
            return result

    def _close(
        self, info: workflow.Info, attributes: dict[str, str | int], error: str | None
    ) -> None:
        """Record the run's span: it closed.  Not while replaying: a replay of a run that
        closed recorded it then, and an eviction (which counts as replaying) is no close."""
        if workflow.unsafe.is_replaying():
            return
        self._load_workflow_context_carrier()
        assert self._run_context is not None
        instance = workflow.instance()
        if isinstance(instance, TracedRun):
            # Known from the turns' answers: the gateway, which chose the engine, names
            # its kind on each (luftpause.headers.PROVIDER_HEADER).
            if provider := instance.span_provider():
                attributes["gen_ai.provider.name"] = provider
            if "luftpause.end" not in attributes:
                more, error = instance.span_end()
                attributes.update(more)
        if error is not None:
            attributes["error.type"] = attributes.get("luftpause.state", "error")
        start = info.workflow_start_time
        workflow.extern_functions()[_RUN_SPAN_EXTERN](
            _RunSpan(
                name=f"invoke_agent {info.workflow_type}",
                context=self._run_context,
                parent=self._parent_context,
                start_ns=int(start.timestamp() * 1e9),
                end_ns=workflow.time_ns(),
                attributes=attributes,
                error=error,
            )
        )


def _derived_id(seed: str, bits: int) -> int:
    """A nonzero trace (128 bits) or span (64 bits) id derived from `seed`."""
    digest = hashlib.sha256(seed.encode()).digest()
    return int.from_bytes(digest[: bits // 8], "big") or 1
