"""``meridian redis-acl`` on a real Redis, how a tier finds its password
(``common.operations.redis_login``), and ``rediss://`` with the fleet's CA through a
TLS terminator that, like ``tls-auth-clients yes``, admits only certificates of that CA."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
import yaml

from cli.redis_acl import redis_acl_main
from cli.usage import usage_main
from common.basics.redis_embed import EmbeddedRedis
from common.basics.redis_url import async_redis, sync_redis, with_credentials
from common.capacity.streams import CapacityPublisher, zone_stream
from common.config.identity import GLOBAL, local
from common.config.node import ConfigError
from common.config.pki import FleetCA
from common.config.topology import topology_from_mapping
from common.gen.meridian.v1 import capacity_pb2
from common.operations.redis_acl import ADMIN
from common.operations.redis_login import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    RedisLogin,
    read_password,
    tier_login,
    with_login,
)
from sim.topology import one_zone_mapping
from tests.until import until

LOCAL = "meridian/local/eu/eu-1a"
ZONE = zone_stream("eu", "eu-1a")


def topology_file(tmp_path: Path, redis_url: str) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(one_zone_mapping(redis_url, region="eu", zone="eu-1a")))
    return path


def test_passwords_render_apply_then_each_role_logs_in(
    tmp_path: Path, own_redis: EmbeddedRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    config, keys = topology_file(tmp_path, own_redis.url), tmp_path / "keys"
    args = ["--config", str(config), "--dir", str(keys)]
    assert redis_acl_main(["passwords", *args]) == 0
    assert f"wrote a password for {LOCAL}" in capsys.readouterr().out
    assert redis_acl_main(["render", *args]) == 0
    rendered = capsys.readouterr().out
    assert f"user {LOCAL} reset on #" in rendered and "user default reset off" in rendered
    assert redis_acl_main(["apply", *args]) == 0
    assert "5 users and default (off); in memory only" in capsys.readouterr().out
    local_url = with_credentials(
        own_redis.url, LOCAL, (keys / "local/eu/eu-1a").read_text().strip()
    )
    with sync_redis(local_url) as tier:
        tier.xadd(ZONE, {"summary": "s"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            tier.xadd(zone_stream("eu", "eu-1b"), {"summary": "forged"})
    with socket.create_connection(("127.0.0.1", own_redis.port), timeout=5) as anonymous:
        anonymous.sendall(b"PING\r\n")
        assert anonymous.recv(100) == b"-NOAUTH Authentication required.\r\n"
    # Applied again: the default user is off now, apply logs in as meridian/admin.
    assert redis_acl_main(["apply", *args]) == 0
    admin_url = with_credentials(own_redis.url, ADMIN, (keys / "admin").read_text().strip())
    with sync_redis(admin_url) as admin:
        assert admin.xlen(ZONE) == 1


def test_a_missing_password_file_is_named_with_the_command_that_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = topology_file(tmp_path, "redis://127.0.0.1:1/0")
    assert redis_acl_main(["render", "--config", str(config), "--dir", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err
    assert "--dir: no password for meridian/admin" in err
    assert "meridian redis-acl passwords writes the missing ones" in err


def test_usage_names_an_unreadable_password_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nope")
    argv = ["--redis", "redis://127.0.0.1:1/0", "--redis-password-file", missing]
    assert usage_main(argv) == 2
    err = capsys.readouterr().err
    reason = f"cannot read {missing!r}: No such file or directory"
    assert err == f"meridian usage: --redis-password-file: {reason}\n"


def test_the_password_comes_from_the_flag_then_the_file_variable_then_the_variable(
    tmp_path: Path,
) -> None:
    flag, env_file = tmp_path / "flag", tmp_path / "env"
    flag.write_text("from-flag\n")
    env_file.write_text("from-env-file\n")
    both = {PASSWORD_FILE_ENV: str(env_file), PASSWORD_ENV: "from-env"}
    assert read_password(str(flag), both) == "from-flag"
    assert read_password(None, both) == "from-env-file"
    assert read_password(None, {PASSWORD_ENV: "from-env"}) == "from-env"
    assert read_password(None, {}) is None


@pytest.mark.parametrize(
    ("file_text", "environ", "error"),
    [
        ("\n", {}, "--redis-password-file: '{file}' is empty; it must hold the Redis password"),
        ("\n", {PASSWORD_FILE_ENV: "{file}"}, f"${PASSWORD_FILE_ENV}: '{{file}}' is empty"),
        (None, {PASSWORD_ENV: ""}, f"${PASSWORD_ENV} is set but empty"),
    ],
)
def test_an_empty_password_is_refused_naming_its_source(
    tmp_path: Path, file_text: str | None, environ: dict[str, str], error: str
) -> None:
    path = tmp_path / "password"
    if file_text is not None:
        path.write_text(file_text)
    environ = {k: v.format(file=path) for k, v in environ.items()}
    flag = str(path) if file_text is not None and not environ else None
    with pytest.raises(ConfigError) as refused:
        read_password(flag, environ)
    assert str(refused.value).startswith(error.format(file=path))


def test_every_redis_of_the_topology_logs_in_and_only_rediss_gets_the_ca() -> None:
    mapping = one_zone_mapping("rediss://global.internal:6380/0", region="eu", zone="eu-1a")
    mapping["regions"][0]["redis_url"] = "redis://eu.internal:6379/0"
    topology = with_login(topology_from_mapping(mapping), RedisLogin(LOCAL, "p w", "/ca.pem"))
    assert topology.redis_url == (
        "rediss://meridian%2Flocal%2Feu%2Feu-1a:p%20w@global.internal:6380/0?ssl_ca_certs=%2Fca.pem"
    )
    assert topology.regions[0].redis_url == (
        "redis://meridian%2Flocal%2Feu%2Feu-1a:p%20w@eu.internal:6379/0"
    )


@contextlib.asynccontextmanager
async def tls_terminator(ca: FleetCA, redis_port: int) -> AsyncIterator[int]:
    """TLS on a port of its own in front of a plaintext Redis, with the global tier's
    certificate (loopback names, the fleet's CA), requiring a client certificate of that CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca.tls.ca)
    context.load_cert_chain(ca.tls.cert_file(GLOBAL), ca.tls.key_file(GLOBAL))
    context.verify_mode = ssl.CERT_REQUIRED
    pipes: set[asyncio.Task[None]] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", redis_port)
        for task in (pipe(reader, upstream_writer), pipe(upstream_reader, writer)):
            pipes.add(asyncio.create_task(task))

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        await server.wait_closed()


async def test_rediss_verifies_redis_against_the_fleet_ca_and_presents_the_tiers_certificate(
    tmp_path: Path, own_redis: EmbeddedRedis
) -> None:
    ca = FleetCA.create(tmp_path / "pki")
    ca.issue([GLOBAL, local("eu", "eu-1a")])
    async with tls_terminator(ca, own_redis.port) as port:
        mapping = one_zone_mapping(f"rediss://127.0.0.1:{port}/0", region="eu", zone="eu-1a")
        mapping["tls"] = dataclasses.asdict(ca.tls)
        topology = topology_from_mapping(mapping)
        login = tier_login(topology, LOCAL, None, local("eu", "eu-1a"))
        url = with_login(topology, login).redis_url
        publisher = CapacityPublisher(
            url, ZONE, lambda n: capacity_pb2.CapacitySummary(sequence=n), cadence_s=0.05, maxlen=5
        )
        publisher.start()
        try:
            with sync_redis(own_redis.url) as plain:
                await until(lambda: plain.xlen(ZONE) > 0, what="a summary over rediss://")
        finally:
            await publisher.stop()
        # Without the instance's certificate the terminator turns the client away.
        anonymous = tier_login(topology, LOCAL, None, None)
        assert anonymous.cert is None
        client = async_redis(with_login(topology, anonymous).redis_url, socket_timeout=2)
        try:
            with pytest.raises(redis.ConnectionError):
                await client.ping()
        finally:
            await client.aclose()
