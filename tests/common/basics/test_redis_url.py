"""The one Redis URL parser and client factory: every form, every refusal, and a client
on a real Sentinel (the embedded binary in ``--sentinel`` mode)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.basics.redis_embed import EmbeddedRedis, EmbeddedSentinel, sentinel_url
from common.basics.redis_url import (
    SentinelTarget,
    async_redis,
    check_redis_url,
    redact,
    sync_redis,
)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://:secret@redis.internal:6380/3",
        "redis://user:secret@redis.internal",
        "rediss://redis.internal:6380/0",
        "unix:///run/redis.sock?db=2",
    ],
)
def test_direct_urls_are_accepted_as_direct(url: str) -> None:
    assert check_redis_url(url) is None


def test_a_sentinel_url_names_every_sentinel_the_service_and_the_db() -> None:
    url = "redis+sentinel://:pw@10.0.0.1:26380,sentinel-b,[::1]:26381/billing/2?sentinel_password=s"
    assert check_redis_url(url) == SentinelTarget(
        sentinels=(("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 26381)),
        service="billing",
        db=2,
        password="pw",
        sentinel_password="s",
    )


def test_a_sentinel_url_without_db_uses_db_0() -> None:
    target = check_redis_url("redis+sentinel://s1:26379/meridian")
    assert target is not None and (target.service, target.db) == ("meridian", 0)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("127.0.0.1:6379", "not a Redis URL: '127.0.0.1:6379' (expected scheme://…)"),
        (
            "http://h:1",
            "unknown Redis URL scheme http:// in 'http://h:1'; use one of redis://, rediss://, "
            "unix://, redis+sentinel://",
        ),
        ("redis://h:99999", "bad Redis URL 'redis://h:99999': Port out of range 0-65535"),
        ("redis://h:0", "Redis URL with port 0: 'redis://h:0'"),
        ("redis:///0", "Redis URL without a host: 'redis:///0'"),
        ("redis://h/x", "Redis URL path must be a database number, got 'x' in 'redis://h/x'"),
        ("unix://", "unix:// URL without a socket path: 'unix://'"),
        (
            "redis+sentinel:///m",
            "redis+sentinel URL without a Sentinel host: 'redis+sentinel:///m'",
        ),
        (
            "redis+sentinel://s:1",
            "redis+sentinel URL must end in /service_name or /service_name/db: "
            "'redis+sentinel://s:1'",
        ),
        ("redis+sentinel://s:1/m/x", "redis+sentinel database must be a number, got 'x'"),
        (
            "redis+sentinel://s:x/m",
            "redis+sentinel URL: bad port 'x' for s in 'redis+sentinel://s:x/m'",
        ),
        (
            "redis+sentinel://s,/m",
            "redis+sentinel URL with an empty host in 'redis+sentinel://s,/m'",
        ),
        (
            "redis+sentinel://s/m?ssl=1",
            "redis+sentinel URL: unknown option(s) ['ssl'] in 'redis+sentinel://s/m?ssl=1'",
        ),
    ],
)
def test_a_bad_url_is_refused_saying_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_redis_url(url)
    assert str(err.value) == message


def test_messages_never_show_the_password() -> None:
    with pytest.raises(ValueError) as err:
        check_redis_url("redis://:hunter2@h/x")
    assert "hunter2" not in str(err.value) and "redis://:***@h/x" in str(err.value)
    assert redact("redis+sentinel://u:pw@a,b/m") == "redis+sentinel://u:***@a,b/m"
    assert redact("redis://h:1/0") == "redis://h:1/0"


@pytest.fixture
def one_sentinel() -> Iterator[tuple[EmbeddedRedis, str]]:
    """A master with one Sentinel watching it (quorum 1: no failover is asked of it)."""
    master = EmbeddedRedis()
    sentinel = EmbeddedSentinel(0, quorum=1)
    try:
        master.start()
        sentinel.master_port = master.port
        sentinel.start()
        yield master, sentinel_url([sentinel])
    finally:
        sentinel.close()
        master.close()


async def test_an_async_client_finds_the_master_through_the_sentinel(
    one_sentinel: tuple[EmbeddedRedis, str],
) -> None:
    master, url = one_sentinel
    client = async_redis(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        await client.set("through-sentinel", "yes")
        info = await client.info("server")
        assert info["process_id"] == master.process.pid  # type: ignore[union-attr]
    finally:
        await client.aclose()  # closes its Sentinel connections too (no_leaks checks)
    direct = sync_redis(master.url)
    try:
        assert direct.get("through-sentinel") == b"yes"
    finally:
        direct.close()


def test_a_sync_client_finds_the_master_through_the_sentinel(
    one_sentinel: tuple[EmbeddedRedis, str],
) -> None:
    master, url = one_sentinel
    client = sync_redis(url, socket_timeout=1.0, decode_responses=True)
    try:
        client.set("sync-through-sentinel", "yes")
        assert client.info("server")["process_id"] == master.process.pid  # type: ignore[union-attr]
        assert client.get("sync-through-sentinel") == "yes"
    finally:
        client.close()
