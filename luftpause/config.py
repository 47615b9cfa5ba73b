"""`luftpause.toml`: the one configuration file, validated with pydantic.

Shared by the gateway (endpoints), the worker (MCP servers, Temporal) and `luftpause
up`; it imports nothing of theirs.  A bad file is a `ConfigError` whose message names
the file, the field and what was expected, so a user can fix it without reading code.

```toml
[[endpoints]]
name = "sglang-a"
url = "http://127.0.0.1:30000"
kind = "sglang"          # sglang | vllm | llamacpp | ollama | openai | router | classifier
models = ["llama-3.2-1b"]
health_path = "/health"
api_key_env = "RUNPOD_KEY"   # hosted endpoints: key read from the environment
api_path = "/v1"         # kind = "openai": where its OpenAI API is under url (Gemini:
                         # url = "https://generativelanguage.googleapis.com",
                         # api_path = "/v1beta/openai"); turns go to url + api_path +
                         # /chat/completions
load_from = []           # for kind = "router": the engines whose load it reports (they
                         # are probed, not sent turns: the router places turns on them)
kv_tokens = 56000        # optional: KV pool size (SGLang and vLLM report theirs), enables
                         # program-level admission
slots = 48               # optional: how many requests the engine runs at once (SGLang and
                         # llama.cpp report theirs; vLLM's --max-num-seqs, a hosted API's
                         # concurrency limit): no more turns go to it at once, the rest
                         # wait in luftpause's order; a router's: the sum of its
                         # load_from engines' (each configured or reported)
labels = []              # for kind = "classifier": class names, in /classify's order
messages = true          # serves the Anthropic Messages API (/v1/messages): default true
                         # for sglang, vllm, llamacpp and ollama, false otherwise
responses = true         # serves the OpenAI Responses API (/v1/responses): the same defaults
# discover = "dns"       # optional: url's host names a set of engines, one per address it
                         # resolves to (a Kubernetes headless Service, a Compose service
                         # scaled to N, Consul): each is a replica "<name>-<address>:<port>";
                         # "dns-srv": url names SRV records (no port), which give them
device = "gpu0"          # optional: endpoints with the same label time-slice one GPU
                         # (with policy.pack_shared_devices)

[[mcp_servers]]          # tools for sub-agents: streamable HTTP ...
name = "search"
url = "http://127.0.0.1:9000/mcp"
tool_timeout_s = 300.0   # optional: how long one call may take once sent (then it is cut)
[[mcp_servers]]          # ... or stdio
name = "files"
command = ["npx", "-y", "@modelcontextprotocol/server-filesystem", "/srv"]

[mcp]                    # optional: the gateway's own MCP server (/mcp); default shown
approve_tool = true      # false: no `approve` tool, so the calling model cannot answer
                         # approvals; the user does, in their client (elicitation,
                         # tasks/update)

[temporal]
address = "127.0.0.1:7233"
namespace = "default"
task_queue = "luftpause"

[worker]                 # optional: what one `luftpause worker` takes at once, under
                         # temporalio's names (the flags of `luftpause worker` override)
max_concurrent_activities = 1000
# max_concurrent_workflow_tasks = 100       # unset: the SDK's defaults, as shown
# max_cached_workflows = 1000
# max_concurrent_workflow_task_polls = 5
# max_concurrent_activity_task_polls = 5

[discovery]              # optional: for endpoints with discover; defaults shown
period_s = 5.0           # how often their names are resolved again
timeout_s = 2.0
nameservers = []         # "address[:port]" to ask instead of the system resolver,
                         # e.g. ["127.0.0.1:8600"] for Consul's DNS interface

[policy]                 # optional: the scheduler's constants (scheduler.Policy); defaults shown
turn_timeout_s = 600.0
idle_run_expiry_s = 1800.0
strict_affinity = true
kv_fill = 0.8            # with kv_tokens: the pool share bound runs may fill
batch_kv_fill = 0.7      # ... batch runs; "off" = as kv_fill
kv_retention_s = 60.0
lane_batch_kv_fill = "off"   # a share (0-1) turns interactive lanes on
pack_shared_devices = false  # endpoints with the same `device` share one GPU: while
                             # interactive runs hold KV there, new runs go beside them
max_held_per_caller = "off"  # a number: a caller with that many turns of a class held
                             # gets 429 for new work of it (a run in progress never)
```
Top-level keys (TOML puts them before the first table): `gateway_url`, where
sub-agents' LLM turns go (default http://127.0.0.1:8080).
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from scheduler import Policy, ReplicaSpec

Kind = Literal["sglang", "vllm", "llamacpp", "ollama", "openai", "router", "classifier"]

# The header that pins a request to one data-parallel rank of a server, and the kinds
# that take it (SGLang's chat, completions and messages routes; vLLM's), with the label
# their /metrics tell the ranks' load apart by.
DP_RANK_HEADER = "X-Data-Parallel-Rank"
DP_RANK_LABEL: Mapping[str, str] = {"sglang": "dp_rank", "vllm": "engine"}
DP_RANK_HEADER_KINDS = frozenset(DP_RANK_LABEL)

# The Prometheus gauges each engine kind reports its load in: (queued, running).
LOAD_METRICS: Mapping[str, tuple[str, str]] = {
    "sglang": ("sglang:num_queue_reqs", "sglang:num_running_reqs"),
    "vllm": ("vllm:num_requests_waiting", "vllm:num_requests_running"),
    "llamacpp": ("llamacpp:requests_deferred", "llamacpp:requests_processing"),
}

# Engine kinds the gateway asks for their KV pool size when `kv_tokens` is not given,
# and for the requests they run at once when `slots` is not.
# An environment variable's name, as `*_env` keys give one (an empty name was skipped
# without a word: the endpoint went without its key).
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# The largest count a file may give (a pool size, a limit): past any engine's, and a
# float holds it exactly (a larger one overflowed the status page's arithmetic).
BIG = 2**53
# Durations with no natural bound: at most a day (an `inf` is refused, as every
# number that is not finite).
DAY_S = 86_400.0
# The shortest probe or discovery period and timeout: a smaller one is a busy loop.
MIN_PERIOD_S = 0.05
KV_REPORTED_BY: tuple[str, ...] = ("sglang", "vllm")
SLOTS_REPORTED_BY: tuple[str, ...] = ("sglang", "llamacpp")

# The APIs a turn may speak, and where each goes under an endpoint's `url` + `api_path`:
# OpenAI Chat Completions, Anthropic Messages (Claude Code's) and OpenAI Responses
# (Codex's).
Api = Literal["chat", "messages", "responses"]
API_PATHS: Mapping[Api, str] = {
    "chat": "/chat/completions",
    "messages": "/messages",
    "responses": "/responses",
}
# Engine kinds that serve the two newer APIs themselves unless the file says
# `messages = false` / `responses = false`.  Messages: vLLM >= 0.11.1, SGLang (since
# 2026-02), llama.cpp's server (since 2025-11), Ollama >= 0.14.  Responses: vLLM,
# SGLang, llama.cpp's server (since 2026-01, stateless: no previous_response_id), Ollama
# >= 0.13.3 (stateless).  Routers differ (SMG and vllm-router route both, sglang-router
# 0.3.2 only Responses) and hosted OpenAI-compatible APIs mostly serve neither: those
# take `messages = true` / `responses = true` where they do.
NEWER_APIS_SERVED_BY: tuple[str, ...] = ("sglang", "vllm", "llamacpp", "ollama")

# Where each kind answers a health check when the file does not say.
DEFAULT_HEALTH_PATH: Mapping[str, str] = {
    "sglang": "/health",
    "vllm": "/health",
    "llamacpp": "/health",
    "ollama": "/",
    "openai": "/models",  # under api_path
    "router": "/health",
    "classifier": "/health",
}


# A model's name, at most (a request's, and the file's): vLLM serves a model by its path
# when no name is given.  Bounded: a request's goes into spans and error messages.
MODEL_MAX_CHARS = 1024


def _control(c: str) -> bool:
    """A control character, which no URL carries (httpx refuses it at every request:
    helper-143, a probe round failed for every endpoint)."""
    return ord(c) < 0x20 or ord(c) == 0x7F


def _check_http_url(v: str, example: str, *, base: bool = True, key: str = "api_key_env") -> None:
    """Every URL luftpause is given is http(s) with a host (and a port 1-65535 if it
    names one) and no credentials (`key` names where a key goes instead); a `base`,
    to which luftpause adds the API's paths, has no query or fragment either (an MCP
    server's URL is used as it is, and may carry one).  The error shows one."""
    expected = f"expected an http:// or https:// URL, e.g. {example}"
    if not v.startswith(("http://", "https://")) or len(v) < len("http://x"):
        raise ValueError(expected)
    parts = urlsplit(v)
    try:
        port = parts.port  # ValueError for a port that is no number or out of range
    except ValueError:
        raise ValueError(f"{expected}; the port of {v!r} is not 1-65535") from None
    if any(c.isspace() or _control(c) for c in v) or (port is None and parts.netloc.endswith(":")):
        raise ValueError(f"{expected}; {v!r} is not one")
    if port == 0:
        raise ValueError(f"{expected}; the port of {v!r} is not 1-65535")
    if not parts.hostname:
        raise ValueError(f"{expected}; {v!r} names no host")
    if "@" in parts.netloc:
        raise ValueError(
            f"{expected}; credentials in the URL are not sent (give a key with "
            f"{key}): {parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
        )
    if base and ("?" in v or "#" in v):
        raise ValueError(
            f"{expected}; without a query or fragment (luftpause adds the API's paths "
            f"to it): {v.split('?')[0].split('#')[0]}"
        )


class ConfigError(Exception):
    """The configuration cannot be used; the message says where and why."""


class Endpoint(BaseModel):
    """One inference endpoint: an engine replica, a router in front of some, a hosted
    OpenAI-compatible API, or a single-pass classifier."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
    url: str
    kind: Kind
    models: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MODEL_MAX_CHARS)]], Field(min_length=1)
    ]
    health_path: str | None = None
    api_key_env: Annotated[str, Field(pattern=ENV_NAME)] | None = None
    # Where the key goes.  "authorization": `Authorization: Bearer <key>` on every
    # request (vLLM and SGLang's --api-key read only that, on every API).  "x-api-key":
    # `x-api-key: <key>` on every request (api.anthropic.com, which takes a Bearer as an
    # OAuth token and answers 401 "Invalid bearer token" to an API key there).  None: by
    # host, "x-api-key" for *.anthropic.com, else Bearer, and on Messages API requests
    # x-api-key too, where other Anthropic-compatible hosts read it.
    api_key_header: Literal["authorization", "x-api-key"] | None = None
    # kind = "openai": the path of its OpenAI-compatible API under `url`, as in an OpenAI
    # client's base_url (most hosted APIs: /v1; Gemini: /v1beta/openai).
    api_path: str = "/v1"
    load_from: list[str] = []
    kv_tokens: Annotated[int, Field(gt=0, le=BIG)] | None = None
    # How many requests the engine runs at once (each data-parallel rank's, with
    # dp_size): SGLang's --max-running-requests, vLLM's --max-num-seqs, llama.cpp's
    # --parallel, a hosted API's concurrency limit.  None: as the engine reports it
    # (SGLang and llama.cpp do), else unknown; a router with load_from: the sum of its
    # engines' (Config.slots_of).
    slots: Annotated[int, Field(gt=0, le=BIG)] | None = None
    # kind = "classifier": the names of its classes in order (vLLM's /classify answers
    # probabilities as a bare list).
    labels: list[Annotated[str, Field(min_length=1)]] = []
    # Whether it serves the Anthropic Messages API, and the OpenAI Responses API; None:
    # by kind (NEWER_APIS_SERVED_BY).
    messages: bool | None = None
    responses: bool | None = None
    # "dns": `url`'s host names a set of engines, one per address it resolves to (a
    # Kubernetes headless Service, a Compose service scaled to N, a Consul service), on
    # url's port.  "dns-srv": the host is an SRV name (`_http._tcp.<service>`), whose
    # records give each engine's host and port (Consul or Nomad services on dynamic
    # ports, a headless Service's named port).  Each engine is a replica of its own,
    # `<name>-<address>:<port>`, with the rest of this entry (Config.expanded); the
    # names are resolved again every [discovery] period_s.
    discover: Literal["dns", "dns-srv"] | None = None
    # The server runs this many data-parallel ranks (SGLang --dp-size, with or without
    # --enable-dp-attention; vLLM --data-parallel-size), each with a KV cache of its own.
    # Each rank is then a replica, `<name>@<rank>`, whose turns carry the header
    # `X-Data-Parallel-Rank`: a run stays on the rank that holds its prefix, where the
    # engine's own balancer (SGLang's round robin) would spread its turns over the ranks.
    dp_size: Annotated[int, Field(ge=1, le=1024, strict=True)] = 1
    # The rank a replica is (Config.expanded sets it); not for the file.
    dp_rank: int | None = None
    # The GPU it shares with other endpoints (any label: endpoints with the same label
    # time-slice one device, e.g. two SGLang servers each started with
    # --mem-fraction-static 0.4 on GPU 0).  The scheduler packs new runs onto one of
    # them while interactive runs are there, with `policy.pack_shared_devices` (rule 13).
    device: Annotated[str, Field(min_length=1, max_length=128)] | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        _check_http_url(v, "http://127.0.0.1:30000")
        v = v.rstrip("/")
        # An OpenAI client's base_url ends in the API's path: /v1, or e.g. Gemini's
        # /v1beta/openai.  luftpause takes the server's root and adds that path itself.
        api = re.search(r"/v\d+[a-z0-9]*(/openai)?$", v)
        if api is None:
            return v
        root, path = v[: api.start()], api.group(0)
        if path == "/v1":
            raise ValueError(
                f"expected the server's root, without the trailing /v1 (luftpause adds "
                f"/v1/chat/completions): {root}"
            )
        raise ValueError(
            f"expected the server's root, without the API's path: url = \"{root}\" and "
            f"api_path = \"{path}\" (kind = 'openai'; luftpause adds /chat/completions to "
            "api_path)"
        )

    @field_validator("health_path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or any(map(_control, v))):
            raise ValueError(
                "expected a path starting with '/', without control characters, e.g. /health"
            )
        return v

    @field_validator("api_path")
    @classmethod
    def _api_path(cls, v: str) -> str:
        v = v.rstrip("/")
        if (
            not v.startswith("/")
            or v.endswith(("/chat/completions", "/chat"))
            or any(map(_control, v))
        ):
            raise ValueError(
                "expected the path of the OpenAI API under url, as an OpenAI client's "
                "base_url ends, e.g. /v1 or /v1beta/openai (luftpause adds /chat/completions)"
            )
        return v

    @model_validator(mode="after")
    def _router_only_fields(self) -> Endpoint:
        if self.load_from and self.kind != "router":
            raise ValueError("load_from is only for kind = 'router'")
        if self.api_key_header is not None and self.api_key_env is None:
            raise ValueError("api_key_header is where api_key_env's key goes: set api_key_env too")
        if self.labels and self.kind != "classifier":
            raise ValueError("labels is only for kind = 'classifier'")
        for field in ("messages", "responses", "slots", "kv_tokens"):
            if getattr(self, field) and self.kind == "classifier":
                raise ValueError(f"{field} is not for kind = 'classifier' (it takes no turns)")
        if self.api_path != "/v1" and self.kind != "openai":
            # Engines and routers serve /v1; one behind a path prefix takes it in url.
            raise ValueError(
                "api_path is only for kind = 'openai' (an engine behind a path prefix "
                "takes it in url, e.g. http://host/llama)"
            )
        if self.discover is not None:
            self._check_discoverable()
        if self.device is not None and (
            self.kind in ("router", "classifier") or self.discover or self.dp_size > 1
        ):
            raise ValueError(
                "device is for one engine server on one GPU it shares with other "
                "endpoints; not for kind 'router' or 'classifier', discover or dp_size > 1 "
                "(their engines or ranks are on devices of their own)"
            )
        if self.dp_rank is not None:
            raise ValueError(
                "dp_rank is set by luftpause on each rank's replica; give the server's "
                "dp_size instead"
            )
        if self.dp_size > 1 and self.kind not in DP_RANK_HEADER_KINDS:
            raise ValueError(
                f"dp_size is for kind 'sglang' or 'vllm', which take the rank of a request in "
                f"{DP_RANK_HEADER}; kind '{self.kind}' does not (give each server as an "
                "endpoint of its own)"
            )
        return self

    def _check_discoverable(self) -> None:
        parts = urlsplit(self.url)
        if self.kind == "classifier":
            raise ValueError(
                "discover is for endpoints that take turns, not kind = 'classifier' (give "
                "each classifier its url)"
            )
        how = f"discover = '{self.discover}'"
        if parts.scheme != "http":
            # Turns go to each address, where a certificate for the name does not verify.
            raise ValueError(
                f"{how} takes an http:// url: turns go to each address the name "
                "resolves to, where a TLS certificate for the name would not verify"
            )
        host = parts.hostname or ""
        example = (
            "e.g. http://_sglang._tcp.service.consul"
            if self.discover == "dns-srv"
            else "e.g. http://sglang-headless.llm.svc.cluster.local:30000"
        )
        if is_address(host):  # (a URL with no host or with credentials is refused first)
            raise ValueError(
                f"{how} expects a host name to resolve in url, not the address {host} ({example})"
            )
        try:
            host.encode("idna")  # what a resolver is asked: labels of 1-63 characters
            port = parts.port  # a port that is not a number or out of range raises here
        except (UnicodeError, ValueError):
            raise ValueError(
                f"{how}: url {self.url!r} has no valid host name and port ({example})"
            ) from None
        if self.discover == "dns-srv" and port is not None:
            raise ValueError(
                f"{how}: the SRV records give each engine's port; url takes none ({example})"
            )
        if self.load_from:
            raise ValueError(
                "discover is not for kind = 'router' with load_from (a router finds its "
                "engines itself)"
            )

    @property
    def host(self) -> str:
        """The host name in `url` (what `discover` resolves)."""
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        """The port in `url` (http's when it gives none)."""
        return urlsplit(self.url).port or 80

    def ranks(self) -> list[Endpoint]:
        """The replicas of its data-parallel ranks, `<name>@<rank>` (itself when it has
        one rank)."""
        if self.dp_size == 1:
            return [self]
        return [
            self.model_copy(update={"name": f"{self.name}@{rank}", "dp_rank": rank})
            for rank in range(self.dp_size)
        ]

    @property
    def server(self) -> str:
        """The name of the server a replica is on: a rank's endpoint without `@<rank>`."""
        return self.name if self.dp_rank is None else self.name.rsplit("@", 1)[0]

    def at(self, netloc: str) -> Endpoint:
        """The replica of a discovered endpoint at `netloc` ("10.0.0.5:30000",
        "[fd00::5]:30000"): its url's host and port replaced, named `<name>-<netloc>`
        (another port is another engine, under another name)."""
        parts = urlsplit(self.url)
        url = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        return self.model_copy(
            update={"name": f"{self.name}-{netloc}", "url": url, "discover": None}
        )

    @property
    def health(self) -> str:
        """The path of the health check under `url`."""
        if self.health_path is not None:
            return self.health_path
        if self.kind == "openai":
            return self.api_path + DEFAULT_HEALTH_PATH["openai"]
        return DEFAULT_HEALTH_PATH[self.kind]

    def api_url(self, api: Api) -> str:
        """Where its turns of an API go (a hosted API's: all under its api_path)."""
        return f"{self.url}{self.api_path}{API_PATHS[api]}"

    def serves(self, api: Api) -> bool:
        """Takes turns of this API: the file's `messages` / `responses`, else by kind."""
        if api == "chat":
            return self.generative
        given = self.messages if api == "messages" else self.responses
        return given if given is not None else self.kind in NEWER_APIS_SERVED_BY

    @property
    def generative(self) -> bool:
        """Takes chat turns (everything but single-pass classifiers)."""
        return self.kind != "classifier"

    @property
    def reports_load(self) -> bool:
        return self.kind in LOAD_METRICS or self.kind == "router"


class McpServer(BaseModel):
    """An upstream MCP tool server whose tools sub-agents may call: streamable HTTP
    (`url`) or a subprocess speaking stdio (`command`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    url: str | None = None
    command: Annotated[list[str], Field(min_length=1)] | None = None
    env: dict[str, str] = {}
    # A bearer token for an http server, read from this environment variable.
    token_env: Annotated[str, Field(pattern=ENV_NAME)] | None = None
    # The MCP protocol generation to speak: "auto" (probe, prefer the newest),
    # "2026-07-28" (stateless) or "legacy" (session-based, 2025-11-25 and before).  A
    # stateless call is one HTTP request: when a worker dies mid-call, the server sees the
    # disconnect and cancels the tool; on a legacy session it finishes the orphaned call,
    # and Temporal's retry runs it again (bench/RESULTS.md).
    protocol: Literal["auto", "2026-07-28", "legacy"] = "auto"
    # Tools of this server whose calls never wait for the user's approval, whatever the
    # server's hints say (["*"]: all of them).  By MCP's defaults a tool the server does
    # not mark `readOnlyHint: true` or `destructiveHint: false` may be destructive, and
    # waits; a run's `approveTools` still makes any tool wait.
    no_approval: list[Annotated[str, Field(min_length=1, max_length=128)]] = []
    # How long one call of this server's tools may take once sent, in seconds (opening
    # the connection first is not counted).  A call that has no answer by then is cut
    # (the server is told to cancel it) and told to the run's model as an error (it may
    # have run), as Codex's `tool_timeout_sec` and Claude Code's MCP_TOOL_TIMEOUT are; a
    # worker that dies mid-call is noticed by its heartbeat, not by this.
    tool_timeout_s: Annotated[float, Field(ge=MIN_PERIOD_S, le=DAY_S, strict=True)] = 300.0

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None:
            _check_http_url(v, "http://127.0.0.1:9000/mcp", base=False, key="token_env")
        return v

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.url is None) == (self.command is None):
            raise ValueError(
                f"mcp server '{self.name}': give exactly one of url (streamable HTTP) "
                'or command (stdio, e.g. ["luftpause", "fake-mcp", "--transport", "stdio"])'
            )
        return self


class McpDoor(BaseModel):
    """`[mcp]`: the gateway's own MCP server at /mcp (the door), not the upstream
    `[[mcp_servers]]` its runs call.  Read at start: a reload that changes it says it
    needs a restart (`not_applied`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    # Whether the door offers the `approve` tool.  Any client may call it, the calling
    # model included: in a harness that lets luftpause's tools run unasked, an approval
    # meant for a person is the model's to give.  false: it is not listed, and a call of
    # it is refused; a pending call is answered by the user alone, in their client (the
    # question asked while `await` or `run` waits, form elicitation; the Tasks
    # extension's tasks/update, from a client that shows forms), or the run cancelled.
    approve_tool: bool = True


class Temporal(BaseModel):
    """Where the worker and the MCP door find Temporal, and how they prove who they are
    to a server that asks (Temporal Cloud, a self-hosted cluster with mTLS)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    address: str = "127.0.0.1:7233"
    namespace: Annotated[str, Field(min_length=1)] = "default"
    task_queue: Annotated[str, Field(min_length=1)] = "luftpause"
    # TLS to Temporal's frontend, verified against the system's CAs or `tls_ca_file`;
    # unset, on by itself when any tls_* file or an API key is given.  `false` with an
    # API key sends the key over plain gRPC (a cluster whose TLS a service mesh ends;
    # the SDK allows it: helper-207).
    tls: bool | None = None
    tls_ca_file: str | None = None  # PEM: the CA that signed the server's certificate
    tls_cert_file: str | None = None  # PEM: this client's certificate (mTLS) ...
    tls_key_file: str | None = None  # ... and its private key
    tls_server_name: str | None = None  # the name the server's certificate is checked for
    # An API key (Temporal Cloud), read from this environment variable (never the file).
    api_key_env: Annotated[str, Field(pattern=ENV_NAME)] | None = None

    @field_validator("address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        # What the SDK takes: host:port, no scheme or path (a worker given anything else
        # died with the SDK's ValueError, a traceback).
        host, colon, port = v.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # an IPv6 address, bracketed: [::1]:7233
            bracketed = is_address(host) and ":" in host
        else:
            bracketed = ":" not in host  # unbracketed, a second ':' is no host:port
        if (
            not colon
            or not host
            or not bracketed
            # (len first: int() of over 4300 digits raises, naming a sys setting)
            or not (port.isascii() and port.isdigit() and len(port) <= 5)
            or not 0 < int(port) < 65536
            or any(c.isspace() or c in "/@?#[]" for c in host)
        ):
            raise ValueError(
                f"expected host:port, e.g. 127.0.0.1:7233 (an IPv6 address in brackets: "
                f"[::1]:7233), got {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _cert_with_key(self) -> Temporal:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "temporal: tls_cert_file and tls_key_file go together (a client certificate "
                "and its private key, for mTLS)"
            )
        if self.tls is False and self._tls_settings():
            raise ValueError(
                f"temporal: tls = false, but {', '.join(self._tls_settings())} "
                "configure TLS: take tls = false out, or them"
            )
        return self

    def _tls_settings(self) -> list[str]:
        """The tls_* settings given (each asks for TLS)."""
        names = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name")
        return [name for name in names if getattr(self, name) is not None]

    @property
    def uses_tls(self) -> bool:
        if self.tls is not None:
            return self.tls
        return self.api_key_env is not None or bool(self._tls_settings())

    def connect_options(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """Keyword arguments for temporalio's `Client.connect` besides the address:
        namespace, TLS (its files read now) and the API key (from `api_key_env`).
        Raises ConfigError naming the field for a file it cannot read or a key unset."""
        options: dict[str, Any] = {"namespace": self.namespace}
        if self.api_key_env is not None:
            key = environ.get(self.api_key_env, "").strip()
            if not key:
                raise ConfigError(
                    f"temporal: api_key_env = {self.api_key_env!r}, but {self.api_key_env} "
                    "is not set"
                )
            options["api_key"] = key
        if not self.uses_tls:
            # Said outright: left out, the SDK turns TLS on by itself beside an API key,
            # and `tls = false` with a key spoke TLS all the same (helper-211).
            options["tls"] = False
            return options

        def read(field: str) -> bytes | None:
            path = getattr(self, field)
            if path is None:
                return None
            try:
                return Path(path).expanduser().read_bytes()
            except OSError as exc:
                raise ConfigError(f"temporal: {field} = {path!r}: {exc.strerror}") from None

        from temporalio.service import TLSConfig  # the worker's and gateway's, not sim's

        options["tls"] = TLSConfig(
            server_root_ca_cert=read("tls_ca_file"),
            client_cert=read("tls_cert_file"),
            client_private_key=read("tls_key_file"),
            domain=self.tls_server_name,
        )
        return options


class Probes(BaseModel):
    """`[probes]`: how the gateway checks its endpoints (health, and load where the kind
    reports it).  The SGLang router's --health-check-interval-secs and
    --health-check-timeout-secs, and its failure threshold for late answers."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    period_s: Annotated[float, Field(ge=MIN_PERIOD_S, le=300, strict=True)] = 2.0
    timeout_s: Annotated[float, Field(ge=MIN_PERIOD_S, le=300, strict=True)] = 2.0
    # Late answers in a row that take a healthy engine out (a busy one may answer one
    # late: SGLang's /health can wait for its scheduler).
    late_to_unhealthy: Annotated[int, Field(ge=1, le=BIG, strict=True)] = 2


class Discovery(BaseModel):
    """`[discovery]`: how endpoints with `discover` are resolved."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    # Envoy's STRICT_DNS default refresh is 5 s; a pod that left is then retired (its
    # turns finish) within a period, and a new one joins once a probe finds it healthy.
    period_s: Annotated[float, Field(ge=MIN_PERIOD_S, le=3600, strict=True)] = 5.0
    timeout_s: Annotated[float, Field(ge=MIN_PERIOD_S, le=60, strict=True)] = 2.0
    # Which addresses are engines.  "v4_preferred": the IPv4 ones, or the IPv6 ones when
    # there is no IPv4 one (a dual-stack pod has one of each: counted twice, its KV pool
    # and cap would be too); "v4_only", "v6_only"; "all": every address is an engine.
    family: Literal["v4_preferred", "v4_only", "v6_only", "all"] = "v4_preferred"
    # Ask these servers ("host" or "host:port", host an IP address) instead of the
    # system resolver, e.g. Consul's DNS interface on 127.0.0.1:8600.  Empty: the
    # system's (getaddrinfo: /etc/hosts, resolv.conf and its search domains).
    nameservers: list[str] = []

    @field_validator("nameservers")
    @classmethod
    def _servers(cls, v: list[str]) -> list[str]:
        for server in v:
            nameserver_address(server)
        return v


def nameserver_address(server: str) -> tuple[str, int]:
    """("127.0.0.1:8600" | "10.0.0.10" | "[::1]:53" | "::1") -> (address, port).  A host
    name is refused: resolving the resolver would need another resolver."""
    server = server.strip()
    if is_address(server):
        return server, 53
    try:
        parts = urlsplit("//" + server)
        host = parts.hostname or ""
        port = 53 if parts.port is None else parts.port
    except ValueError:  # a port out of range, or not a number
        host, port = "", 0
    if not is_address(host) or port == 0:
        raise ValueError(
            f"expected a nameserver as an IP address with an optional port, e.g. "
            f"127.0.0.1:8600 or [::1]:53, not {server!r}"
        )
    return host, port


def is_address(host: str) -> bool:
    """An IP address literal (not a name to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# `[worker]`: how many of each a worker may hold, least and most (strict, as every
# count in the file: TOML's true or 2.0 is none).  Slots: far past what one process
# runs (each LLM turn holds a connection to the gateway), and at least 1: the SDK takes
# 0 activities as its default of 100, without a word.  Cached workflows: temporalio's
# core sets aside memory for every entry as the worker starts (10**12 was an abort
# asking for 37 TB, not an error).  Polls: 100, the most the SDK's autoscaling poller
# opens by default.
_Slots = Annotated[int, Field(ge=1, le=100_000, strict=True)]
_Cached = Annotated[int, Field(ge=0, le=100_000, strict=True)]
_Polls = Annotated[int, Field(ge=1, le=100, strict=True)]
# Activities at once.  An LLM turn holds its slot while the gateway holds the turn in
# its queue, as long as that takes (an idle HTTP request and a heartbeat every few
# seconds); with the SDK's default of 100, a backlog of held turns would keep the tool
# calls of runs that could go on from starting.  As many as the gateway connections.
MAX_CONCURRENT_ACTIVITIES = 1000


class WorkerOptions(BaseModel):
    """`[worker]`: how much of the task queue's work one `luftpause worker` takes at once,
    under the names temporalio's `Worker` gives them.  None: the SDK's default.  Read at
    the worker's start; `luftpause worker`'s flags of the same names override them."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    max_concurrent_activities: _Slots = MAX_CONCURRENT_ACTIVITIES
    # Workflow tasks at once (the SDK's default: 100): the runs' steps between turns and
    # tool calls, which run on the worker's one event loop.
    max_concurrent_workflow_tasks: _Slots | None = None
    # Runs kept in memory between their workflow tasks (the SDK's default: 1000).  A run
    # that is not kept replays its history on its next one; 0 keeps none, and turns the
    # sticky queue off.
    max_cached_workflows: _Cached | None = None
    # Long polls held open for workflow tasks and for activity tasks (the SDK's default:
    # 5 each).
    max_concurrent_workflow_task_polls: _Polls | None = None
    max_concurrent_activity_task_polls: _Polls | None = None

    @model_validator(mode="after")
    def _cached_needs_two(self) -> WorkerOptions:
        # A worker that caches runs polls its sticky queue beside the shared one:
        # temporalio refuses one poll then (its core's check), and its docs ask for two
        # workflow-task slots (temporalio/worker/_worker.py, max_concurrent_workflow_tasks).
        if self.max_cached_workflows == 0:
            return self
        for key in ("max_concurrent_workflow_tasks", "max_concurrent_workflow_task_polls"):
            if getattr(self, key) == 1:
                raise ValueError(
                    f"{key} = 1, but a worker that caches runs (max_cached_workflows "
                    "above 0; the SDK's default is 1000) needs at least 2, one for its sticky "
                    "queue: give 2 or more, or max_cached_workflows = 0"
                )
        return self


_POLICY = Policy()
# strict: TOML's true/false are not shares (false would read as 0.0: lanes on at 0).
_Share = Annotated[float, Field(gt=0, le=1, strict=True)]


class PolicyConfig(BaseModel):
    """`[policy]`: the admission policy's constants (`scheduler.Policy`, whose comments
    say what each does).  Omitted keys keep the defaults; optional shares take "off"."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    # At least a second: the same value bounds how long the proxy waits on an engine.
    turn_timeout_s: Annotated[float, Field(ge=1, le=DAY_S, strict=True)] = _POLICY.turn_timeout_s
    idle_run_expiry_s: Annotated[float, Field(ge=1, le=7 * DAY_S, strict=True)] = (
        _POLICY.idle_run_expiry_s
    )
    assumed_reply_tokens: Annotated[int, Field(ge=1, le=BIG)] = _POLICY.assumed_reply_tokens
    max_reply_estimate: Annotated[int, Field(ge=1, le=BIG)] = _POLICY.max_reply_estimate
    strict_affinity: bool = _POLICY.strict_affinity
    cap_from_engine_queue: bool = _POLICY.cap_from_engine_queue
    cap_after_queued_probes: Annotated[int, Field(ge=1, le=BIG)] = _POLICY.cap_after_queued_probes
    cap_increase: Annotated[int, Field(ge=1, le=BIG)] = _POLICY.cap_increase
    cap_growth_doubles: bool = _POLICY.cap_growth_doubles
    reserve_for_paused_interactive: bool = _POLICY.reserve_for_paused_interactive
    kv_admission: bool = _POLICY.kv_admission
    learn_prompt_scale: bool = _POLICY.learn_prompt_scale
    learn_shared_prefix: bool = _POLICY.learn_shared_prefix
    kv_fill: _Share = _POLICY.kv_fill
    batch_kv_fill: _Share | None = _POLICY.batch_kv_fill
    kv_retention_s: Annotated[float, Field(ge=0, le=DAY_S, strict=True)] = _POLICY.kv_retention_s
    lane_batch_kv_fill: Annotated[float, Field(ge=0, le=1, strict=True)] | None = (
        _POLICY.lane_batch_kv_fill
    )
    pack_shared_devices: bool = _POLICY.pack_shared_devices
    eject_after_failures: Annotated[int, Field(ge=1, le=BIG, strict=True)] | None = (
        _POLICY.eject_after_failures
    )
    eject_for_s: Annotated[float, Field(gt=0, le=DAY_S, strict=True)] = _POLICY.eject_for_s
    max_held_per_caller: Annotated[int, Field(ge=1, le=BIG, strict=True)] | None = (
        _POLICY.max_held_per_caller
    )

    @field_validator(
        "batch_kv_fill",
        "lane_batch_kv_fill",
        "eject_after_failures",
        "max_held_per_caller",
        mode="before",
    )
    @classmethod
    def _off(cls, v: object, info: ValidationInfo) -> object:
        # TOML has no null: "off" switches an optional key off.
        if isinstance(v, str) and v.strip().lower() == "off":
            return None
        if isinstance(v, str | bool):
            what = {
                "eject_after_failures": "a number of failed turns",
                "max_held_per_caller": "a number of held turns",
            }.get(info.field_name or "", "a share between 0 and 1")
            raise ValueError(f'expected {what}, or "off"; got {v!r}')
        return v

    def to_policy(self) -> Policy:
        return Policy(**self.model_dump())


class Caller(BaseModel):
    """A caller that proves who it is: the bearer token in `token_env` is this caller's
    alone (`[[callers]]`).  Its requests are this caller's whatever they say, and it
    sees and touches only its own runs; the operator's `token` names any caller."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    name: Annotated[str, Field(min_length=1, max_length=128)]
    # The environment variable holding the caller's token (never the token itself: the
    # file is read by more people than the secret should be).
    token_env: Annotated[str, Field(pattern=ENV_NAME)]

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.:@-]+", v):
            raise ValueError("expected letters, digits and _ . : @ - only")
        # The names luftpause gives callers that name none: a caller with a token of
        # its own must not share a name with requests that prove nothing.
        if v in ("anonymous", "token") or v.startswith("mcp-session:"):
            raise ValueError(
                f"'{v}' is the name of callers that name none (anonymous, token, "
                "mcp-session:<id>); choose another"
            )
        return v


class Config(BaseModel):
    """The whole file."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    endpoints: Annotated[list[Endpoint], Field(min_length=1)]
    mcp_servers: list[McpServer] = []
    mcp: McpDoor = McpDoor()
    temporal: Temporal = Temporal()
    policy: PolicyConfig = PolicyConfig()
    probes: Probes = Probes()
    discovery: Discovery = Discovery()
    worker: WorkerOptions = WorkerOptions()
    # The base URL sub-agents' LLM turns go to: the gateway (default), or a peer router
    # when a benchmark compares them.
    gateway_url: str = "http://127.0.0.1:8080"
    # The largest request body the gateway reads (413 beyond): a held turn keeps its
    # body in memory until admitted.  A 1M-token context is ~4 MB of text.
    max_request_bytes: Annotated[int, Field(ge=1024, le=BIG, strict=True)] = 32 * 1024 * 1024
    # A harness's session header (Claude Code's x-claude-code-session-id, Codex's
    # session-id, OpenCode's x-session-affinity) names the run of a turn that has no
    # x-luftpause-run-id, before echoed tool calls are looked at (luftpause/headers.py).
    session_runs: bool = True
    # The bearer token /v1/*, /mcp and /status require, and the worker sends (env
    # LUFTPAUSE_TOKEN overrides it).  None: open access, with a warning at start.
    token: Annotated[str | None, Field(repr=False)] = None
    # Callers with tokens of their own (Caller); they need the operator's `token`.
    callers: list[Caller] = []

    @field_validator("token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        return None if v is None else bearer_token(v)

    @field_validator("gateway_url")
    @classmethod
    def _gateway_url(cls, v: str) -> str:
        # Checked here, not at the first turn: a worker with a URL it cannot use retries
        # every sub-agent's turns for ever while `status` says Running.
        v = v.strip().rstrip("/")
        _check_http_url(v, "http://127.0.0.1:8080")
        if v.endswith("/v1"):
            raise ValueError(
                f"expected the gateway's root, without the trailing /v1 (luftpause adds "
                f"/v1/chat/completions): {v[: -len('/v1')]}"
            )
        return v

    @model_validator(mode="after")
    def _kv_policies_need_kv(self) -> Config:
        p = self.policy
        known = any(e.kv_tokens or e.kind in KV_REPORTED_BY for e in self.replicas)
        if p.lane_batch_kv_fill is not None and not (p.kv_admission and known):
            raise ValueError(
                "policy.lane_batch_kv_fill: interactive lanes are made of runs holding KV; "
                "they need kv_admission = true and a known KV pool (kv_tokens, or "
                f"endpoints of kind {' or '.join(KV_REPORTED_BY)}, which report theirs)"
            )
        if p.pack_shared_devices:
            shared = [e for e in self.replicas if e.device is not None]
            if not (
                p.kv_admission and any(e.kv_tokens or e.kind in KV_REPORTED_BY for e in shared)
            ):
                raise ValueError(
                    "policy.pack_shared_devices: it packs new runs beside the interactive "
                    "runs holding KV on a shared GPU; it needs kv_admission = true and "
                    "endpoints that give a `device` and a known KV pool (kv_tokens, or "
                    f"kind {' or '.join(KV_REPORTED_BY)})"
                )
        return self

    @model_validator(mode="after")
    def _references(self) -> Config:
        names = [e.name for e in self.endpoints]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"endpoint names must be unique; repeated: {', '.join(dupes)}")
        servers = [m.name for m in self.mcp_servers]
        dupes = sorted({n for n in servers if servers.count(n) > 1})
        if dupes:
            raise ValueError(f"mcp server names must be unique; repeated: {', '.join(dupes)}")
        for what, values in (
            ("caller names", [c.name for c in self.callers]),
            ("callers' token_env", [c.token_env for c in self.callers]),
        ):
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ValueError(f"{what} must be unique; repeated: {', '.join(dupes)}")
        if self.callers and self.token is None:
            raise ValueError(
                "callers: callers' tokens need the operator's token as well (token, or "
                "LUFTPAUSE_TOKEN): the worker sends it with sub-agents' turns, and /status "
                "and /reload take only it; without one, every request would be let in"
            )
        by_name = {e.name: e for e in self.endpoints}
        behind: dict[str, str] = {}  # engine -> the router whose load it is
        for e in self.endpoints:
            for other in e.load_from:
                if other in behind:
                    where = (
                        " twice"
                        if behind[other] == e.name
                        else f", which router '{behind[other]}' names too"
                    )
                    raise ValueError(
                        f"endpoint '{e.name}': load_from names '{other}'{where}; an engine's "
                        "load is counted for one router only"
                    )
                behind[other] = e.name
                target = by_name.get(other)
                if target is None:
                    raise ValueError(f"endpoint '{e.name}': load_from names unknown '{other}'")
                if target.discover is not None:
                    raise ValueError(
                        f"endpoint '{e.name}': load_from names '{other}', whose engines are "
                        "discovered (discover = 'dns'); name engines given by url"
                    )
                if target.dp_size > 1:
                    raise ValueError(
                        f"endpoint '{e.name}': load_from names '{other}', whose ranks are "
                        "replicas of their own (dp_size); a router in front of them balances "
                        "its ranks itself: drop dp_size there"
                    )
                if target.kind not in LOAD_METRICS:
                    raise ValueError(
                        f"endpoint '{e.name}': load_from '{other}' is kind '{target.kind}', "
                        f"which reports no load (expected one of {', '.join(LOAD_METRICS)})"
                    )
                if target.kv_tokens is not None:
                    # Silently unused otherwise: luftpause admits runs by KV where it
                    # places them, and the router places them on its engines.
                    raise ValueError(
                        f"endpoint '{other}': kv_tokens is not used on an engine behind "
                        f"router '{e.name}' (load_from), which places the turns; give the "
                        f"router kv_tokens instead (its engines' pools summed, when it keeps "
                        f"each run on one engine)"
                    )
                if target.device is not None:
                    raise ValueError(
                        f"endpoint '{other}': device is not used on an engine behind router "
                        f"'{e.name}' (load_from): pack_shared_devices packs the endpoints "
                        f"turns go to, and the router places turns on its engines itself"
                    )
        return self

    @property
    def replicas(self) -> list[Endpoint]:
        """The endpoints turns go to: the generative ones, except the engines a router
        stands in front of (they are probed for the router's load, never sent turns:
        turns sent both ways would be counted and placed twice)."""
        behind = {n for e in self.endpoints for n in e.load_from}
        return [e for e in self.endpoints if e.generative and e.name not in behind]

    def unset_keys(self, environ: Mapping[str, str], *, worker: bool = False) -> list[str]:
        """What the environment lacks: each `api_key_env` / `token_env` naming a variable
        that is unset or blank.  Requests then go without a key, and a hosted endpoint
        fails every probe; the processes warn at start so that it is not a mystery.
        `worker`: only what the worker uses, the MCP servers' tokens (its turns go
        through the gateway, which alone holds the endpoints' keys and takes callers)."""
        named = [] if worker else [
            ("endpoint", e.name, "api_key_env", e.api_key_env) for e in self.endpoints
        ]  # fmt: skip
        named += [("mcp server", m.name, "token_env", m.token_env) for m in self.mcp_servers]
        unset = [
            f"{what} {name}: {field} = {var!r}, but {var} is not set: its requests go without a key"
            for what, name, field, var in named
            if var and not environ.get(var, "").strip()
        ]
        return unset + [
            f"caller {c.name}: token_env = {c.token_env!r}, but {c.token_env} is not set: "
            "no token is this caller's"
            for c in ([] if worker else self.callers)
            if not environ.get(c.token_env, "").strip()
        ]

    def shared_urls(self) -> list[str]:
        """Endpoints that take turns at one URL: one engine, which the core would count
        as two replicas (its slots and KV pool twice, its load split).  The processes
        warn at start and on a reload; an engine serving several models is one endpoint
        with them all in `models` (helper-113: it loaded without a word)."""
        by_url: dict[str, list[str]] = {}
        for e in self.endpoints:
            if e.generative:
                by_url.setdefault(f"{e.url.rstrip('/')}{e.api_path}", []).append(e.name)
        return [
            f"endpoints {', '.join(names)} have the same url {url.removesuffix('/v1')}: "
            "one engine counted as several replicas (its slots and KV pool each time); "
            "give it one endpoint with all its models"
            for url, names in by_url.items()
            if len(names) > 1
        ]

    def caller_tokens(
        self, environ: Mapping[str, str], operator: str | None = None
    ) -> dict[str, str]:
        """Each caller's token (from its `token_env`; unset ones are left out, as
        `unset_keys` says) -> its name.  Raises ConfigError for a value that is no
        bearer token, or a token two callers, or a caller and the operator (`operator`,
        the token the gateway takes; by default the file's), share."""
        operator = self.token if operator is None else operator
        tokens: dict[str, str] = {}
        for c in self.callers:
            value = environ.get(c.token_env, "")
            if not value.strip():
                continue
            try:
                token = bearer_token(value)
            except ValueError as exc:
                raise ConfigError(f"caller {c.name}: {c.token_env}: {exc}") from None
            if token == operator:
                raise ConfigError(
                    f"caller {c.name}: {c.token_env} holds the operator's token; a caller's "
                    "token must be its own"
                )
            if token in tokens:
                raise ConfigError(
                    f"callers {tokens[token]} and {c.name}: {c.token_env} holds the same "
                    "token as the other's; each caller's token must be its own"
                )
            tokens[token] = c.name
        return tokens

    @property
    def discovered(self) -> list[Endpoint]:
        """The endpoints with `discover`: each stands for the engines at its name's
        addresses."""
        return [e for e in self.endpoints if e.discover is not None]

    def expanded(self, engines: Mapping[str, Sequence[str]]) -> Config:
        """This configuration with each discovered endpoint replaced by one endpoint per
        engine its name resolved to (`engines`: "address:port"s by endpoint name; none:
        no engine), and each server with data-parallel ranks by one endpoint per rank
        (`<name>@<rank>`; a discovered one's engines each), in the file's order.  A
        discovered replica's name that an endpoint of the file has already is left out
        (the file's wins)."""
        if not self.discovered and all(e.dp_size == 1 for e in self.endpoints):
            return self
        given = {e.name for e in self.endpoints}
        endpoints: list[Endpoint] = []
        for e in self.endpoints:
            if e.discover is None:
                endpoints += e.ranks()
                continue
            for a in engines.get(e.name, ()):
                if (r := e.at(a)).name not in given:
                    endpoints += r.ranks()
        return self.model_copy(update={"endpoints": endpoints})

    def slots_of(self, e: Endpoint, reported: Mapping[str, int | None] | None = None) -> int | None:
        """The endpoint's slots: its `slots`, or for a router, the sum of its
        `load_from` engines' (it runs no more at once than they do) when each is known,
        given by the file or in `reported` (what the engines said; the prober asks)."""
        if e.slots is not None or not e.load_from:
            return e.slots
        by_name = {x.name: x for x in self.endpoints}
        each = [by_name[n].slots or (reported or {}).get(n) for n in e.load_from]
        return None if None in each else sum(n or 0 for n in each)

    def with_worker(self, given: Mapping[str, int], flags: Mapping[str, str]) -> Config:
        """This configuration with `[worker]` keys replaced by `given` (the worker's flags),
        checked together as the file's are: a ConfigError names the key, the flag it
        came from (`flags`: key -> flag) and what is accepted."""
        data = {**self.worker.model_dump(exclude_unset=True), **given}
        try:
            worker = WorkerOptions.model_validate(data)
        except ValidationError as exc:
            from_flags = {f"worker.{key}": flag for key, flag in flags.items()}
            said = "; ".join(
                _describe({**e, "loc": ("worker", *e["loc"])}, from_flags) for e in exc.errors()
            )
            raise ConfigError(said) from None
        return self.model_copy(update={"worker": worker})

    def replica_specs(self) -> list[ReplicaSpec]:
        """The replicas as the scheduler core sees them."""
        return [
            ReplicaSpec(
                name=e.name,
                models=frozenset(e.models),
                kv_tokens=e.kv_tokens,
                device=e.device,
                slots=self.slots_of(e),
            )
            for e in self.replicas
        ]


def bearer_token(value: str) -> str:
    """A configured bearer token, stripped (a secret file's trailing newline would
    otherwise lock every client out: a header value cannot carry it).  The error does
    not repeat the token."""
    token = value.strip()
    if not token or not all("!" <= ch <= "~" for ch in token):
        raise ValueError(
            "expected a bearer token: printable ASCII characters without spaces "
            f"({len(token)} characters given, not shown)"
        )
    return token


def parse_config(
    data: Mapping[str, Any],
    source: str = "configuration",
    from_env: Mapping[str, str] | None = None,
) -> Config:
    """Validate a parsed TOML document; errors name the field and the expectation (and
    the environment variable a value came from: `from_env`, field -> variable)."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        said = "; ".join(_describe(e, from_env or {}) for e in exc.errors())
        raise ConfigError(f"{source}: {said}") from None


# Environment variables a container sets instead of editing the file: (section, key).
ENV_OVERRIDES: Mapping[str, tuple[str | None, str]] = {
    "LUFTPAUSE_TEMPORAL_ADDRESS": ("temporal", "address"),
    "LUFTPAUSE_TEMPORAL_NAMESPACE": ("temporal", "namespace"),
    "LUFTPAUSE_TASK_QUEUE": ("temporal", "task_queue"),
    "LUFTPAUSE_GATEWAY_URL": (None, "gateway_url"),
    "LUFTPAUSE_TOKEN": (None, "token"),
}


DEFAULT_FILE = "luftpause.toml"  # a command's file without --config or LUFTPAUSE_CONFIG


def default_file_hint(path: str | Path) -> str:
    """What a command adds to its error when the file it looked for where it looks by
    default is not there: where that was, and how to name another (a new user's first
    `luftpause gateway` was told only that luftpause.toml could not be read)."""
    if str(path) != DEFAULT_FILE or Path(path).exists():
        return ""
    return (
        f"; no {DEFAULT_FILE} in {Path.cwd()}: a command reads --config FILE, else "
        f"$LUFTPAUSE_CONFIG, else ./{DEFAULT_FILE} (README.md, Configuration), and "
        "`luftpause up` runs everything with fake engines and a file of its own"
    )


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate `luftpause.toml`; the variables of ENV_OVERRIDES in `env`
    (when given) replace the file's values."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the configuration file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        message = f"{p}: not valid TOML: not UTF-8 at byte {exc.start}"
        raise ConfigError(message) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    except RecursionError:  # (tomllib's parser recurses into nested arrays and tables)
        raise ConfigError(f"{p}: not valid TOML here: nested too deeply") from None
    from_env: dict[str, str] = {}
    for var, (section, key) in ENV_OVERRIDES.items():
        value = (env or {}).get(var)
        if value:
            target = data if section is None else data.setdefault(section, {})
            if isinstance(target, dict):
                target[key] = value
                from_env[key if section is None else f"{section}.{key}"] = var
    return parse_config(data, str(p), from_env)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds: itself, or inside a list, an Optional or an Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _sections() -> dict[str, type[BaseModel]]:
    """The file's tables, by name: `[temporal]`, `[[endpoints]]`, ..."""
    found = {}
    for name, field in Config.model_fields.items():
        model = _model_of(field.annotation)
        if model is not None:
            found[name] = model
    return found


def _header(name: str) -> str:
    """A table's header as the file writes it: `[[endpoints]]` (an array), `[policy]`."""
    annotation = Config.model_fields[name].annotation
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return f"[[{name}]]" if get_origin(annotation) is list else f"[{name}]"


def _unknown_field(loc: Sequence[Any]) -> str:
    """What to say of a key the file's table has no field for: a near name it may have
    meant, or, for a key of another table or of the top level, that TOML puts a key in
    the table whose header comes last above it (a `gateway_url` written below
    `[[endpoints]]` is that endpoint's)."""
    *path, key = [part for part in loc if not isinstance(part, int)] or [""]
    sections = _sections()
    model = sections.get(path[0]) if len(path) == 1 else Config if not path else None
    if model is None or not isinstance(key, str):
        return "unknown field"
    if path and key in Config.model_fields and key not in sections:
        return (
            f"unknown field: {key} is a top-level key, and TOML puts a key written below a "
            f"{_header(path[0])} header into that table: write it above the first table"
        )
    elsewhere = [
        _header(name)
        for name, other in sections.items()
        if key in other.model_fields and name not in path
    ]
    if elsewhere:
        return f"unknown field: {key} is a key of {', '.join(elsewhere)}"
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    if close:
        return f"unknown field (did you mean {close[0]}?)"
    return "unknown field"


def _describe(error: Mapping[str, Any], from_env: Mapping[str, str]) -> str:
    loc = error.get("loc", ())
    where = ""
    for part in loc:
        where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
    msg = str(error.get("msg", "invalid"))
    msg = msg.removeprefix("Value error, ")
    if error.get("type") == "extra_forbidden":
        msg = _unknown_field(loc)
    if where in from_env:
        where += f" (from {from_env[where]})"
    return f"{where}: {msg}" if where else msg  # the whole file's checks name their fields
