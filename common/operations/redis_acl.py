"""Redis ACL users, one per role: each process may touch only the keys its role needs.

A process authenticates as the user of its place in the fleet (the names follow
``common.config.identity``); the keys are those of ``common.config.redis_layout``:

====================================  ===============================================  ==========
user                                  keys (commands)                                  writes
====================================  ===============================================  ==========
``meridian/local/<R>/<Z>``            its zone's summary stream (XADD); with an        that stream
                                      OpenAI edge, also the global's (quota, lease,    (and as the
                                      usage keys and their scripts)                    global)
``meridian/regional/<R>``             R's zone streams (XREAD, XREVRANGE); R's region  R's streams
                                      stream (XADD); with an OpenAI edge, as above
``meridian/global``                   region streams (XREAD, XREVRANGE); quota and     quotas,
                                      lease keys and the usage stream, its meta hash   leases,
                                      and batch markers (the quota and usage scripts)  usage
``meridian/usage``                    the usage stream and its meta hash (XRANGE,      nothing
                                      XINFO STREAM, HGETALL)
``meridian/admin``                    everything (the operator's; applies the users)   anything
====================================  ===============================================  ==========

The edge runs its quota and usage Lua scripts with EVALSHA/EVAL; Redis checks
every command a script calls against the calling user's commands and keys, so
EVAL widens nothing. A user is a list of grants (commands on key patterns). On
Redis 7 and later each grant is an ACL selector of its own, so a command is
allowed only on its own grant's keys: the regional tier reads its zones' streams
and appends only its region's, the edge may only XADD to the usage stream (never
SET, DEL or XTRIM it) and only read the region streams. Redis 6 has no selectors:
a user may run each of its commands on each of its keys, so there the regional tier
could also append to its own zones' streams, and the edge append to region streams
or overwrite the usage stream: still never another role's keys. The ``default``
user (no password) is turned off, or, for a fleet on one machine, may read
everything and write nothing (``DefaultUser``).

Every user's rules start with ``reset``, so applying them again (``ACL SETUSER``)
replaces what was there. Passwords travel as their SHA-256 (``#<hex>``): neither
the rendered ACL file nor the command that applies it holds a password.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from common.capacity.streams import region_stream, zone_stream
from common.config.identity import GLOBAL, Identity, check_segment, local, regional
from common.config.topology import Topology
from common.tenancy.usage_record import USAGE_STREAM, batch_key, meta_key

USER_PREFIX = "meridian/"
ADMIN = "meridian/admin"
USAGE = "meridian/usage"
QUOTA_PREFIX = "meridian:quota"
LEASE_PREFIX = "meridian:concurrency"

# What every user may run that names no key: PING, SELECT (a URL may name a
# database; key patterns hold in every database alike), and the edge's TIME, WAIT
# (usage_replicas_ack) and script loading.
_CONNECTION = ("ping", "select")
_STREAM_READ = ("xread", "xrevrange")
# The edge's scripts (common.tenancy.quota_scripts, common.tenancy.usage): sent by
# EVALSHA, loaded by SCRIPT LOAD or EVAL; the commands each calls on its keys.
_SCRIPTS = ("evalsha", "eval")
_SCRIPT_LOADING = ("script|load", "script|exists", "time", "wait")
_QUOTA_CALLS = ("get", "set", "del", "pexpire", "zadd", "zrem", "zcard", "zremrangebyscore")
_USAGE_CALLS = (("xadd",), ("hsetnx", "hincrby", "hset"), ("exists", "expire", "set"))
_USAGE_READ = ("xrange", "xrevrange", "xinfo|stream", "xlen", "hgetall")
_OBSERVER = ("+@read", "+info", "+ping", "+select")

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


class DefaultUser(enum.Enum):
    """What a connection that does not authenticate may do."""

    OFF = "off"  # nothing: every process names its user (production)
    READ_ONLY = "read-only"  # read any key, write none (a fleet on one machine)


@dataclass(frozen=True)
class Grant:
    """Commands (or ``@categories``) allowed on the keys matching ``keys`` (globs)."""

    keys: tuple[str, ...]
    commands: tuple[str, ...]


@dataclass(frozen=True)
class RedisUser:
    """One ACL user: its grants, and the commands it may run that name no key."""

    name: str
    grants: tuple[Grant, ...]
    keyless: tuple[str, ...] = _CONNECTION

    def rules(self, password_sha256: str | None, *, selectors: bool = False) -> list[str]:
        """Its ``ACL SETUSER`` rules, from a clean slate (``reset``); without a
        password the user is off. ``selectors`` (Redis 7+): each grant a selector of
        its own, so a command is allowed only on its grant's keys. Without (Redis 6):
        the union of the grants, every command on every key of the user."""
        login = ["on", f"#{password_sha256}"] if password_sha256 else ["off"]
        head = ["reset", *login, "resetchannels", "-@all", *(f"+{c}" for c in self.keyless)]
        if selectors:
            return [*head, *(_selector(grant) for grant in self.grants)]
        keys = dict.fromkeys(k for grant in self.grants for k in grant.keys)
        commands = dict.fromkeys(c for grant in self.grants for c in grant.commands)
        return [*head, *(f"~{k}" for k in keys), *(f"+{c}" for c in commands)]

    def password_file(self) -> str:
        """Where its password lives under a passwords directory (``local/R/Z``)."""
        return self.name.removeprefix(USER_PREFIX)


def _selector(grant: Grant) -> str:
    return (
        "(" + " ".join([*(f"~{k}" for k in grant.keys), *(f"+{c}" for c in grant.commands)]) + ")"
    )


def selectors_supported(redis_version: str) -> bool:
    """Whether a Redis of this version (``7.2.4``) has ACL selectors (7.0 and later)."""
    major = redis_version.split(".", 1)[0]
    return major.isdigit() and int(major) >= 7


def user_name(identity: Identity) -> str:
    """The ACL user of a tier instance: ``meridian/`` and its identity's path."""
    return USER_PREFIX + "/".join(identity.path)


def glob_escape(text: str) -> str:
    """``text`` as a Redis key pattern matching only itself."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def local_user(region: str, zone: str, *, openai: bool = False) -> RedisUser:
    """A local tier appends its zone's summaries; it reads nothing. With an OpenAI edge
    (``openai``) it also runs the edge's quota and usage scripts (``tenant_grants``)."""
    own = Grant((glob_escape(zone_stream(region, zone)),), ("xadd",))
    return _with_edge(RedisUser(user_name(local(region, zone)), (own,)), openai)


def regional_user(region: str, *, openai: bool = False) -> RedisUser:
    """A regional tier follows its zones' streams and appends its region's summaries;
    with an OpenAI edge (``openai``) it also runs the edge's quota and usage scripts."""
    zones = Grant((glob_escape(zone_stream(region, "")) + "*",), _STREAM_READ)
    own = Grant((glob_escape(region_stream(region)),), ("xadd",))
    return _with_edge(RedisUser(user_name(regional(region)), (zones, own)), openai)


def _with_edge(user: RedisUser, openai: bool) -> RedisUser:
    """``user`` with the edge's tenant grants too, when its tier serves clients OpenAI HTTP."""
    if not openai:
        return user
    return RedisUser(user.name, (*user.grants, *tenant_grants()), (*user.keyless, *_SCRIPT_LOADING))


def usage_keys(stream: str = USAGE_STREAM) -> tuple[str, str, str]:
    """The usage stream, its meta hash and (a pattern) its batch markers."""
    return (
        glob_escape(stream),
        glob_escape(meta_key(stream)),
        glob_escape(batch_key(stream, "")) + "*",
    )


def edge_user() -> RedisUser:
    """The global tier (and its OpenAI edge): follows every region's stream, runs the
    quota and lease scripts and the usage script. With selectors a script may be
    started on its keys, and each command it calls is held to its own key: the usage
    stream takes XADD only (no SET, DEL or XTRIM of the bills), the region streams
    are read only."""
    grants = (Grant((glob_escape(region_stream("")) + "*",), _STREAM_READ), *tenant_grants())
    return RedisUser(user_name(GLOBAL), grants, (*_CONNECTION, *_SCRIPT_LOADING))


def tenant_grants() -> tuple[Grant, ...]:
    """What an edge (the global tier, an inner tier's OpenAI edge) runs on the tenants'
    keys: the quota and lease scripts, the usage script (XADD only on the bills)."""
    quotas = (f"{QUOTA_PREFIX}:*", f"{LEASE_PREFIX}:*")
    usage = usage_keys()
    return (
        Grant(quotas, (*_SCRIPTS, *_QUOTA_CALLS)),
        Grant(usage, _SCRIPTS),
        *(Grant((key,), calls) for key, calls in zip(usage, _USAGE_CALLS, strict=True)),
    )


def usage_user() -> RedisUser:
    """``meridian usage``: reads the usage stream and its meta hash, writes nothing."""
    return RedisUser(USAGE, (Grant(usage_keys()[:2], _USAGE_READ),))


def admin_user() -> RedisUser:
    """The operator: every command on every key (it applies the others)."""
    return RedisUser(ADMIN, (Grant(("*",), ("@all",)),), ("@all",))


def fleet_users(topology: Topology) -> list[RedisUser]:
    """Every user a fleet needs, admin first; ``ConfigError`` naming a region or zone
    whose name cannot be part of a user name."""
    users = [admin_user(), edge_user(), usage_user()]
    for i, region in enumerate(topology.regions):
        check_segment(region.name, f"regions[{i}].name")
        users.append(regional_user(region.name, openai=region.openai is not None))
        for j, zone in enumerate(region.zones):
            check_segment(zone.name, f"regions[{i}].zones[{j}].name")
            users.append(local_user(region.name, zone.name, openai=zone.openai is not None))
    return users


def password_sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def default_rules(default: DefaultUser) -> list[str]:
    """The ``default`` user's rules (a connection that does not authenticate)."""
    if default is DefaultUser.OFF:
        return ["reset", "off", "resetchannels", "-@all"]
    return ["reset", "on", "nopass", "~*", "resetchannels", "-@all", *_OBSERVER]


def acl_file(
    users: Iterable[RedisUser],
    passwords: Mapping[str, str],
    default: DefaultUser,
    *,
    selectors: bool = False,
) -> str:
    """An ACL file (redis-server ``aclfile``) for ``users``, with the passwords of
    ``passwords`` (by user name) as SHA-256; a user without one is off. ``selectors``:
    for Redis 7 and later (``selectors_supported``)."""
    lines = [f"user default {' '.join(default_rules(default))}"]
    for user in users:
        digest = password_sha256(passwords[user.name]) if user.name in passwords else None
        lines.append(f"user {user.name} {' '.join(user.rules(digest, selectors=selectors))}")
    return "\n".join(lines) + "\n"
