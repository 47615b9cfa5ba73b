"""A DNS server over loopback UDP whose answers a test sets: the stand-in for a
Kubernetes cluster's CoreDNS (a headless Service's ready pods) or Consul's DNS, for
`discover = "dns"` with `[discovery] nameservers`.

It speaks the protocol (dnspython builds and parses the messages): A and AAAA records
for the names in `records`, SRV records for those in `services`, NXDOMAIN for other
names, SERVFAIL for those in `failing` and for the query types in `failing_types` (a
server that mishandles AAAA), and, while `silent` is set, no answer at all (a resolver
that times out)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from typing import cast

import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

__all__ = ["FakeDns", "fake_dns"]


class FakeDns(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}  # name (no trailing dot) -> addresses
        # SRV name -> (priority, weight, port, target) records
        self.services: dict[str, list[tuple[int, int, int, str]]] = {}
        self.failing: set[str] = set()  # names answered SERVFAIL
        self.failing_types: set[str] = set()  # query types answered SERVFAIL ("AAAA")
        self.silent = False
        self.asked = 0  # queries received (answered or not)
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.asked += 1
        if self.silent or self._transport is None:
            return
        query = dns.message.from_wire(data)
        answer = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        addresses = self.records.get(name)
        if name in self.failing or dns.rdatatype.to_text(question.rdtype) in self.failing_types:
            answer.set_rcode(dns.rcode.SERVFAIL)
        elif name not in self.records and name not in self.services:
            answer.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.SRV:
            srv = [f"{p} {w} {port} {target}" for p, w, port, target in self.services.get(name, [])]
            if srv:
                answer.answer.append(
                    dns.rrset.from_text_list(question.name, 5, dns.rdataclass.IN, "SRV", srv)
                )
        elif addresses is not None:
            version = 4 if question.rdtype == dns.rdatatype.A else 6
            wanted = [a for a in addresses if ipaddress.ip_address(a).version == version]
            if wanted:  # none of the type: an empty answer (NOERROR, no records)
                answer.answer.append(
                    dns.rrset.from_text_list(
                        question.name, 5, dns.rdataclass.IN, question.rdtype, wanted
                    )
                )
        self._transport.sendto(answer.to_wire(), addr)


@contextlib.asynccontextmanager
async def fake_dns() -> AsyncIterator[tuple[FakeDns, str]]:
    """Serve a FakeDns on 127.0.0.1 (a free port); yield it and its "host:port"."""
    loop = asyncio.get_running_loop()
    transport, server = await loop.create_datagram_endpoint(FakeDns, local_addr=("127.0.0.1", 0))
    try:
        host, port = transport.get_extra_info("sockname")[:2]
        yield server, f"{host}:{port}"
    finally:
        transport.close()
