"""A real Redis Sentinel deployment on loopback: a primary, two replicas, three Sentinels.

Every process is the embedded Redis binary (``common.basics.redis_embed``). Two
replicas, not one: after the primary dies one is promoted and the other
replicates it, so a writer that waits for one replica (``usage_replicas_ack: 1``)
can write again at once. Three Sentinels with a quorum of two, as a production
deployment runs them, so no single Sentinel decides a failover.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import redis

from common.basics.redis_embed import EmbeddedRedis, EmbeddedSentinel, sentinel_url

SERVICE = "meridian"


@dataclass
class SentinelGroup:
    """``start()`` brings everything up and waits until the Sentinels know the
    replicas and each other; ``close()`` stops every process, whatever state it is in."""

    down_after_ms: int = 500
    servers: list[EmbeddedRedis] = field(default_factory=list)
    sentinels: list[EmbeddedSentinel] = field(default_factory=list)

    @property
    def url(self) -> str:
        return sentinel_url(self.sentinels, SERVICE)

    def start(self, timeout_s: float = 20.0) -> None:
        primary = EmbeddedRedis()
        self.servers.append(primary)
        primary.start()
        for _ in range(2):
            replica = EmbeddedRedis(replica_of=primary.port)
            self.servers.append(replica)
            replica.start()
        for _ in range(3):
            sentinel = EmbeddedSentinel(
                primary.port, service=SERVICE, quorum=2, down_after_ms=self.down_after_ms
            )
            self.sentinels.append(sentinel)
            sentinel.start()
        deadline = time.monotonic() + timeout_s
        while not self._settled():
            assert time.monotonic() < deadline, "the Sentinels never found each other"
            time.sleep(0.1)

    def _settled(self) -> bool:
        """Replicas synced, and every Sentinel sees both replicas and both peers."""
        for server in self.servers[1:]:
            if self.info(server.port, "replication").get("master_link_status") != "up":
                return False
        for sentinel in self.sentinels:
            client = redis.Redis(port=sentinel.port, socket_timeout=1.0)
            try:
                master = client.sentinel_master(SERVICE)
                if (master["num-slaves"], master["num-other-sentinels"]) != (2, 2):
                    return False
            finally:
                client.close()
        return True

    def info(self, port: int, section: str) -> dict[str, object]:
        client = redis.Redis(port=port, socket_timeout=1.0)
        try:
            return client.info(section)  # type: ignore[no-any-return]
        finally:
            client.close()

    def primary(self) -> EmbeddedRedis:
        """The server that is master now (as the servers themselves say)."""
        for server in self.servers:
            if (
                server.process is not None
                and self.info(server.port, "replication")["role"] == "master"
            ):
                return server
        raise AssertionError("no master among the servers")

    def promoted(self, old: EmbeddedRedis) -> EmbeddedRedis | None:
        """The master the Sentinels name now if it is not ``old`` and says it is one."""
        client = redis.Redis(port=self.sentinels[0].port, socket_timeout=1.0)
        try:
            _, port = client.sentinel_get_master_addr_by_name(SERVICE)
        finally:
            client.close()
        if int(port) == old.port:
            return None
        new = next(s for s in self.servers if s.port == int(port))
        return new if self.info(new.port, "replication")["role"] == "master" else None

    async def wait_promoted(self, old: EmbeddedRedis, timeout_s: float = 20.0) -> EmbeddedRedis:
        """Until a replica of ``old`` is master (polled; each look is a loopback call)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = self.promoted(old)
            if new is not None:
                return new
            await asyncio.sleep(0.05)
        raise AssertionError(f"no replica promoted within {timeout_s} s")

    def close(self) -> None:
        for process in [*self.sentinels, *self.servers]:
            process.close()
