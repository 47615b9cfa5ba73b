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
run (the Temporal interceptor's workflow span, renamed and given GenAI attributes),
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

import hashlib
import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from temporalio import workflow
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor, TracingWorkflowInboundInterceptor
from temporalio.worker import ExecuteWorkflowInput, WorkflowInterceptorClassInput

__all__ = [
    "FLUSH_TIMEOUT_S",
    "TRACER_NAME",
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
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
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


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Export the spans still buffered, waiting at most `timeout_s`.  The gateway's
    lifespan ends with it: uvicorn re-raises SIGTERM once it has shut down, so nothing
    after `uvicorn.run` runs (nor the SDK's atexit hook: the CLI leaves by `os._exit`)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Export the spans still buffered and stop tracing.  The CLI leaves through
    `os._exit` (past the SDK's atexit hook), so its commands call this before."""
    provider = _provider
    if provider is not None:
        use(None)
        provider.shutdown()


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


class _RunTracing(TracingInterceptor):
    """Temporal's tracing interceptor, whose workflow span is the GenAI `invoke_agent`."""

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[TracingWorkflowInboundInterceptor]:
        super().workflow_interceptor_class(input)  # registers the span extern function
        return _InvokeAgent


class _InvokeAgent(TracingWorkflowInboundInterceptor):
    """Names the run's workflow span `invoke_agent {type}` (for `RunWorkflow:{type}`)
    with GenAI attributes.  Like every workflow span of the interceptor it is recorded
    with no duration: a span kept open across workflow tasks would not survive replay.

    The workflow's spans (and so its activities' and the gateway's) are children of the
    span that started the run, carried in the run's Temporal headers.  A run started
    without one (by a client without the interceptor: the CLI, a test) gets a parent
    derived from its run id instead, so it is still one trace, replays included; that
    parent is never recorded itself."""

    def _load_workflow_context_carrier(self) -> dict[str, Any] | None:
        carrier = super()._load_workflow_context_carrier()
        if not carrier:
            digest = hashlib.sha256(workflow.info().run_id.encode()).hexdigest()
            carrier = {"traceparent": f"00-{digest[:32]}-{digest[32:48]}-01"}
            self._workflow_context_carrier = carrier
        return carrier

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        info = workflow.info()
        attributes: dict[str, str] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": info.workflow_type,
            "gen_ai.agent.id": info.workflow_id,
            "gen_ai.conversation.id": info.workflow_id,
            "luftpause.run_id": info.workflow_id,
        }
        if info.parent is not None:
            attributes["luftpause.parent_run_id"] = info.parent.workflow_id
        with self._top_level_workflow_context(success_is_complete=True):
            self._completed_span(
                f"invoke_agent {info.workflow_type}",
                kind=SpanKind.INTERNAL,
                additional_attributes=attributes,
            )
            return await self.next.execute_workflow(input)
