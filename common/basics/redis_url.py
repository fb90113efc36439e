"""Every Redis client Meridian makes comes from one URL, through this module.

Accepted URLs (``check_redis_url`` says exactly what is wrong with another):

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://…`` (TLS),
  ``unix://[[user]:password@]/path/to/socket[?db=N]`` — redis-py's own forms;
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/service[/db]``
  with an optional ``?sentinel_password=…`` — a master found through Redis
  Sentinel (port 26379 when none is given). The user and password are the
  master's; the Sentinels get ``sentinel_password`` (none when absent).

A Sentinel client asks the Sentinels for the master's address whenever it opens
a connection, so after a failover the next connection goes to the promoted
replica by itself (redis-py's ``SentinelConnectionPool``; a connection still on
a demoted master gets READONLY, is dropped and re-asks). Closing the client
closes its Sentinel connections too (``_OwnedSentinelPool``), so a client made
here owns everything it opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as asentinel
import redis.sentinel as ssentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.connection import parse_url
from redis.retry import Retry as SyncRetry

SENTINEL_SCHEME = "redis+sentinel"
DIRECT_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelTarget:
    """Where a ``redis+sentinel://`` URL points: the Sentinels and the master they name."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hosts}{slash}{tail}"


def with_credentials(url: str, username: str, password: str) -> str:
    """``url`` logging in as ``username`` with ``password``, in place of any it named
    (the master's, for a ``redis+sentinel://`` URL)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a Redis URL: {redact(url)!r} (expected scheme://…)")
    netloc, slash, tail = rest.partition("/")
    hosts = netloc.rpartition("@")[2]
    auth = f"{quote(username, safe='')}:{quote(password, safe='')}@"
    return f"{scheme}://{auth}{hosts}{slash}{tail}"


TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def with_tls_files(url: str, ca: str, cert: str | None = None, key: str | None = None) -> str:
    """A ``rediss://`` URL verifying the server against ``ca`` and presenting ``cert``
    and ``key`` (for ``tls-auth-clients``), each unless the URL names its own
    (redis-py's ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``); any other URL as
    it is (plaintext, or a Sentinel's, whose options are its own)."""
    if not url.lower().startswith("rediss://"):
        return url
    base, _, query = url.partition("?")
    options = parse_qs(query, keep_blank_values=True)
    files = dict(zip(TLS_FILE_OPTIONS, (ca, cert, key), strict=True))
    added = {name: path for name, path in files.items() if path and name not in options}
    if not added:
        return url
    return f"{base}?{query + '&' if query else ''}{urlencode(added)}"


def check_redis_url(url: str) -> SentinelTarget | None:
    """The Sentinel target of a ``redis+sentinel://`` URL, None for a direct one;
    ``ValueError`` saying what is wrong with anything else."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"not a Redis URL: {redact(url)!r} (expected scheme://…)")
    scheme = url.split("://", 1)[0].lower()
    if scheme == SENTINEL_SCHEME:
        return _sentinel_target(url)
    if scheme not in DIRECT_SCHEMES:
        known = ", ".join(f"{s}://" for s in (*DIRECT_SCHEMES, SENTINEL_SCHEME))
        raise ValueError(
            f"unknown Redis URL scheme {scheme}:// in {redact(url)!r}; use one of {known}"
        )
    parts = urlsplit(url)
    try:
        parse_url(url)  # redis-py's own checks (query options)
        port = parts.port  # raises for a port that is not a number in 0..65535
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {redact(url)!r}: {exc}") from None
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"unix:// URL without a socket path: {redact(url)!r}")
        return None
    if not parts.hostname:
        raise ValueError(f"Redis URL without a host: {redact(url)!r}")
    if port == 0:
        raise ValueError(f"Redis URL with port 0: {redact(url)!r}")
    db = unquote(parts.path).strip("/")
    if db and not db.isdigit():
        raise ValueError(f"Redis URL path must be a database number, got {db!r} in {redact(url)!r}")
    return None


def _sentinel_target(url: str) -> SentinelTarget:
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    if not hosts:
        raise ValueError(f"redis+sentinel URL without a Sentinel host: {redact(url)!r}")
    sentinels = tuple(_host_port(item, url) for item in hosts.split(","))
    segments = [unquote(s) for s in path.split("/") if s]
    if not segments or len(segments) > 2:
        raise ValueError(
            f"redis+sentinel URL must end in /service_name or /service_name/db: {redact(url)!r}"
        )
    if len(segments) == 2 and not segments[1].isdigit():
        raise ValueError(f"redis+sentinel database must be a number, got {segments[1]!r}")
    options = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(options) - {"sentinel_password"})
    if unknown:
        raise ValueError(f"redis+sentinel URL: unknown option(s) {unknown} in {redact(url)!r}")
    return SentinelTarget(
        sentinels=sentinels,
        service=segments[0],
        db=int(segments[1]) if len(segments) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_password=options.get("sentinel_password", [None])[0] or None,
    )


def _host_port(item: str, url: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` of one Sentinel."""
    if item.startswith("["):
        host, closed, tail = item[1:].partition("]")
        if not closed or (tail and not tail.startswith(":")):
            raise ValueError(f"redis+sentinel URL: bad address {item!r} in {redact(url)!r}")
        port_text = tail[1:]
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError(f"redis+sentinel URL with an empty host in {redact(url)!r}")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"redis+sentinel URL: bad port {port_text!r} for {host} in {redact(url)!r}"
        )
    return host, int(port_text)


class _MasterConnection(asentinel.SentinelManagedConnection):
    """A connection that asks the Sentinels where the master is whenever it reconnects.

    redis-py 8.1's asyncio ``send_packed_command`` reconnects a dropped connection
    with ``connect_check_health``, which skips the Sentinel lookup of ``connect``:
    a single-connection client (the usage recorder's, for WAIT) kept dialling the
    dead master after a failover. Here a reconnect goes through ``connect``."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()
        await super().send_packed_command(command, check_health)


class _OwnedSentinelPool(asentinel.SentinelConnectionPool):
    """A Sentinel pool that closes its Sentinel clients when it is closed itself."""

    async def aclose(self) -> None:
        await super().aclose()
        await self.sentinel_manager.aclose()


@dataclass(frozen=True)
class ClientOptions:
    """The connection options Meridian sets on a client (the rest are redis-py's)."""

    socket_timeout: float | None = None
    socket_connect_timeout: float | None = None
    # None: redis-py's default retry (a few quick re-tries on a broken connection).
    retry: Any = None
    decode_responses: bool = False

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_connect_timeout,
            "decode_responses": self.decode_responses,
            # No CLIENT SETINFO on connect: a role's ACL user may not run CLIENT
            # (common.operations.redis_acl), and each refusal is an ACL LOG entry.
            # Maintenance notifications stay redis-py's "auto" although their CLIENT
            # MAINT_NOTIFICATIONS is refused (and ignored) the same way: with them
            # off, the pool silently reconnects a connection Redis closed, and a
            # quota's client would not learn that Redis restarted (QuotaRedis.run).
            "driver_info": None,
        }
        if self.retry is not None:
            out["retry"] = self.retry
        return out

    def sentinel_kwargs(self, target: SentinelTarget) -> dict[str, Any]:
        return {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_connect_timeout,
            "password": target.sentinel_password,
        }


def _master_kwargs(target: SentinelTarget, options: ClientOptions) -> dict[str, Any]:
    return {
        **options.kwargs(),
        "db": target.db,
        "username": target.username,
        "password": target.password,
        "is_master": True,
    }


def _async_master_kwargs(target: SentinelTarget, options: ClientOptions) -> dict[str, Any]:
    return {**_master_kwargs(target, options), "connection_class": _MasterConnection}


def async_redis(
    url: str,
    *,
    socket_timeout: float | None = None,
    socket_connect_timeout: float | None = None,
    retry: AsyncRetry | None = None,
    single_connection_client: bool = False,
    decode_responses: bool = False,
) -> aioredis.Redis:
    """An asyncio client for ``url`` (any form above); ``ValueError`` for a bad URL."""
    options = ClientOptions(socket_timeout, socket_connect_timeout, retry, decode_responses)
    target = check_redis_url(url)
    if target is None:
        return aioredis.Redis.from_url(
            url, single_connection_client=single_connection_client, **options.kwargs()
        )
    manager = asentinel.Sentinel(
        list(target.sentinels), sentinel_kwargs=options.sentinel_kwargs(target)
    )
    pool = _OwnedSentinelPool(target.service, manager, **_async_master_kwargs(target, options))
    client = aioredis.Redis(connection_pool=pool, single_connection_client=single_connection_client)
    client.auto_close_connection_pool = True  # the client owns its pool, as from_url's does
    return client


def sync_redis(
    url: str,
    *,
    socket_timeout: float | None = None,
    socket_connect_timeout: float | None = None,
    retry: SyncRetry | None = None,
    decode_responses: bool = False,
) -> redis.Redis:
    """A blocking client for ``url`` (tools and benchmarks; never on the request path)."""
    options = ClientOptions(socket_timeout, socket_connect_timeout, retry, decode_responses)
    target = check_redis_url(url)
    if target is None:
        return redis.Redis.from_url(url, **options.kwargs())
    manager = ssentinel.Sentinel(
        list(target.sentinels), sentinel_kwargs=options.sentinel_kwargs(target)
    )
    pool = ssentinel.SentinelConnectionPool(
        target.service, manager, **_master_kwargs(target, options)
    )
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True
    return client
