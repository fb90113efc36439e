"""A real DNS server on loopback for tests and benches: answers A queries for the names
it is given, from a table the caller may change while it runs (replicas come and go).

Built on ``dnslib``'s ``DNSServer`` (UDP, a thread of its own). gRPC's resolver asks it
when a topology says ``dns: dns://127.0.0.1:PORT/`` (``authority``). A name it does
not know gets an empty answer (NOERROR, no records), as does any AAAA query.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dnslib import QTYPE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class _Table(BaseResolver):
    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.lock = threading.Lock()
        self.queries = 0

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self.lock:
            self.queries += 1
            addresses = list(self.answers.get(name, ())) if request.q.qtype == QTYPE.A else []
        for ip in addresses:
            # TTL 1 s: nothing should cache it longer than a test step.
            reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=1))
        return reply


class LoopbackDns:
    """The running server: ``authority`` for the topology, ``set`` to change an answer."""

    def __init__(self, table: _Table, server: Any) -> None:
        self._table = table
        self._server = server
        self.port: int = server.server.server_address[1]

    @property
    def authority(self) -> str:
        return f"dns://127.0.0.1:{self.port}/"

    @property
    def queries(self) -> int:
        """How many queries it answered (gRPC asks A and AAAA on every resolution)."""
        with self._table.lock:
            return self._table.queries

    def set(self, name: str, addresses: list[str]) -> None:
        with self._table.lock:
            self._table.answers[name] = list(addresses)


@contextmanager
def loopback_dns(answers: dict[str, list[str]]) -> Iterator[LoopbackDns]:
    """A DNS server on 127.0.0.1 (a free UDP port) answering ``answers``; stopped on exit."""
    table = _Table({name: list(ips) for name, ips in answers.items()})
    quiet = DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data", False)
    server = DNSServer(table, port=0, address="127.0.0.1", logger=quiet)
    server.start_thread()
    try:
        yield LoopbackDns(table, server)
    finally:
        server.stop()
        server.thread.join(5)
