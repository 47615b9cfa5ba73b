"""Engines found by name: endpoints with `discover = "dns"` or `"dns-srv"`.

Such an endpoint stands for every engine its url's host name resolves to: the pods of a
Kubernetes headless Service (their DNS lists the ready pods), a Compose service scaled
to N, a Consul service; with `discover = "dns-srv"`, the targets and ports of the
name's SRV records (Consul and Nomad services on dynamic ports).  Each engine is a
replica of its own, `<name>-<address>:<port>` (`Config.expanded`), so a pod that
restarts with a new address is a new replica: its cache holds none of the runs bound
to the old one.

The gateway resolves the names at start, on every reload, and every
`[discovery] period_s`; when the addresses changed, it serves the pool they make as a
reload would (rule 11): a new address takes turns once a probe finds it healthy, one
that left finishes its turns and its runs move at their next turn.

What an answer means:
- Addresses: the endpoint's engines are those.
- No address (the name does not exist, or has no A/AAAA record: a Service with no
  ready pod): it has no engine.  Its replicas are retired, and turns for a model only
  it serves are answered 503 with Retry-After until an engine appears (`awaiting`),
  not 404: the model is configured, its engines are not up.
- No answer (a timeout, a server failure): the last answer stands, and the error is
  logged and shown on /status.  An endpoint never resolved has no engine meanwhile.

The SGLang router and vllm-router find pods through the Kubernetes API (a label
selector, and a Role to list and watch pods); DNS needs no Role and works outside
Kubernetes too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from luftpause.config import Discovery, Endpoint, nameserver_address

__all__ = ["Found", "Resolver"]

log = logging.getLogger("luftpause.gateway")

# getaddrinfo's answers that mean "no such name / no address", not "could not ask".
_NO_NAME = frozenset(
    code
    for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None))
    if code is not None
)

_Ip = ipaddress.IPv4Address | ipaddress.IPv6Address


class _NoAnswer(Exception):
    """The resolver could not be asked or did not answer: the last answer stands."""


@dataclass(frozen=True, slots=True)
class _Answer:
    engines: tuple[str, ...]  # "address:port", sorted
    targets: Mapping[str, tuple[str, ...]]  # dns-srv: each target's addresses
    partial: str | None  # dns-srv: targets not answered (their last addresses kept)


@dataclass(frozen=True, slots=True)
class Found:
    """What a discovered endpoint's name resolved to."""

    host: str  # the name asked
    engines: tuple[str, ...]  # "address:port" of its engines now, sorted
    resolved_at: float | None  # wall time of the last answer (None: never answered)
    error: str | None = None  # why the last attempt had no answer (then: the last answer's)
    asked: str = ""  # what was asked (how, name, port): a last answer is kept for the same
    # dns-srv: each target's addresses, for a target that gets no answer next time
    targets: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # The last answer had engines and this round's none: kept until the next says so too
    emptied: bool = False

    def as_json(self, now: float) -> dict[str, object]:
        """For /status: `answered_s_ago` is None until a first answer."""
        ago = None if self.resolved_at is None else round(max(0.0, now - self.resolved_at), 1)
        return {
            "host": self.host,
            "engines": list(self.engines),
            "answered_s_ago": ago,
            "error": self.error,
        }


class Resolver:
    """Resolves discovered endpoints' names (one per gateway).

    A system lookup runs in a thread that a timeout cannot stop (getaddrinfo blocks):
    while one for a name is still under way, the next round waits on it again instead
    of starting another, so a resolver that hangs holds one thread per name, not one
    more every period."""

    def __init__(self) -> None:
        self._lookups: dict[str, asyncio.Future[list[str]]] = {}

    async def resolve_all(
        self, endpoints: Sequence[Endpoint], section: Discovery, before: Mapping[str, Found]
    ) -> dict[str, Found]:
        """Resolve each endpoint's name at once (`section`'s resolver, timeout and
        family).  An endpoint whose name could not be resolved keeps what `before` found
        for the same name."""
        asked = {e.name: f"{e.discover} {e.host}:{e.port}" for e in endpoints}
        lasts = {
            e.name: last
            for e in endpoints
            if (last := before.get(e.name)) is not None and last.asked == asked[e.name]
        }
        results = await asyncio.gather(
            *(self._resolve(e, section, lasts.get(e.name)) for e in endpoints)
        )
        now = time.time()
        found: dict[str, Found] = {}
        for e, result in zip(endpoints, results, strict=True):
            last = lasts.get(e.name)
            if (
                isinstance(result, _Answer)
                and not result.engines
                and last is not None
                and last.engines
                and not last.emptied
            ):
                # Engines that all vanish at once are believed at the second answer that
                # says so: glibc answers "no such name" when the query for the name itself
                # timed out and a search domain's said NXDOMAIN.
                why = f"{e.host}: resolved to no engine; the last answer stands until the next"
                found[e.name] = dataclasses.replace(last, error=why, emptied=True)
                log.warning("discovery of endpoint %s: %s", e.name, why)
                continue
            if isinstance(result, _Answer):
                found[e.name] = Found(
                    e.host, result.engines, now, result.partial, asked[e.name], result.targets
                )
                if result.partial is not None and (last is None or last.error != result.partial):
                    log.warning("discovery of endpoint %s: %s", e.name, result.partial)
                continue
            if last is not None:
                found[e.name] = dataclasses.replace(last, error=result)
            else:
                found[e.name] = Found(e.host, (), None, result, asked[e.name])
            if last is None or last.error != result:  # once per failure, not every period
                log.warning("discovery of endpoint %s: %s", e.name, result)
        return found

    async def _resolve(self, e: Endpoint, section: Discovery, last: Found | None) -> _Answer | str:
        """The endpoint's engines (none: it has none), or why its name was not
        answered."""
        host = e.host
        targets: dict[str, tuple[str, ...]] = {}
        partial = None
        try:
            async with asyncio.timeout(section.timeout_s):
                if e.discover == "dns-srv":
                    engines, targets, partial = await _srv(
                        host, section, last.targets if last is not None else {}
                    )
                else:
                    if section.nameservers:
                        addresses = await _records(_resolver(section), host, section)
                    else:
                        addresses = await self._system(host)
                    engines = [(ip, e.port) for ip in _family(addresses, section.family)]
        except TimeoutError:
            return f"{host}: no answer within {section.timeout_s:g} s; the last answer stands"
        except _NoAnswer as exc:
            return f"{host}: {exc}; the last answer stands"
        except Exception as exc:  # one odd name must not stop the others (or the start)
            return f"{host}: {type(exc).__name__}: {exc}; the last answer stands"
        netlocs = tuple(_netloc(ip, port) for ip, port in sorted(set(engines), key=_order))
        return _Answer(netlocs, targets, partial)

    async def _system(self, host: str) -> list[str]:
        """getaddrinfo: /etc/hosts, resolv.conf and its search domains, as any client."""
        lookup = self._lookups.get(host)
        if lookup is None or lookup.done():
            lookup = asyncio.ensure_future(_getaddrinfo(host))
            # Read its failure even when no round waits for it any more (timed out).
            lookup.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._lookups[host] = lookup
        return await asyncio.shield(lookup)


def _family(addresses: Sequence[str], family: str) -> list[_Ip]:
    """The addresses that are engines (`[discovery] family`)."""
    ips = {ipaddress.ip_address(a) for a in addresses if "%" not in a}  # no scoped link-local
    v4: list[_Ip] = [ip for ip in ips if ip.version == 4]
    v6: list[_Ip] = [ip for ip in ips if ip.version == 6]
    if family == "v4_only" or (family == "v4_preferred" and v4):
        return v4
    if family in ("v6_only", "v4_preferred"):
        return v6
    return v4 + v6


def _order(engine: tuple[_Ip, int]) -> tuple[int, int, int]:
    ip, port = engine
    return ip.version, int(ip), port  # IPv4 first, each in numeric order


def _netloc(ip: _Ip, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


async def _getaddrinfo(host: str) -> list[str]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_NAME:
            return []
        raise _NoAnswer(f"the system resolver failed: {exc.strerror or exc}") from None
    return [str(info[4][0]) for info in infos]


def _resolver(section: Discovery) -> dns.asyncresolver.Resolver:
    """dnspython's resolver: the configured nameservers, else the system's resolv.conf
    (its search domains too)."""
    if section.nameservers:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [
            dns.nameserver.Do53Nameserver(*nameserver_address(s)) for s in section.nameservers
        ]
    else:
        try:
            resolver = dns.asyncresolver.Resolver()
        except dns.exception.DNSException as exc:  # no /etc/resolv.conf
            raise _NoAnswer(f"no resolver configuration: {exc}") from None
        resolver.use_search_by_default = True
    resolver.lifetime = section.timeout_s
    # Each server its share of the time: one that does not answer must leave time to
    # ask the next (dnspython's per-server timeout is 2 s, the whole default lifetime).
    resolver.timeout = section.timeout_s / max(1, len(resolver.nameservers))
    return resolver


def _asked(section: Discovery) -> str:
    return ", ".join(section.nameservers) or "the resolv.conf nameservers"


async def _records(
    resolver: dns.asyncresolver.Resolver, host: str, section: Discovery
) -> list[str]:
    """The A and AAAA records of a name."""

    async def of(rdtype: str) -> list[str]:
        try:
            answer = await resolver.resolve(host, rdtype)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:  # timeouts, SERVFAIL, refused
            raise _NoAnswer(f"{_asked(section)}: {host} {rdtype}: {exc}") from None
        return [r.address for r in answer]

    wanted = {"v4_only": ("A",), "v6_only": ("AAAA",)}.get(section.family, ("A", "AAAA"))
    found = await asyncio.gather(*(of(rdtype) for rdtype in wanted), return_exceptions=True)
    answered = {t: a for t, a in zip(wanted, found, strict=True) if isinstance(a, list)}
    if section.family == "v4_preferred" and answered.get("A"):
        return answered["A"]  # these are the engines whatever AAAA says (or fails to)
    for failure in found:
        if isinstance(failure, BaseException):
            raise failure
    return [address for addresses in answered.values() for address in addresses]


async def _srv(
    host: str, section: Discovery, last: Mapping[str, tuple[str, ...]]
) -> tuple[list[tuple[_Ip, int]], dict[str, tuple[str, ...]], str | None]:
    """The engines of an SRV name: its records of the lowest priority (the others are
    fallbacks, RFC 2782), each target's addresses on the record's port; each target's
    addresses; and which targets got no answer (their addresses in `last` stand in)."""
    resolver = _resolver(section)
    try:
        answer = await resolver.resolve(host, "SRV")
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return [], {}, None
    except dns.exception.DNSException as exc:
        raise _NoAnswer(f"{_asked(section)}: {exc}") from None
    records = list(answer)
    if not records:
        return [], {}, None
    first = min(r.priority for r in records)
    # A target "." says the service is not there; port 0 is no port.
    chosen = [r for r in records if r.priority == first and str(r.target) != "." and r.port]
    names = sorted({r.target.to_text() for r in chosen})
    results = await asyncio.gather(
        *(_records(resolver, t, section) for t in names), return_exceptions=True
    )
    targets: dict[str, tuple[str, ...]] = {}
    missed = []
    for name, result in zip(names, results, strict=True):
        if isinstance(result, _NoAnswer):  # this target's engines as last answered
            targets[name] = last.get(name, ())
            kept = "its last addresses kept" if name in last else "none known"
            missed.append(f"target {name}: {result} ({kept})")
        elif isinstance(result, BaseException):
            raise result
        else:
            targets[name] = tuple(result)
    engines = [
        (ip, int(r.port))
        for r in chosen
        for ip in _family(targets[r.target.to_text()], section.family)
    ]
    return engines, targets, "; ".join(missed) or None
