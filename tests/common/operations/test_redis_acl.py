"""Redis ACL users per role (``common.operations.redis_acl``) on a real Redis: each
role's own operations work through Meridian's own clients, and every write outside
its role is refused with NOPERM."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError

from cli.redis_acl import read_passwords, write_passwords
from common.basics.redis_embed import EmbeddedRedis, redis_server_version
from common.basics.redis_url import with_credentials
from common.capacity.streams import CapacityPublisher, CapacityReader, region_stream, zone_stream
from common.config.access import TenantConfig
from common.config.node import ConfigError
from common.config.topology import topology_from_mapping
from common.gen.meridian.v1 import capacity_pb2
from common.operations.redis_acl import (
    ADMIN,
    USAGE,
    DefaultUser,
    acl_file,
    admin_user,
    edge_user,
    fleet_users,
    local_user,
    regional_user,
    selectors_supported,
    tenant_grants,
    usage_user,
)
from common.tenancy.concurrency import TenantConcurrency
from common.tenancy.quota import TenantRateLimiter
from common.tenancy.usage import UsageRecord, UsageRecorder, summarise
from common.tenancy.usage_record import USAGE_STREAM, meta_key
from common.tenancy.usage_state import stream_state
from sim.topology import one_zone_mapping
from tests.until import until

USERS = [
    admin_user(),
    edge_user(),
    usage_user(),
    regional_user("eu"),
    local_user("eu", "eu-1a"),
    local_user("eu", "eu-1b"),
    regional_user("us"),
    local_user("us", "us-1a", openai=True),  # an OpenAI edge: the edge's grants too
]
LOCAL_EU_1A, REGIONAL_EU, EDGE, LOCAL_EDGE = (
    "meridian/local/eu/eu-1a",
    "meridian/regional/eu",
    "meridian/global",
    "meridian/local/us/us-1a",
)
QUOTA_KEY = "meridian:quota:{t}:rps"
LEASES_KEY = "meridian:concurrency:{t}:leases"
KEYS = "this user has no permissions to access one of the keys used as arguments"
SCRIPT_KEYS = (
    "The user executing the script can't access at least one of the keys mentioned in "
    "the command arguments"
)


def command(name: str) -> str:
    return f"this user has no permissions to run the '{name}' command"


def refusal_of(exc: BaseException) -> str:
    """The refusal in the words of Redis 7; Redis 6 adds these to a command's."""
    return str(exc).removesuffix(" or its subcommand")


class AclRedis:
    """A real Redis loading the ACL file of ``USERS``, and a client per user."""

    def __init__(self, directory: Path, default: DefaultUser) -> None:
        write_passwords(directory, USERS)
        self.passwords = read_passwords(directory, USERS)
        self.version = redis_server_version()
        self.selectors = selectors_supported(self.version)
        path = directory / "users.acl"
        path.write_text(acl_file(USERS, self.passwords, default, selectors=self.selectors))
        self.server = EmbeddedRedis(acl_file=path, username=ADMIN, password=self.passwords[ADMIN])
        self.clients: list[redis.Redis] = []

    def url(self, user: str) -> str:
        return with_credentials(self.server.address_url, user, self.passwords[user])

    def client(self, user: str) -> redis.Redis:
        client = redis.Redis.from_url(self.url(user), socket_timeout=5)
        self.clients.append(client)
        return client


def started(directory: Path, default: DefaultUser) -> Iterator[AclRedis]:
    acl = AclRedis(directory, default)
    acl.server.start()
    try:
        yield acl
    finally:
        acl.server.close()


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    yield from started(tmp_path_factory.mktemp("acl"), DefaultUser.READ_ONLY)


@pytest.fixture
def acl(acl_server: AclRedis) -> Iterator[AclRedis]:
    """The module's ACL Redis, emptied for each test; the test's clients closed after it."""
    try:
        yield acl_server
    finally:
        for client in acl_server.clients:
            client.close()
        acl_server.clients.clear()
        with redis.Redis.from_url(acl_server.url(ADMIN)) as admin:
            admin.flushall()


def xadd(key: str) -> tuple[str, ...]:
    return ("XADD", key, "*", "summary", "forged")


FORBIDDEN = [
    # A local tier: its own zone's stream, append only.
    (LOCAL_EU_1A, xadd(zone_stream("eu", "eu-1b")), KEYS),
    (LOCAL_EU_1A, xadd(zone_stream("us", "us-1a")), KEYS),
    (LOCAL_EU_1A, xadd(region_stream("eu")), KEYS),
    (LOCAL_EU_1A, ("SET", QUOTA_KEY, "0"), command("set")),
    (LOCAL_EU_1A, ("EVAL", "return 1", "1", QUOTA_KEY), command("eval")),
    (LOCAL_EU_1A, ("ZADD", LEASES_KEY, "1", "x"), command("zadd")),
    (LOCAL_EU_1A, xadd(USAGE_STREAM), KEYS),
    (LOCAL_EU_1A, ("DEL", zone_stream("eu", "eu-1a")), command("del")),
    (LOCAL_EU_1A, ("XREAD", "STREAMS", zone_stream("eu", "eu-1a"), "0"), command("xread")),
    # A local tier with an OpenAI edge: the edge's keys besides its own, nothing else.
    (LOCAL_EDGE, xadd(zone_stream("eu", "eu-1a")), KEYS),
    (LOCAL_EDGE, xadd(region_stream("us")), KEYS),
    (LOCAL_EDGE, ("SET", "meridian:anything", "1"), KEYS),
    # A regional tier: its region's keys only.
    (REGIONAL_EU, xadd(region_stream("us")), KEYS),
    (REGIONAL_EU, xadd(zone_stream("us", "us-1a")), KEYS),
    (REGIONAL_EU, ("XREAD", "STREAMS", zone_stream("us", "us-1a"), "0"), KEYS),
    (REGIONAL_EU, ("DEL", zone_stream("eu", "eu-1a")), command("del")),
    (REGIONAL_EU, ("SET", QUOTA_KEY, "0"), command("set")),
    (REGIONAL_EU, xadd(USAGE_STREAM), KEYS),
    # The edge: no zone's summary, no key outside its own, not even from a script.
    (EDGE, xadd(zone_stream("eu", "eu-1a")), KEYS),
    (EDGE, ("SET", "meridian:anything", "1"), KEYS),
    (EDGE, ("FLUSHALL",), command("flushall")),
    (EDGE, ("KEYS", "*"), command("keys")),
    # The usage command reads; it writes nothing, its own stream included.
    (USAGE, xadd(USAGE_STREAM), command("xadd")),
    (USAGE, ("DEL", USAGE_STREAM), command("del")),
    (USAGE, ("HSET", meta_key(USAGE_STREAM), "added", "0"), command("hset")),
    (USAGE, ("XTRIM", USAGE_STREAM, "MAXLEN", "0"), command("xtrim")),
    (USAGE, ("XRANGE", zone_stream("eu", "eu-1a"), "-", "+"), KEYS),
]


def contents(admin: redis.Redis) -> dict[bytes, bytes]:
    """Every key and its serialised value."""
    return {key: admin.dump(key) for key in admin.scan_iter()}


@pytest.mark.parametrize(("user", "args", "refusal"), FORBIDDEN)
def test_a_write_outside_the_role_is_refused_with_noperm(
    acl: AclRedis, user: str, args: tuple[str, ...], refusal: str
) -> None:
    admin = acl.client(ADMIN)
    admin.xadd(USAGE_STREAM, {"kept": "1"})
    before = contents(admin)
    with pytest.raises(NoPermissionError) as refused:
        acl.client(user).execute_command(*args)
    assert refusal_of(refused.value) == refusal
    assert contents(admin) == before  # nothing changed


# Redis 7's selectors hold each command to its own grant's keys (Redis 6 allows these).
FORBIDDEN_BY_SELECTORS = [
    (REGIONAL_EU, xadd(zone_stream("eu", "eu-1a")), KEYS),
    (REGIONAL_EU, ("XREAD", "STREAMS", region_stream("eu"), "0"), KEYS),
    (EDGE, xadd(region_stream("eu")), KEYS),
    (EDGE, ("SET", USAGE_STREAM, "erased"), KEYS),
    (EDGE, ("DEL", USAGE_STREAM), KEYS),
    (EDGE, ("HSET", "meridian:{usage}:batch:x", "f", "v"), KEYS),
]


@pytest.mark.parametrize(("user", "args", "refusal"), FORBIDDEN_BY_SELECTORS)
def test_with_selectors_a_command_is_held_to_its_own_keys(
    acl: AclRedis, user: str, args: tuple[str, ...], refusal: str
) -> None:
    if not acl.selectors:
        pytest.skip(f"Redis {acl.version} has no ACL selectors (7.0 and later)")
    test_a_write_outside_the_role_is_refused_with_noperm(acl, user, args, refusal)


def test_a_script_is_held_to_its_callers_keys(acl: AclRedis) -> None:
    """EVAL widens nothing: a key the script names without declaring it is checked too."""
    edge = acl.client(EDGE)
    forge = f"return redis.call('XADD', '{zone_stream('eu', 'eu-1a')}', '*', 'f', 'v')"
    with pytest.raises(redis.ResponseError) as refused:
        edge.eval(forge, 0)
    assert SCRIPT_KEYS in str(refused.value)
    assert not acl.client(ADMIN).exists(zone_stream("eu", "eu-1a"))


def test_the_default_user_reads_and_writes_nothing_on_a_one_machine_fleet(
    acl: AclRedis,
) -> None:
    acl.client(LOCAL_EU_1A).xadd(zone_stream("eu", "eu-1a"), {"summary": "s"})
    anonymous = redis.Redis(port=acl.server.port, socket_timeout=5)
    try:
        assert anonymous.xlen(zone_stream("eu", "eu-1a")) == 1
        with pytest.raises(NoPermissionError) as refused:
            anonymous.xadd(zone_stream("eu", "eu-1a"), {"summary": "forged"})
        assert refusal_of(refused.value) == command("xadd")
    finally:
        anonymous.close()


def test_the_default_user_off_cannot_even_read(tmp_path: Path) -> None:
    for acl in started(tmp_path, DefaultUser.OFF):
        with socket.create_connection(("127.0.0.1", acl.server.port), timeout=5) as raw:
            raw.sendall(b"GET " + QUOTA_KEY.encode() + b"\r\n")
            assert raw.recv(1024) == b"-NOAUTH Authentication required.\r\n"


def test_a_wrong_password_is_refused(acl: AclRedis) -> None:
    wrong = redis.Redis.from_url(
        with_credentials(acl.server.address_url, LOCAL_EU_1A, acl.passwords[REGIONAL_EU])
    )
    try:
        with pytest.raises(redis.AuthenticationError, match="invalid username-password"):
            wrong.ping()
    finally:
        wrong.close()


def summary(sequence: int) -> capacity_pb2.CapacitySummary:
    return capacity_pb2.CapacitySummary(source_id="eu-1a", sequence=sequence)


async def test_summaries_flow_up_each_tier_as_its_own_user(acl: AclRedis) -> None:
    """local publishes its zone, regional reads it and publishes the region, the edge
    reads the region: Meridian's own publisher and reader, each as its role."""
    zone, region = zone_stream("eu", "eu-1a"), region_stream("eu")
    at_regional: list[int] = []
    at_edge: list[int] = []
    local = CapacityPublisher(acl.url(LOCAL_EU_1A), zone, summary, cadence_s=0.05, maxlen=10)
    regional = CapacityPublisher(acl.url(REGIONAL_EU), region, summary, cadence_s=0.05, maxlen=10)
    readers = [
        CapacityReader(
            acl.url(REGIONAL_EU), {zone: "eu-1a"}, lambda _, s: at_regional.append(s.sequence),
            block_ms=100,
        ),
        CapacityReader(
            acl.url(EDGE), {region: "eu"}, lambda _, s: at_edge.append(s.sequence), block_ms=100
        ),
    ]  # fmt: skip
    parts = [local, regional, *readers]
    for part in parts:
        part.start()
    try:
        await until(lambda: bool(at_regional and at_edge), what="summaries at both tiers")
        assert all(part.redis_up() for part in parts)
    finally:
        for part in parts:
            await part.stop()


@pytest.mark.parametrize("edge", [EDGE, LOCAL_EDGE])
async def test_the_edge_runs_its_quota_and_usage_scripts_and_usage_reads_them(
    acl: AclRedis, edge: str
) -> None:
    tenant = TenantConfig(
        id="t", key_hashes=frozenset(), requests_per_s=5, tokens_per_min=1000, max_concurrent=2
    )
    limiter = TenantRateLimiter(acl.url(edge), redis_timeout_s=1.0)
    leases = TenantConcurrency(acl.url(edge), redis_timeout_s=1.0)
    recorder = UsageRecorder(acl.url(edge))
    recorder.start()
    try:
        await limiter.admit(tenant, 10)
        await limiter.settle(tenant, 20)
        release = await leases.acquire(tenant)
        release()
        recorder.record(UsageRecord("t", "m", "eu", "eu-1a", "g", 1, 2, 0.1, "OK", "", "r1", 1))
        await recorder.flush()
        assert (limiter.degraded, leases.degraded, recorder.written) == (False, False, 1)
    finally:
        await recorder.stop()
        await leases.close()
        await limiter.close()
    totals = await summarise(acl.url(USAGE), since_ms=None, until_ms=None)
    state = await stream_state(acl.url(USAGE))
    assert (totals[("t", "m")].requests, state.length, state.added) == (1, 1, 1)


def one_zone_topology(region: str = "eu") -> dict[str, object]:
    return one_zone_mapping("redis://127.0.0.1:6379/0", region=region, zone="eu-1a")


def test_a_fleet_has_an_admin_an_edge_a_reader_and_a_user_per_tier() -> None:
    topology = topology_from_mapping(one_zone_topology())
    assert [u.name for u in fleet_users(topology)] == [
        ADMIN, EDGE, USAGE, REGIONAL_EU, LOCAL_EU_1A,
    ]  # fmt: skip


def test_only_a_tier_with_an_openai_edge_gets_the_edges_grants() -> None:
    raw = one_zone_mapping("redis://127.0.0.1:6379/0", region="eu", zone="eu-1a")
    plain = {u.name: u for u in fleet_users(topology_from_mapping(raw))}
    raw["regions"][0]["zones"][0]["openai_listen"] = "127.0.0.1:0"
    users = {u.name: u for u in fleet_users(topology_from_mapping(raw))}
    assert users[LOCAL_EU_1A].grants == (*plain[LOCAL_EU_1A].grants, *tenant_grants())
    assert users[REGIONAL_EU] == plain[REGIONAL_EU]


def test_a_region_name_that_cannot_name_a_user_is_refused_with_its_key() -> None:
    topology = topology_from_mapping(one_zone_topology(region="eu west"))
    with pytest.raises(ConfigError, match=r"^regions\[0\]\.name: 'eu west' cannot name"):
        fleet_users(topology)


def test_the_acl_file_holds_digests_never_passwords(tmp_path: Path) -> None:
    write_passwords(tmp_path, USERS)
    passwords = read_passwords(tmp_path, USERS)
    text = acl_file(USERS, passwords, DefaultUser.OFF)
    assert not any(password in text for password in passwords.values())
    assert text.splitlines()[0] == "user default reset off resetchannels -@all"
    assert (tmp_path / "local" / "eu" / "eu-1a").stat().st_mode & 0o777 == 0o600
