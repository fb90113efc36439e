"""Redis ACL users, one per role: each process may touch only the keys its role needs.

A process authenticates as the user of its place in the fleet (the names follow
``common.config.identity``); the keys are those of ``common.config.redis_layout``:

====================================  ===============================================  ==========
user                                  keys (commands)                                  writes
====================================  ===============================================  ==========
``meridian/local/<R>/<Z>``            its zone's summary stream (XADD)                 that stream
``meridian/regional/<R>``             R's zone streams (XREAD, XREVRANGE); R's region  R's streams
                                      stream (XADD)
``meridian/global``                   region streams (XREAD, XREVRANGE); quota and     quotas,
                                      lease keys and the usage stream, its meta hash   leases,
                                      and batch markers (the quota and usage scripts)  usage
``meridian/usage``                    the usage stream and its meta hash (XRANGE,      nothing
                                      XINFO STREAM, HGETALL)
``meridian/admin``                    everything (the operator's; applies the users)   anything
====================================  ===============================================  ==========

The edge runs its quota and usage Lua scripts with EVALSHA/EVAL; Redis checks
every command a script calls against the calling user's commands and keys, so
EVAL widens nothing: the commands the scripts call are granted on the edge's
keys only. Redis 6 grants a key pattern for reading and writing alike, so a
regional tier could also append to its own zones' streams and the edge delete its
own quota keys: within what each already decides, never another region's or
another role's keys. The ``default`` user (no password) is turned off, or, for a
fleet on one machine, may read everything and write nothing (``DefaultUser``).

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
from common.config.node import ConfigError
from common.config.topology import Topology
from common.tenancy.usage_record import USAGE_STREAM, batch_key, meta_key

USER_PREFIX = "meridian/"
ADMIN = "meridian/admin"
USAGE = "meridian/usage"
QUOTA_PREFIX = "meridian:quota"
LEASE_PREFIX = "meridian:concurrency"

# What every user may do on its connection besides its role's commands (SELECT:
# a URL may name a database; key patterns hold in every database alike).
_CONNECTION = ("ping", "select")
_STREAM_READ = ("xread", "xrevrange")
_STREAM_WRITE = ("xadd",)
# The edge's scripts (common.tenancy.quota_scripts, common.tenancy.usage): sent by
# EVALSHA, loaded by SCRIPT LOAD or EVAL, and the commands they call; WAIT for
# usage_replicas_ack.
_SCRIPTS = ("evalsha", "eval", "script|load", "script|exists")
_SCRIPT_CALLS = (
    "time", "get", "set", "del", "exists", "expire", "pexpire",
    "zadd", "zrem", "zcard", "zremrangebyscore",
    "hset", "hsetnx", "hincrby", "xadd",
)  # fmt: skip
_USAGE_READ = ("xrange", "xrevrange", "xinfo|stream", "xlen", "hgetall")
_OBSERVER = ("+@read", "+info", "+ping", "+select")

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


class DefaultUser(enum.Enum):
    """What a connection that does not authenticate may do."""

    OFF = "off"  # nothing: every process names its user (production)
    READ_ONLY = "read-only"  # read any key, write none (a fleet on one machine)


@dataclass(frozen=True)
class RedisUser:
    """One ACL user: who, which keys (glob patterns), which commands."""

    name: str
    keys: tuple[str, ...]
    commands: tuple[str, ...]

    def rules(self, password_sha256: str | None) -> list[str]:
        """Its ``ACL SETUSER`` rules, from a clean slate (``reset``); without a
        password the user is off (nobody can log in as it)."""
        login = ["on", f"#{password_sha256}"] if password_sha256 else ["off"]
        keys = [f"~{pattern}" for pattern in self.keys]
        return ["reset", *login, *keys, "resetchannels", "-@all", *self.commands]

    def password_file(self) -> str:
        """Where its password lives under a passwords directory (``local/R/Z``)."""
        return self.name.removeprefix(USER_PREFIX)


def user_name(identity: Identity) -> str:
    """The ACL user of a tier instance: ``meridian/`` and its identity's path."""
    return USER_PREFIX + "/".join(identity.path)


def glob_escape(text: str) -> str:
    """``text`` as a Redis key pattern matching only itself."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def _grant(commands: Iterable[str]) -> tuple[str, ...]:
    return tuple(f"+{c}" for c in (*_CONNECTION, *commands))


def local_user(region: str, zone: str) -> RedisUser:
    """A local tier appends its zone's summaries; it reads nothing."""
    return RedisUser(
        user_name(local(region, zone)),
        (glob_escape(zone_stream(region, zone)),),
        _grant(_STREAM_WRITE),
    )


def regional_user(region: str) -> RedisUser:
    """A regional tier follows its zones' streams and appends its region's summaries."""
    zones = glob_escape(zone_stream(region, "")) + "*"
    return RedisUser(
        user_name(regional(region)),
        (zones, glob_escape(region_stream(region))),
        _grant((*_STREAM_READ, *_STREAM_WRITE)),
    )


def usage_keys(stream: str = USAGE_STREAM) -> tuple[str, str, str]:
    """The usage stream, its meta hash and (a pattern) its batch markers."""
    return (
        glob_escape(stream),
        glob_escape(meta_key(stream)),
        glob_escape(batch_key(stream, "")) + "*",
    )


def edge_user() -> RedisUser:
    """The global tier (and its OpenAI edge): follows every region's stream, runs the
    quota and lease scripts and writes usage records."""
    keys = (
        glob_escape(region_stream("")) + "*",
        f"{QUOTA_PREFIX}:*",
        f"{LEASE_PREFIX}:*",
        *usage_keys(),
    )
    return RedisUser(
        user_name(GLOBAL), keys, _grant((*_STREAM_READ, *_SCRIPTS, *_SCRIPT_CALLS, "wait"))
    )


def usage_user() -> RedisUser:
    """``meridian usage``: reads the usage stream and its meta hash, writes nothing."""
    return RedisUser(USAGE, usage_keys()[:2], _grant(_USAGE_READ))


def admin_user() -> RedisUser:
    """The operator: every command on every key (it applies the others)."""
    return RedisUser(ADMIN, ("*",), ("+@all",))


def fleet_users(topology: Topology) -> list[RedisUser]:
    """Every user a fleet needs, admin first; ``ConfigError`` naming a region or zone
    whose name cannot be part of a user name."""
    users = [admin_user(), edge_user(), usage_user()]
    for i, region in enumerate(topology.regions):
        check_segment(region.name, f"regions[{i}].name")
        users.append(regional_user(region.name))
        for j, zone in enumerate(region.zones):
            check_segment(zone.name, f"regions[{i}].zones[{j}].name")
            users.append(local_user(region.name, zone.name))
    return users


def password_sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def default_rules(default: DefaultUser) -> list[str]:
    """The ``default`` user's rules (a connection that does not authenticate)."""
    if default is DefaultUser.OFF:
        return ["reset", "off", "resetchannels", "-@all"]
    return ["reset", "on", "nopass", "~*", "resetchannels", "-@all", *_OBSERVER]


def acl_file(users: Iterable[RedisUser], passwords: Mapping[str, str], default: DefaultUser) -> str:
    """An ACL file (redis-server ``aclfile``) for ``users``, with the passwords of
    ``passwords`` (by user name) as SHA-256; a user without one is off."""
    lines = [f"user default {' '.join(default_rules(default))}"]
    for user in users:
        digest = password_sha256(passwords[user.name]) if user.name in passwords else None
        lines.append(f"user {user.name} {' '.join(user.rules(digest))}")
    return "\n".join(lines) + "\n"


def role_user(command: str, region: str = "", zone: str = "") -> str:
    """The user a ``meridian`` command runs as: ``global``, ``regional`` (of ``region``),
    ``local`` (of ``region``/``zone``) or ``usage``."""
    if command == "global":
        return user_name(GLOBAL)
    if command == "regional":
        return user_name(regional(region))
    if command == "local":
        return user_name(local(region, zone))
    if command == "usage":
        return USAGE
    raise ConfigError(f"no Redis user for the command {command!r}")
