"""The prober: the scheduler's eyes on the engines.

Every `[probes] period_s` (default `PROBE_PERIOD_S`) each endpoint's health path is
fetched, and for engines that report load, `/metrics` (SGLang, vLLM, llama.cpp gauge
names in `LOAD_METRICS`); a router's load is the sum over its healthy `load_from` engines
(unknown while one of them reports none: part of the sum would cap it too low).  Each
round becomes one `ReplicaProbed` event per generative endpoint for the core.  Both
fetches share one timeout (`timeout_s`).  A failed health check or a refused connection
marks the endpoint unhealthy at once; probes without an answer in time do so only when
`late_to_unhealthy` come in a row (a busy engine may answer one late).  An
engine that serves but shows no load gauges (SGLang without `--enable-metrics`,
llama.cpp without `--metrics`: `/metrics` answers 404, or lacks the names) is healthy
and reports no load, so it is never capped.  Either reason is kept
for `/status` and logged when it changes.

An engine whose KV pool size or slots (the requests it runs at once) the
configuration does not give is asked for them until it answers, at most `LIMIT_ASKS`
times: SGLang's `/server_info` (`max_total_num_tokens`; its scheduler's
`effective_max_running_requests_per_dp`), vLLM's `vllm:cache_config_info` gauge
(`num_gpu_blocks` x `block_size`; vLLM does not export `max_num_seqs`), llama.cpp's
`/props` (`total_slots`).  A router's slots are the sum of its `load_from` engines'
(each configured or reported): it runs no more at once than they do.  The core takes
the first pool size, which turns on program-level admission there, and the latest
slots, which bound the turns in flight there (a router is asked again when its engines
change).  Not knowing them is no error: the replica is admitted by load alone.

A server with data-parallel ranks (`dp_size`) is probed once per round for all its
ranks' replicas: its health is theirs, each rank's load is the samples of its rank's
label (SGLang's `dp_rank`, vLLM's `engine`), and each rank's KV pool is one rank's
(SGLang's `max_total_num_tokens`; vLLM's `cache_config_info` of that engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway._http import describe_http_error, no_answer_of
from luftpause.config import (
    DP_RANK_LABEL,
    KV_REPORTED_BY,
    LOAD_METRICS,
    SLOTS_REPORTED_BY,
    Config,
    Endpoint,
    Probes,
)
from scheduler import ReplicaProbed

__all__ = [
    "PROBE_PERIOD_S",
    "PROBE_TIMEOUT_S",
    "ProbeResult",
    "Prober",
    "auth_headers",
    "parse_load",
    "parse_rank_loads",
    "probe_endpoint",
    "probe_pool",
    "served_ranks",
    "slots_unknown",
]

log = logging.getLogger(__name__)

# The defaults of the file's [probes] (luftpause.config.Probes).
PROBE_PERIOD_S = Probes().period_s
PROBE_TIMEOUT_S = Probes().timeout_s
# How long an engine found only at the older of two routes is asked there first: then
# the newer is tried first again, once (an engine upgraded in place behind its URL keeps
# the older, deprecated, route and would log a warning at each ask; helper-193).
OLD_ROUTE_S = 300.0
# Per server URL: the route it last answered at, and since when (by _clock).
InfoRoutes = dict[str, tuple[str, float]]
_clock = time.monotonic
LIMIT_ASKS = 3  # healthy probes that may ask an engine its KV pool and slots before giving up
# Probes in a row without an answer in time that take a healthy engine out of rotation:
# a busy engine may answer one late.  A refusal or an error status counts at once.
LATE_PROBES_TO_UNHEALTHY = Probes().late_to_unhealthy


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeResult:
    endpoint: str
    healthy: bool
    queued: int | None = None  # None: the endpoint reports no load
    running: int | None = None
    # Why it is unhealthy, or (healthy) why its load is unknown.
    error: str | None = None
    kv_tokens: int | None = None  # the KV pool size the engine reported, when asked
    slots: int | None = None  # the requests it runs at once, as it reported, when asked
    timed_out: bool = False  # no answer within the probe's timeout (a router: from an engine)
    repeated: bool = False  # the last result, repeated for a late answer (see _forgive_late)
    # The /metrics answer, kept only while probe_ranks splits it over the ranks.
    exposition: str | None = None

    def event(self, now: float) -> ReplicaProbed:
        return ReplicaProbed(
            now=now,
            replica=self.endpoint,
            healthy=self.healthy,
            queued=self.queued,
            running=self.running,
            kv_tokens=self.kv_tokens,
            slots=self.slots,
            repeated=self.repeated,
        )


# Labels that tell apart the ranks of ONE model replica (tensor, pipeline and expert
# parallel ranks; SGLang's `engine_type`): the ranks that export hold the same requests.
_COPY_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "engine_type"})


def parse_load(kind: str, text: str) -> tuple[int, int] | None:
    """(queued, running) from a Prometheus exposition; None when the gauges are absent.

    Samples are summed over what holds disjoint requests: data-parallel ranks (SGLang's
    `dp_rank`, vLLM's `engine`) and models.  Copies of the same requests count once
    (their largest value): the ranks of one replica (`tp_rank`, `pp_rank`,
    `moe_ep_rank`; SGLang exports every TP rank with `--enable-metrics-for-all-
    schedulers`, and each attention context-parallel rank, all holding the same batch).
    SGLang with priority scheduling adds one sample per priority beside the total (the
    total has `priority=""`): those are skipped, or summed where no total is beside them."""
    loads = _loads(kind, text, None)
    return None if loads is None else loads[""]


def parse_rank_loads(kind: str, text: str) -> dict[int, tuple[int, int]] | None:
    """(queued, running) per data-parallel rank, by the label the kind tells them apart
    by (`DP_RANK_LABEL`), as `parse_load` counts them; None when the gauges are absent.
    Samples without the label (or with one that is no rank number) are left out."""
    label = DP_RANK_LABEL.get(kind)
    if label is None:
        return None
    loads = _loads(kind, text, label)
    if loads is None:
        return None
    return {
        int(rank): load
        for rank, load in loads.items()
        if rank.isascii() and rank.isdigit() and len(rank) < 10
    }


def _loads(kind: str, text: str, rank_label: str | None) -> dict[str, tuple[int, int]] | None:
    """`parse_load`'s counts, per value of `rank_label` (None: all under "")."""
    names = LOAD_METRICS.get(kind)
    if names is None:
        return None
    Key = tuple[str, tuple[tuple[str, str], ...]]
    totals: dict[Key, float] = {}  # (gauge, labels but rank copies) -> value
    by_priority: dict[Key, dict[str, float]] = {}  # ... -> priority -> value
    # Only the two gauges' lines go to the parser: an engine's whole exposition (vLLM's
    # histograms: ~90 KB) takes ~50 ms to parse here, on the event loop, every probe.
    wanted = "".join(line + "\n" for line in text.splitlines() if line.startswith(names))
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            if sample.name not in names:
                continue
            rest = sorted((k, v) for k, v in sample.labels.items() if k not in _COPY_LABELS)
            key = (sample.name, tuple(kv for kv in rest if kv[0] != "priority"))
            priority = sample.labels.get("priority")
            if priority:
                seen = by_priority.setdefault(key, {})
                seen[priority] = max(seen.get(priority, sample.value), sample.value)
            else:
                totals[key] = max(totals.get(key, sample.value), sample.value)
    for key, values in by_priority.items():
        totals.setdefault(key, sum(values.values()))  # no total beside them: their sum
    sums: dict[str, dict[str, float]] = {}  # rank -> gauge -> value
    for (name, labels), value in totals.items():
        rank = "" if rank_label is None else dict(labels).get(rank_label)
        if rank is None:
            continue
        by_name = sums.setdefault(rank, {})
        by_name[name] = by_name.get(name, 0.0) + value
    out = {}
    for rank, by_name in sums.items():
        if len(by_name) < 2:
            continue
        for name in names:
            if not math.isfinite(by_name[name]):  # the format allows +Inf and NaN
                raise ValueError(f"{name} is {by_name[name]}")
        out[rank] = (int(by_name[names[0]]), int(by_name[names[1]]))
    return out or None


def parse_vllm_kv_tokens(text: str) -> int | None:
    """vLLM's KV pool in tokens from `vllm:cache_config_info`'s labels (its
    CacheConfig): `num_gpu_blocks` x `block_size`, of all its engines (under data
    parallelism, as its load is summed)."""
    pools = parse_vllm_kv_pools(text)
    return None if pools is None else sum(pools.values()) or None


def parse_vllm_kv_pools(text: str) -> dict[str, int] | None:
    """vLLM's KV pool in tokens per engine (data-parallel rank; "" without the label).
    A vLLM that labels `kv_cache_size_tokens` says each engine's own pool there (its
    engine utils keep it "per-engine ... do not sum across DP"), hybrid models'
    included.  Else `num_gpu_blocks` x `block_size`: its API server sums its engines'
    blocks into one CacheConfig (vllm/v1/engine/utils.py: "Sum values from all engines
    in DP case") and exports that, the same sum, as every engine's sample, so each
    engine's pool is its share (helper-175: taken as its own, the pool read N times
    too large with N ranks).  (Such a vLLM under external load balancing sums every
    rank's engines at rank 0, which exports its own alone: give its `kv_tokens`.)"""
    pools: dict[str, int] = {}
    exact: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                engine = sample.labels.get("engine", "")
                with contextlib.suppress(KeyError, ValueError):
                    if (own := int(sample.labels["kv_cache_size_tokens"])) > 0:
                        exact[engine] = own
                try:
                    blocks = int(sample.labels["num_gpu_blocks"])
                    size = int(sample.labels["block_size"])
                except (KeyError, ValueError):
                    return None
                if blocks <= 0 or size <= 0:
                    return None
                pools[engine] = blocks * size
    if exact.keys() == pools.keys():
        return exact
    return {engine: pool // len(pools) for engine, pool in pools.items()}


def _count(value: object) -> int | None:
    """A positive count as JSON gives it, else None (a bool is no count)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def parse_sglang_slots(info: object, *, one_rank: bool = False) -> int | None:
    """The requests SGLang runs at once, from `/server_info`: its schedulers'
    `effective_max_running_requests_per_dp` (in `internal_states`, one per
    data-parallel rank), times `dp_size` (not with `one_rank`).  An older SGLang says
    only its `max_running_requests` argument, when one was given; without data
    parallelism its limit is that or lower (its request pool's size may be lower: the
    engine's queue then caps luftpause there, as on an engine that says nothing; with
    data parallelism, how the argument splits over the ranks depends on the version:
    unknown)."""
    if not isinstance(info, dict):
        return None
    ranks = _count(info.get("dp_size")) or 1
    states = info.get("internal_states")
    for state in states if isinstance(states, list) else []:
        if isinstance(state, dict):
            per_rank = _count(state.get("effective_max_running_requests_per_dp"))
            if per_rank is not None:
                return per_rank if one_rank else per_rank * ranks
    return _count(info.get("max_running_requests")) if ranks == 1 else None


def parse_llamacpp_slots(props: object) -> int | None:
    """llama.cpp's slots (`--parallel`), from `/props`'s `total_slots`."""
    return _count(props.get("total_slots")) if isinstance(props, dict) else None


def parse_sglang_kv_tokens(info: object, *, one_rank: bool = False) -> int | None:
    """SGLang's KV pool in tokens from `/server_info`: its scheduler's
    `max_total_num_tokens`, which is one data-parallel rank's, times `dp_size` (not
    with `one_rank`: a rank's replica)."""
    if not isinstance(info, dict):
        return None
    value = _count(info.get("max_total_num_tokens"))
    if value is None or one_rank:
        return value
    return value * (_count(info.get("dp_size")) or 1)


# How to turn on the load gauges, per engine kind.
_METRICS_HINT = {
    "sglang": "start SGLang with --enable-metrics",
    "llamacpp": "start llama-server with --metrics",
    "vllm": "vLLM serves them unless --disable-log-stats",
}


def auth_headers(
    endpoint: Endpoint, environ: Mapping[str, str] = os.environ, *, anthropic: bool = False
) -> dict[str, str]:
    """The endpoint's own key (never a client's), in the header its `api_key_header`
    names; by default `Authorization: Bearer $api_key_env`, and with `anthropic` (a
    Messages API request) in `x-api-key` too, where Anthropic-compatible hosts read it.
    Blanks around it are dropped (a key file's newline would be an illegal header)."""
    key = environ.get(endpoint.api_key_env, "").strip() if endpoint.api_key_env else ""
    if not key or not _sendable(key):
        return {}  # (one no header can carry is not sent: the probe says why)
    header = endpoint.api_key_header
    if header is None and _anthropic_host(endpoint.url):
        header = "x-api-key"
    if header == "x-api-key":
        return {"x-api-key": key}
    bearer = {"Authorization": f"Bearer {key}"}
    return bearer if header == "authorization" or not anthropic else {**bearer, "x-api-key": key}


def _sendable(key: str) -> bool:
    """Printable ASCII, as an HTTP header's value is (checked in C: on every turn)."""
    return key.isascii() and key.isprintable()


def key_problem(endpoint: Endpoint, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the endpoint's key cannot be sent, or None: a key is printable ASCII, as an
    HTTP header's value is (a pasted "…" or a control character made httpx raise at
    every request, and every probe round failed: helper-143).  Names the variable and
    the place, never the key."""
    if not endpoint.api_key_env:
        return None
    key = environ.get(endpoint.api_key_env, "").strip()
    if _sendable(key):
        return None
    bad = next(i for i, c in enumerate(key) if not _sendable(c))
    return (
        f"the key in ${endpoint.api_key_env} has a character an HTTP header cannot carry "
        f"(at position {bad + 1}); it is not sent"
    )


@functools.lru_cache(maxsize=256)
def _anthropic_host(url: str) -> bool:
    """api.anthropic.com and its kin: an API key goes in x-api-key only.  (Bounded: with
    DNS discovery every pod address ever seen is a URL.)"""
    host = (urlsplit(url).hostname or "").lower()
    return host == "anthropic.com" or host.endswith(".anthropic.com")


def _answered(response: httpx.Response) -> str:
    """`answered 503`, or why a status is no answer (a redirect: where it points)."""
    why = no_answer_of(response)
    return why or f"answered {response.status_code}"


async def probe_endpoint(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    *,
    timeout: float = PROBE_TIMEOUT_S,
    want_limits: bool = False,
    keep_exposition: bool = False,
    routes: InfoRoutes | None = None,
) -> ProbeResult:
    """Health, and load where the kind reports it (and the KV pool size and slots, when
    `want_limits`; the /metrics answer, with `keep_exposition`).  `routes`: where each
    SGLang server last answered its server info (`_sglang_server_info`).  Never raises."""
    if (why := key_problem(endpoint)) is not None:
        return ProbeResult(endpoint=endpoint.name, healthy=False, error=why)
    headers = auth_headers(endpoint)
    kv: int | None = None
    slots: int | None = None
    try:
        async with asyncio.timeout(timeout):
            health = await client.get(endpoint.url + endpoint.health, headers=headers)
            if health.status_code >= 300:
                # A redirect too: turns are posted to the endpoint's URL only, and one
                # that redirects them all (http -> https, a moved host) fails every turn.
                return ProbeResult(
                    endpoint=endpoint.name,
                    healthy=False,
                    error=f"{endpoint.health} {_answered(health)}",
                )
            if endpoint.kind not in LOAD_METRICS:
                return ProbeResult(endpoint=endpoint.name, healthy=True)
            metrics = await client.get(endpoint.url + "/metrics", headers=headers)
    except TimeoutError:
        return ProbeResult(
            endpoint=endpoint.name,
            healthy=False,
            error=f"no answer within {timeout:g} s",
            timed_out=True,
        )
    except httpx.HTTPError as exc:
        return ProbeResult(endpoint=endpoint.name, healthy=False, error=describe_http_error(exc))
    except Exception as exc:  # one endpoint's failure must not fail the round for all
        log.exception("probe of %s failed", endpoint.name)
        return ProbeResult(
            endpoint=endpoint.name, healthy=False, error=f"probe failed: {type(exc).__name__}"
        )
    load: tuple[int, int] | None = None
    note: str | None = None  # why the load is unknown
    q, r = LOAD_METRICS[endpoint.kind]
    if metrics.status_code in (404, 501) or 300 <= metrics.status_code < 400:
        note = f"reports no load: /metrics {_answered(metrics)}"
    elif metrics.status_code >= 400:
        return ProbeResult(
            endpoint=endpoint.name,
            healthy=False,
            error=f"/metrics answered {metrics.status_code}",
        )
    else:
        try:
            load = parse_load(endpoint.kind, metrics.text)
        except ValueError as exc:  # not the exposition format, or a value that is no count
            note = f"reports no load: /metrics: {exc}"
        except Exception as exc:  # whatever else the parser meets: the load is unknown
            note = f"reports no load: /metrics: {type(exc).__name__}: {exc}"
        else:
            if load is None:
                note = f"reports no load: /metrics lacks {q} and {r}"
    if note is not None:
        note += f" ({_METRICS_HINT[endpoint.kind]}); admitted uncapped"
    if want_limits and endpoint.kind == "vllm" and load is not None:  # a parsed exposition
        with contextlib.suppress(Exception):  # not knowing it is no reason to fail
            kv = parse_vllm_kv_tokens(metrics.text)
    elif want_limits and endpoint.kind == "sglang":
        # Apart from the health probe's time: a slow answer here (SGLang asks its
        # scheduler) must not make a healthy engine look unhealthy.
        info = await _sglang_server_info(client, endpoint, headers, timeout, routes)
        kv, slots = parse_sglang_kv_tokens(info), parse_sglang_slots(info)
    elif want_limits and endpoint.kind == "llamacpp":
        slots = parse_llamacpp_slots(await _get_json(client, endpoint, "/props", headers, timeout))
    return ProbeResult(
        endpoint=endpoint.name,
        healthy=True,
        queued=load[0] if load else None,
        running=load[1] if load else None,
        error=note,
        kv_tokens=kv,
        slots=slots,
        exposition=metrics.text if keep_exposition and metrics.status_code < 300 else None,
    )


async def _get_json(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    path: str,
    headers: dict[str, str],
    timeout: float,
    *,
    before: str | None = None,
    routes: InfoRoutes | None = None,
) -> object:
    """The engine's JSON answer at `path`, or None: not knowing what it says there is
    no reason to call the engine unhealthy.  `before`: the path an older engine has
    it at, asked when `path` is not found (404), within the same timeout.  `routes`:
    where each server (by URL) last answered: one found only at `before` is asked there
    first for OLD_ROUTE_S, then at `path` first again; the other is still asked when
    the first is not found (an engine changed in place)."""
    paths = [path] if before is None else [path, before]
    now = _clock()
    known = routes.get(endpoint.url) if routes is not None else None
    if known is not None and known[0] == before and now - known[1] < OLD_ROUTE_S:
        paths.reverse()
    try:
        async with asyncio.timeout(timeout):
            for asked in paths:
                answer = await client.get(endpoint.url + asked, headers=headers)
                if answer.status_code != 404:
                    # Since when it answers there: kept while the older route is
                    # asked first and answers (its time runs out then).
                    if routes is not None and (
                        known is None or known[0] != asked or paths[0] == path
                    ):
                        routes[endpoint.url] = (asked, now)
                    break
        return answer.json() if answer.status_code == 200 else None
    except Exception:  # (a RecursionError from JSON nested too deeply, too: helper-145)
        return None


async def _sglang_server_info(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    headers: dict[str, str],
    timeout: float,
    routes: InfoRoutes | None = None,
) -> object:
    """SGLang's `/server_info` (its server arguments and scheduler's), or None.  An
    SGLang from before that route (404) is asked at `/get_server_info`, which later
    ones deprecate: each call logs a warning there, every round with data-parallel
    ranks (helper-175), and the route is to go (sglang-router asks in this order too).
    With `routes` (the prober's, kept across rounds), a server is asked first where it
    last answered: an old one is not asked (and does not log) a 404 every round."""
    return await _get_json(
        client,
        endpoint,
        "/server_info",
        headers,
        timeout,
        before="/get_server_info",
        routes=routes,
    )


def served_ranks(kind: str, info: object, loads: Mapping[int, object]) -> int | None:
    """How many data-parallel ranks the server says it has, None when it does not say:
    SGLang's `dp_size` in `/server_info`; vLLM's highest `engine` label in /metrics
    (plus one; a server that labels none says nothing)."""
    if kind == "sglang" and isinstance(info, dict):
        return _count(info.get("dp_size"))
    if kind == "vllm" and loads:
        return max(loads) + 1
    return None


async def probe_ranks(
    client: httpx.AsyncClient,
    ranks: Sequence[Endpoint],
    *,
    timeout: float = PROBE_TIMEOUT_S,
    want_limits: bool = False,
    routes: InfoRoutes | None = None,
) -> list[ProbeResult]:
    """One probe of a server with data-parallel ranks, a result per rank's replica:
    the server's health, each rank's load from its rank's samples, each rank's KV pool
    and slots (when `want_limits`).  A rank the exposition shows no load for reports
    none (uncapped).  `routes`: as probe_endpoint's.  Never raises."""
    server = ranks[0]
    probed = probe_endpoint(client, server, timeout=timeout, keep_exposition=True)
    info: object = None
    if server.kind == "sglang":  # every round, beside the probe: its dp_size tells
        # which ranks exist (and, when wanted, one rank's KV pool and slots)
        asked = _sglang_server_info(client, server, auth_headers(server), timeout, routes)
        whole, info = await asyncio.gather(probed, asked)
    else:
        whole = await probed
    if not whole.healthy:
        return [replace(whole, endpoint=e.name) for e in ranks]
    label = DP_RANK_LABEL[server.kind]
    loads: dict[int, tuple[int, int]] = {}
    note = whole.error  # why the server's load is unknown, if it is
    if whole.exposition is not None and note is None:
        try:
            loads = parse_rank_loads(server.kind, whole.exposition) or {}
        except Exception as exc:  # the whole parsed; a rank's value that is no count
            note = f"reports no load: /metrics: {exc}"
    pools: Mapping[str, int] = {}
    one_pool: int | None = None
    one_rank_slots: int | None = None
    if want_limits and server.kind == "vllm" and whole.exposition is not None:
        with contextlib.suppress(Exception):
            pools = parse_vllm_kv_pools(whole.exposition) or {}
    elif want_limits and server.kind == "sglang":
        one_pool = parse_sglang_kv_tokens(info, one_rank=True)
        one_rank_slots = parse_sglang_slots(info, one_rank=True)
    served = served_ranks(server.kind, info, loads)
    out = []
    for e in ranks:
        assert e.dp_rank is not None
        if served is not None and e.dp_rank >= served:
            # The engine would answer every turn sent to it 400 (an answer, not an
            # engine fault, so nothing would eject it): no turn goes there.
            why = (
                f"the server has {served} data-parallel rank{'s' * (served > 1)}, not "
                f"rank {e.dp_rank}: set dp_size = {served} for {server.server}"
            )
            out.append(ProbeResult(endpoint=e.name, healthy=False, error=why))
            continue
        load = loads.get(e.dp_rank)
        error = note
        if load is None and note is None:
            error = (
                f"reports no load for rank {e.dp_rank}: /metrics has no samples labelled "
                f'{label}="{e.dp_rank}"; admitted uncapped'
            )
        out.append(
            ProbeResult(
                endpoint=e.name,
                healthy=True,
                queued=load[0] if load else None,
                running=load[1] if load else None,
                error=error,
                kv_tokens=pools.get(str(e.dp_rank), one_pool),
                slots=one_rank_slots,
            )
        )
    return out


async def probe_pool(
    client: httpx.AsyncClient,
    config: Config,
    *,
    want_limits: frozenset[str] = frozenset(),
    timeout: float = PROBE_TIMEOUT_S,
    routes: InfoRoutes | None = None,
) -> list[ProbeResult]:
    """One round over every endpoint, concurrently (a server once for all its ranks);
    routers get their engines' load.  Endpoints named in `want_limits` are also asked
    their KV pool size and slots.  `routes`: where each SGLang server last answered its
    server info, kept across rounds by the caller; a server down is forgotten there (it
    may come back another version)."""
    servers: dict[str, list[Endpoint]] = {}  # a server's name -> its ranks' replicas
    for e in config.endpoints:
        servers.setdefault(e.server, []).append(e)

    # A router's slots are its engines' sum: those that report theirs are asked too.
    by_name = {e.name: e for e in config.endpoints}
    asked = set(want_limits)
    for name in want_limits:
        if (router := by_name.get(name)) is not None and router.load_from:
            asked.update(n for n in router.load_from if _wanted(config, by_name[n])[1])

    async def probe(ranks: list[Endpoint]) -> list[ProbeResult]:
        wanted = any(e.name in asked for e in ranks)
        try:
            if ranks[0].dp_rank is None:
                results = [
                    await probe_endpoint(
                        client, ranks[0], timeout=timeout, want_limits=wanted, routes=routes
                    )
                ]
            else:
                results = await probe_ranks(
                    client, ranks, timeout=timeout, want_limits=wanted, routes=routes
                )
        except Exception as exc:  # one server's failure must not fail the round for all
            log.exception("probe of %s failed", ranks[0].server)
            why = f"probe failed: {type(exc).__name__}"
            results = [ProbeResult(endpoint=e.name, healthy=False, error=why) for e in ranks]
        if routes is not None and not any(r.healthy for r in results):
            # Down (restarting, perhaps upgraded): asked /server_info first again.  An
            # upgraded SGLang keeps the deprecated route, and would log a warning at
            # every ask there for as long as it was remembered.
            routes.pop(ranks[0].url, None)
        return results

    rounds = await asyncio.gather(*(probe(ranks) for ranks in servers.values()))
    result_of = {r.endpoint: r for results in rounds for r in results}
    results = [result_of[e.name] for e in config.endpoints]
    out = []
    for e, r in zip(config.endpoints, results, strict=True):
        if e.kind == "router" and r.healthy and e.load_from:
            # The engines it can place turns on: a router drops an unhealthy one as
            # luftpause does.  One of them whose load is unknown makes the sum
            # unknown: a part of it would cap the router at part of what it runs.
            behind = [result_of[n] for n in e.load_from]
            engines = [x for x in behind if x.healthy]
            silent = [x.endpoint for x in engines if x.queued is None or x.running is None]
            late = [x.endpoint for x in behind if x.timed_out]
            if silent:
                r = ProbeResult(
                    endpoint=e.name,
                    healthy=True,
                    error=f"load unknown: no load from {', '.join(silent)} (load_from)",
                )
            elif engines:  # every one of them reported its load
                r = ProbeResult(
                    endpoint=e.name,
                    healthy=True,
                    queued=sum(x.queued or 0 for x in engines),
                    running=sum(x.running or 0 for x in engines),
                )
            if late:
                # An engine that answered late stays in rotation for a while with its
                # last load (`Prober._forgive_late`), and so does the router, with its
                # last reading: not the sum without that engine's part.
                r = replace(
                    r,
                    timed_out=True,
                    error=f"no answer in time from {', '.join(late)} (load_from)",
                )
            if e.name in want_limits:  # its slots: the sum, once each engine's is known
                said = {n: result_of[n].slots for n in e.load_from}
                r = replace(r, slots=config.slots_of(e, said))
        out.append(r)
    return out


def _wanted(config: Config, e: Endpoint) -> tuple[bool, bool]:
    """Whether its engine is asked its KV pool, and its slots: not configured, and its
    kind reports it (a router's slots: each of its engines' is configured or reported)."""
    if e.kind == "router":
        if not e.load_from or config.slots_of(e) is not None:
            return False, False
        engines = [x for x in config.endpoints if x.name in e.load_from]
        return False, all(x.slots is not None or x.kind in SLOTS_REPORTED_BY for x in engines)
    return (
        e.kv_tokens is None and e.kind in KV_REPORTED_BY,
        e.slots is None and e.kind in SLOTS_REPORTED_BY,
    )


def _asks_limits(config: Config, e: Endpoint) -> bool:
    return any(_wanted(config, e))


def _limits_basis(config: Config, e: Endpoint) -> tuple[object, ...]:
    """What an endpoint's KV pool and slots follow from: its own, and a router's
    engines' (an engine added behind a router changes the router's slots)."""
    engines = {x.name: x for x in config.endpoints}
    behind = [(n, engines[n].kind, engines[n].slots) for n in e.load_from if n in engines]
    return e.kv_tokens, e.slots, tuple(behind)


def _limits_changed(old: Config, new: Config) -> frozenset[str]:
    """The endpoints in both whose KV pool and slots follow from something else in `new`
    (`_limits_basis`): what a round begun under `old` read for them no longer holds,
    they are asked again, and the core forgets slots nothing gives now (the one rule
    behind `probe_once`, `Prober.reconfigure` and `slots_unknown`)."""
    if old is new:
        return frozenset()
    before = {e.name: _limits_basis(old, e) for e in old.endpoints}
    return frozenset(
        e.name
        for e in new.endpoints
        if e.name in before and before[e.name] != _limits_basis(new, e)
    )


def slots_unknown(old: Config, new: Config) -> frozenset[str]:
    """The replicas of `new` whose slots nothing gives or reports any more, where what
    they follow from changed since `old` (PoolChanged.slots_unknown): a router whose
    engines changed and whose sum cannot be known (an engine that does not say its
    own, vLLM, without `slots`), an engine of such a kind whose `slots` the file took
    out.  A reported number would otherwise stand for what is no longer there."""
    changed = _limits_changed(old, new)
    return frozenset(
        e.name
        for e in new.replicas
        if e.name in changed and new.slots_of(e) is None and not _wanted(new, e)[1]
    )


def _unsaid(config: Config, name: str) -> tuple[str, str, str]:
    """What an endpoint was asked and did not say, for the warning: its KV pool
    (program-level admission is off there), its slots, or both."""
    e = next((e for e in config.endpoints if e.name == name), None)
    kv, slots = (True, True) if e is None else _wanted(config, e)
    if e is not None and e.load_from:
        engines = ", ".join(e.load_from)
        return f"slots (its engines' sum: {engines})", f"slots on it or on {engines}", "them"
    if kv and slots:
        return "KV pool or slots", "kv_tokens and slots", "them"
    if kv:
        return "KV pool (program-level admission is off there)", "kv_tokens", "it"
    return "slots", "slots", "them"


def _retry_after(period: float) -> str:
    """The `Retry-After` of a turn refused for want of a healthy replica: the next
    probe round."""
    return str(math.ceil(period))


class Prober:
    """Probes the pool every period and hands each round to `report`."""

    def __init__(
        self,
        config: Config,
        client: httpx.AsyncClient,
        report: Callable[[list[ProbeResult]], Awaitable[None] | None],
        *,
        period: float | None = None,
    ) -> None:
        self._config = config
        self._client = client
        self._report = report
        # The file's [probes] (a test may pass a shorter period, which reloads keep).
        self._period_given = period
        self._period = period if period is not None else config.probes.period_s
        self.retry_after = _retry_after(self._period)
        self._timeout = config.probes.timeout_s
        self._late_limit = config.probes.late_to_unhealthy
        self._task: asyncio.Task[None] | None = None
        # Set by a reload that changes the period: the loop's wait restarts with it.
        self._rescheduled = asyncio.Event()
        self.last: dict[str, ProbeResult] = {}
        # Replicas whose KV pool or slots the file does not give, where their kind
        # reports them: asked until they answer, at most LIMIT_ASKS times while healthy
        # (an engine that does not report them is not asked for ever: each ask can take
        # a probe's time).
        self._want_limits = {e.name: 0 for e in config.replicas if _asks_limits(config, e)}
        self._late: dict[str, int] = {}  # probes in a row that timed out, per endpoint
        # Rounds overlap (a reload's or a discovery change's beside the periodic one):
        # when the last late probe counted ended, and when the round that last
        # reported began, per endpoint.
        self._late_until: dict[str, float] = {}
        self._read_from: dict[str, float] = {}
        # Where each SGLang server (by URL) last answered its server info: an SGLang
        # from before /server_info is asked /get_server_info first (probe_pool).
        self._info_routes: InfoRoutes = {}

    def reconfigure(self, config: Config) -> None:
        """Probe the endpoints of a reloaded file, with its `[probes]`, from the next
        round on.  An endpoint new in it is asked its KV pool and slots when the file
        gives none, and so is one whose `kv_tokens` or `slots` the file no longer gives,
        or a router whose engines changed (their sum is its slots); the last results of
        endpoints gone from it are dropped.  A round under way reports only endpoints
        still in the file."""
        old = self._config
        known = {e.name for e in old.endpoints}
        changed = _limits_changed(old, config)
        self._config = config
        if self._period_given is None and config.probes.period_s != self._period:
            # From now: a wait of the old period (up to 300 s) kept a dead engine in
            # rotation that long, while Retry-After already named the new one
            # (helper-143).  The reload probes at once; the next round is a period on.
            self._period = config.probes.period_s
            self.retry_after = _retry_after(self._period)
            self._rescheduled.set()
        self._timeout = config.probes.timeout_s
        self._late_limit = config.probes.late_to_unhealthy
        names = {e.name for e in config.endpoints}
        for seen in (self.last, self._late, self._want_limits, self._late_until, self._read_from):
            for name in [n for n in seen if n not in names]:
                del seen[name]
        for e in config.replicas:
            if _asks_limits(config, e) and (e.name not in known or e.name in changed):
                self._want_limits[e.name] = 0
        self._forget_routes()

    def _forget_routes(self) -> None:
        """Forget where servers no longer in the file answered their server info."""
        urls = {e.url for e in self._config.endpoints}
        for url in [u for u in self._info_routes if u not in urls]:
            del self._info_routes[url]

    async def probe_once(self) -> list[ProbeResult]:
        config = self._config
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await probe_pool(
            self._client,
            config,
            want_limits=frozenset(self._want_limits),
            timeout=self._timeout,
            routes=self._info_routes,
        )
        ended = loop.time()
        # (A reload while the round was under way: its servers' routes are not kept.)
        self._forget_routes()
        # Endpoints a reload removed while the round was under way are not reported,
        # and neither are limits read for what the reload changed: a router's sum over
        # its old engines, an engine's slots the file now gives or no longer does.  Nor
        # is an endpoint a round begun later has reported already: its reading is newer.
        stale = _limits_changed(config, self._config)
        current = {e.name for e in self._config.endpoints}
        results = [
            self._forgive_late(
                replace(r, kv_tokens=None, slots=None) if r.endpoint in stale else r,
                started,
                ended,
            )
            for r in results
            if r.endpoint in current and started >= self._read_from.get(r.endpoint, -math.inf)
        ]
        for r in results:
            self._read_from[r.endpoint] = started
        # Engines that answered this round (not down, not late and forgiven).
        answered = {r.endpoint for r in results if r.healthy and not r.timed_out and not r.repeated}
        for r in results:
            if r.endpoint in self._want_limits and r.healthy and r.endpoint not in stale:
                # One answer says all the engine reports (one call per kind).
                if r.kv_tokens is not None or r.slots is not None:
                    del self._want_limits[r.endpoint]
                    if r.kv_tokens is not None:
                        log.info(
                            "endpoint %s reports a KV pool of %d tokens", r.endpoint, r.kv_tokens
                        )
                    if r.slots is not None:
                        log.info("endpoint %s runs %d requests at once", r.endpoint, r.slots)
                elif not answered.issuperset(self._behind(r.endpoint)):
                    pass  # a router's engine could not say this round: no ask spent
                elif (asks := self._want_limits[r.endpoint] + 1) >= LIMIT_ASKS:
                    del self._want_limits[r.endpoint]
                    log.warning(
                        "endpoint %s did not say its %s: set %s to give %s (%d asks)",
                        r.endpoint,
                        *_unsaid(self._config, r.endpoint),
                        asks,
                    )
                else:
                    self._want_limits[r.endpoint] = asks
            before = self.last.get(r.endpoint)
            # Healthy until a probe says otherwise, as the core counts it: an endpoint
            # unhealthy from its first probe is said too (a wrong port or health_path
            # was silent, its reason only on /status: helper-127).
            if r.healthy != (before.healthy if before is not None else True):
                log.warning(
                    "endpoint %s is now %s%s",
                    r.endpoint,
                    "healthy" if r.healthy else "unhealthy",
                    f": {r.error}" if r.error else "",
                )
            elif r.healthy and r.error and (before is None or before.error != r.error):
                log.warning("endpoint %s %s", r.endpoint, r.error)
            self.last[r.endpoint] = r
        outcome = self._report(results)
        if outcome is not None:
            await outcome
        return results

    def _behind(self, name: str) -> list[str]:
        """A router's `load_from` engines (none for any other endpoint)."""
        e = next((e for e in self._config.endpoints if e.name == name), None)
        return e.load_from if e is not None else []

    def _forgive_late(
        self, r: ProbeResult, started: float = math.inf, ended: float = math.inf
    ) -> ProbeResult:
        """A healthy engine's first late answer keeps it healthy (with its last load);
        LATE_PROBES_TO_UNHEALTHY in a row take it out.  A late probe of a round begun
        before the last one counted ended (`started`, `ended`: its round's) waited
        through the same slow moment: it does not count again."""
        name = r.endpoint
        if not r.timed_out:
            self._late.pop(name, None)
            self._late_until.pop(name, None)
            return r
        if started < self._late_until.get(name, -math.inf):
            late = self._late.get(name, 1)
        else:
            late = self._late[name] = self._late.get(name, 0) + 1
            self._late_until[name] = ended
        before = self.last.get(name)
        if before is None or not before.healthy or late >= self._late_limit:
            return r
        return replace(
            before,
            error=f"{r.error} once; still in rotation",
            kv_tokens=None,
            slots=None,
            repeated=True,
        )

    @property
    def period(self) -> float:
        return self._period

    async def next_round(self) -> None:
        """One round, for a loop that must outlive whatever goes wrong in it: a round
        that fails is logged, and the next one comes at its time.  (A loop that died
        here would leave every replica as its last probe saw it: a dead engine in
        rotation, a recovered one out of it.)"""
        try:
            await self.probe_once()
        except Exception:
            log.exception("probe round failed; the next one comes in %g s", self._period)

    async def _loop(self) -> None:
        """A round every period, after the one the caller made (the gateway serves only
        once it has a first view of the pool)."""
        loop = asyncio.get_running_loop()
        next_round = loop.time() + self._period
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(next_round):
                    await self._rescheduled.wait()
            next_round = loop.time() + self._period
            if self._rescheduled.is_set():  # a reload changed the period, and probed
                self._rescheduled.clear()
                continue
            await self.next_round()

    def start(self) -> None:
        """Probe in the background, every period from now."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="prober")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
