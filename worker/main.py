"""`luftpause worker`: runs sub-agent workflows and their activities on a task queue.

It connects the configured upstream MCP servers, sends LLM turns to the gateway (or
`gateway_url`), hands its work over on SIGTERM (`Worker.shutdown`, so another worker
takes the runs at once) and exits cleanly.  The sticky schedule-to-start timeout is 2 s:
after a worker dies, its runs' next workflow tasks reach another worker within 2 s
instead of the default 10 s.  With OTEL_EXPORTER_OTLP_ENDPOINT set it exports spans
(luftpause/telemetry.py): each run, turn and tool call, in one trace per run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
from datetime import timedelta
from typing import Any

import httpx
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from activities import LlmActivities, ToolActivities
from activities.mcp_pool import McpPool
from activities.tools import check_arguments
from luftpause import telemetry
from luftpause._args import seconds
from luftpause._process import freeze_heap
from luftpause.config import (
    MAX_CONCURRENT_ACTIVITIES,
    Config,
    ConfigError,
    Temporal,
    WorkerOptions,
    default_file_hint,
    load_config,
)
from luftpause.net import KEEPALIVE
from workflows import AgentRun

__all__ = ["add_arguments", "build_worker", "run", "serve"]

log = logging.getLogger(__name__)

STICKY_TIMEOUT = timedelta(seconds=2)
GRACEFUL_SHUTDOWN = timedelta(seconds=10)
GATEWAY_CONNECT_TIMEOUT_S = 2.0
# `[worker]` not given: 1000 activity slots, the SDK's defaults for the rest.
UNSET_WORKER_OPTIONS = WorkerOptions()
# Temporal may come up after the worker (compose, k8s, a restarted dev server whose port
# opens before it serves): keep trying this long before giving up.
TEMPORAL_CONNECT_PATIENCE_S = 60.0
TEMPORAL_CONNECT_RETRY_S = 0.5
TEMPORAL_CONNECT_WARN_EVERY_S = 10.0  # one line per this, not per try (helper-127: 120)


async def connect(t: Temporal, stop: asyncio.Event) -> Client | None:
    """Connect to Temporal as `[temporal]` says (TLS, API key), retrying while it is not
    up yet; None if asked to stop."""
    options = t.connect_options(os.environ)  # ConfigError: a file or a key missing
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TEMPORAL_CONNECT_PATIENCE_S
    warned = -math.inf
    while True:
        try:
            return await Client.connect(t.address, **options)
        except RuntimeError as exc:  # the SDK's "Failed client connect: ..."
            if loop.time() >= deadline:
                raise RuntimeError(
                    f"Temporal at {t.address} did not answer in "
                    f"{TEMPORAL_CONNECT_PATIENCE_S:g} s ({exc}): is it up, and is it the "
                    "address [temporal] address or LUFTPAUSE_TEMPORAL_ADDRESS gives?"
                ) from None
            if loop.time() - warned >= TEMPORAL_CONNECT_WARN_EVERY_S:
                warned = loop.time()
                log.warning("Temporal at %s is not answering yet (%s); retrying", t.address, exc)
        try:
            await asyncio.wait_for(stop.wait(), TEMPORAL_CONNECT_RETRY_S)
            return None
        except TimeoutError:
            pass


async def _namespace_exists(client: Client, t: Temporal) -> None:
    """RuntimeError naming the namespace when Temporal has none of that name (the SDK's
    worker says so only as it starts, after this process said it was up)."""
    request = DescribeNamespaceRequest(namespace=t.namespace)
    try:
        await client.workflow_service.describe_namespace(request)
    except RPCError as exc:
        if exc.status in (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED):
            raise RuntimeError(
                f"Temporal at {t.address} did not answer for namespace {t.namespace!r}: "
                f"{exc.status.name}: {exc.message} (is it up and reachable?)"
            ) from None
        if exc.status != RPCStatusCode.NOT_FOUND:
            # Refused (no permission, a key or certificate it does not take): said as
            # such, not as a traceback (helper-207).
            raise RuntimeError(
                f"Temporal at {t.address} refused to describe namespace {t.namespace!r}: "
                f"{exc.status.name}: {exc.message} (check [temporal] namespace and the "
                "credentials: api_key_env, tls_cert_file / tls_key_file)"
            ) from None
        raise RuntimeError(
            f"Temporal at {t.address} has no namespace {t.namespace!r} ([temporal] namespace, "
            "or LUFTPAUSE_TEMPORAL_NAMESPACE): create it (temporal operator namespace "
            "create) or name one it has"
        ) from None


def build_worker(
    client: Client,
    *,
    task_queue: str,
    llm: LlmActivities,
    tools: ToolActivities,
    shutdown_grace: timedelta = GRACEFUL_SHUTDOWN,
    options: WorkerOptions = UNSET_WORKER_OPTIONS,
) -> Worker:
    """The worker for one task queue, with every workflow and activity registered (and
    Temporal's tracing interceptor, when tracing is on).  `shutdown_grace`: how long
    its activities may go on after a stop before they are cancelled (a turn cut so
    runs again from its start on the next worker; a tool call cut so is one that broke
    off: sent again if its tool is repeatable, else told to the model as unknown).
    `options`: `[worker]`'s slots, cache and polls; those unset keep the SDK's
    defaults."""
    sized: dict[str, Any] = {}
    if options.max_concurrent_workflow_tasks is not None:
        sized["max_concurrent_workflow_tasks"] = options.max_concurrent_workflow_tasks
    if options.max_cached_workflows is not None:
        sized["max_cached_workflows"] = options.max_cached_workflows
    # (The poller behaviour, not the SDK's max_concurrent_*_task_polls, which it
    # deprecates for it.)
    if options.max_concurrent_workflow_task_polls is not None:
        sized["workflow_task_poller_behavior"] = PollerBehaviorSimpleMaximum(
            maximum=options.max_concurrent_workflow_task_polls
        )
    if options.max_concurrent_activity_task_polls is not None:
        sized["activity_task_poller_behavior"] = PollerBehaviorSimpleMaximum(
            maximum=options.max_concurrent_activity_task_polls
        )
    return Worker(
        client,
        task_queue=task_queue,
        interceptors=telemetry.temporal_interceptors(client),
        workflows=[AgentRun],
        activities=[
            llm.llm_turn,
            llm.end_run,
            tools.list_tools,
            tools.call_tool,
            check_arguments,
        ],
        max_concurrent_activities=options.max_concurrent_activities,
        sticky_queue_schedule_to_start_timeout=STICKY_TIMEOUT,
        graceful_shutdown_timeout=shutdown_grace,
        **sized,
    )


def gateway_client(activities: int = MAX_CONCURRENT_ACTIVITIES) -> httpx.AsyncClient:
    """The worker's client for the gateway: turns wait as long as they are held (no read
    timeout), on connections that TCP keepalive checks (a gateway host that went away
    without closing them is noticed within ~60 s, and the attempt fails and is
    retried).  `activities`: the worker's activity slots, each of which may hold a
    turn, and so a connection."""
    limits = httpx.Limits(max_connections=activities + 24, max_keepalive_connections=256)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=GATEWAY_CONNECT_TIMEOUT_S),
        transport=httpx.AsyncHTTPTransport(limits=limits, socket_options=KEEPALIVE),
    )


async def serve(
    config: Config,
    token: str | None,
    stop: asyncio.Event,
    shutdown_grace: timedelta = GRACEFUL_SHUTDOWN,
) -> None:
    """Run the worker until `stop` is set, then hand over and close every connection.
    `config` already carries the environment's overrides (`load_config`); `token` is
    its `token` (or LUFTPAUSE_TOKEN), sent to the gateway."""
    t = config.temporal
    client = await connect(t, stop)
    if client is None:
        return  # asked to stop while Temporal was not there yet
    await _namespace_exists(client, t)
    pool = McpPool(config.mcp_servers)
    async with gateway_client(config.worker.max_concurrent_activities) as http:
        llm = LlmActivities(http, base_url=config.gateway_url, token=token)
        worker = build_worker(
            client,
            task_queue=t.task_queue,
            llm=llm,
            tools=ToolActivities(pool),
            shutdown_grace=shutdown_grace,
            options=config.worker,
        )
        # A full collection stops the loop, and with it the workflow tasks and the
        # activities of every run this worker carries (luftpause._process.freeze_heap).
        log.info("%s", freeze_heap())
        running = asyncio.create_task(worker.run())
        log.info(
            "worker on task queue %r (temporal %s, gateway %s, mcp servers: %s)",
            t.task_queue,
            t.address,
            config.gateway_url,
            ", ".join(pool.servers) or "none",
        )
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({running, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not running.done():
            await worker.shutdown()
        stopped.cancel()
        try:
            await running
        finally:
            await pool.aclose()


# `[worker]`'s keys, each a flag of the same name that overrides the file's value; with
# neither, the value in parentheses.
WORKER_FLAGS: dict[str, str] = {
    "max_concurrent_activities": "activities at once: LLM turns, tool calls "
    "(if neither sets it: 1000)",
    "max_concurrent_workflow_tasks": "workflow tasks at once (if neither sets it: the SDK's, 100)",
    "max_cached_workflows": "runs kept in memory between their workflow tasks, 0 for none "
    "(if neither sets it: the SDK's, 1000)",
    "max_concurrent_workflow_task_polls": "long polls for workflow tasks "
    "(if neither sets it: the SDK's, 5)",
    "max_concurrent_activity_task_polls": "long polls for activity tasks "
    "(if neither sets it: the SDK's, 5)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        # (An empty variable is unset, as for the gateway: helper-127 read "." here.)
        default=os.environ.get("LUFTPAUSE_CONFIG") or "luftpause.toml",
        help="path of luftpause.toml (default: $LUFTPAUSE_CONFIG or ./luftpause.toml)",
    )
    p.add_argument("--task-queue", help="override [temporal] task_queue")
    p.add_argument(
        "--shutdown-grace-s",
        type=seconds,
        default=GRACEFUL_SHUTDOWN.total_seconds(),
        help="on SIGTERM, how long LLM turns and tool calls in flight may go on before "
        "they are cancelled (a turn runs again on the next worker; a tool call is one that "
        "broke off: sent again only if its tool is repeatable) (default %(default)g)",
    )
    for key, what in WORKER_FLAGS.items():
        p.add_argument(
            "--" + key.replace("_", "-"),
            type=int,
            metavar="N",
            help=f"overrides the file's [worker] {key}: {what}",
        )


def with_flags(config: Config, args: argparse.Namespace) -> Config:
    """`config` with the `[worker]` values its flags give; ConfigError naming the key and
    the flag for a value it does not take (before anything starts)."""
    given = {key: getattr(args, key) for key in WORKER_FLAGS if getattr(args, key) is not None}
    flags = {key: "--" + key.replace("_", "-") for key in given}
    return config.with_worker(given, flags) if given else config


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = load_config(args.config, os.environ)
    except ConfigError as exc:
        raise SystemExit(f"luftpause worker: {exc}{default_file_hint(args.config)}") from None
    if args.task_queue:
        temporal = config.temporal.model_copy(update={"task_queue": args.task_queue})
        config = config.model_copy(update={"temporal": temporal})
    try:
        config = with_flags(config, args)
    except ConfigError as exc:
        raise SystemExit(f"luftpause worker: {exc}") from None
    token = config.token
    for line in config.unset_keys(os.environ, worker=True):
        logging.getLogger("luftpause.worker").warning("%s", line)
    try:
        config.temporal.connect_options(os.environ)  # its TLS files and API key
    except ConfigError as exc:
        raise SystemExit(f"luftpause worker: {args.config}: {exc}") from None

    try:
        telemetry.setup("luftpause-worker")
    except telemetry.TracingError as exc:
        raise SystemExit(f"luftpause worker: {exc}") from None

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, token, stop, timedelta(seconds=args.shutdown_grace_s))

    try:
        asyncio.run(main())
    except RuntimeError as exc:  # e.g. Temporal unreachable
        raise SystemExit(f"luftpause worker: {exc}") from None
    finally:
        telemetry.shutdown()  # the CLI exits past atexit: export the last spans now
    return 0
