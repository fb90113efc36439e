"""``meridian redis-acl``: the Redis ACL users of a topology, their passwords, applied.

  meridian redis-acl passwords --config T --dir DIR     a password file per user (0600)
  meridian redis-acl render    --config T --dir DIR     the ACL file (aclfile), hashed
  meridian redis-acl apply     --config T --dir DIR     ACL SETUSER on each Redis of T

A user's password lives in ``DIR/<user without meridian/>`` (``DIR/local/R/Z``,
``DIR/global``, ``DIR/usage``, ``DIR/admin``), mirroring the certificates'
layout: hand each process only its own file (``--redis-password-file``). The
rendered file and the commands carry SHA-256 digests, never a password. ``apply``
logs in as ``meridian/admin`` when it exists already, else as the URL says (the
first time: the ``default`` user, with ``requirepass`` if set), sets every user,
and the ``default`` user last; it saves them (``ACL SAVE``) when Redis was started
with an ``aclfile``. Which user may touch which key: ``common.operations.redis_acl``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Iterable
from pathlib import Path

import redis

from cli.options import HelpFormatter
from common.basics.redis_embed import redis_server_version
from common.basics.redis_url import redact, sync_redis, with_credentials
from common.config.node import ConfigError
from common.config.topology import Topology, load_topology
from common.operations.redis_acl import (
    ADMIN,
    USER_PREFIX,
    DefaultUser,
    RedisUser,
    acl_file,
    default_rules,
    fleet_users,
    password_sha256,
    selectors_supported,
)


def write_passwords(directory: Path, users: Iterable[RedisUser]) -> list[str]:
    """A fresh random password for each user that has no file yet (files 0600,
    directories 0700); the users that got one."""
    created = []
    for user in users:
        path = directory / user.password_file()
        if path.exists():
            continue
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
        created.append(user.name)
    return created


def read_passwords(directory: Path, users: Iterable[RedisUser]) -> dict[str, str]:
    """Every user's password by user name; ``ConfigError`` naming a missing or empty file."""
    out = {}
    for user in users:
        path = directory / user.password_file()
        try:
            password = path.read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(
                f"--dir: no password for {user.name} ({path}: {exc.strerror}); "
                "meridian redis-acl passwords writes the missing ones"
            ) from None
        if not password:
            raise ConfigError(f"--dir: the password file of {user.name} ({path}) is empty")
        out[user.name] = password
    return out


def topology_redis_urls(topology: Topology) -> list[str]:
    """Every Redis the topology names, each once (the global one first)."""
    urls = [topology.redis_url, *(r.redis_url for r in topology.regions if r.redis_url)]
    return list(dict.fromkeys(urls))


def _admin_client(url: str, admin_password: str) -> redis.Redis:
    """A client logged in as ``meridian/admin`` if that user exists already, else as
    ``url`` says."""
    client = sync_redis(with_credentials(url, ADMIN, admin_password), socket_timeout=5.0)
    try:
        client.ping()
        return client
    except redis.AuthenticationError:
        client.close()
    return sync_redis(url, socket_timeout=5.0)


def apply_users(
    url: str, users: list[RedisUser], passwords: dict[str, str], default: DefaultUser
) -> bool:
    """Set ``users`` (then the ``default`` user) on the Redis at ``url``; True when
    Redis saved them to its ACL file."""
    client = _admin_client(url, passwords[ADMIN])
    try:
        selectors = selectors_supported(str(client.info("server")["redis_version"]))
        for user in users:
            rules = user.rules(password_sha256(passwords[user.name]), selectors=selectors)
            client.execute_command("ACL", "SETUSER", user.name, *rules)
        client.execute_command("ACL", "SETUSER", "default", *default_rules(default))
        try:
            client.execute_command("ACL", "SAVE")
        except redis.ResponseError:  # started without an aclfile: only in memory
            return False
        return True
    finally:
        client.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meridian redis-acl",
        description="Redis ACL users per role (Redis 6+): passwords, ACL file, apply.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("action", choices=("passwords", "render", "apply"), help="what to do")
    parser.add_argument("--config", required=True, metavar="FILE", help="topology YAML")
    parser.add_argument(
        "--dir", required=True, metavar="DIR", help="the password files, one per user"
    )
    parser.add_argument(
        "--default",
        choices=[d.value for d in DefaultUser],
        default=DefaultUser.OFF.value,
        help="what a connection that does not log in may do",
    )
    parser.add_argument(
        "--redis",
        metavar="URL",
        action="append",
        help="apply: this Redis (repeatable; default: every Redis the topology names)",
    )
    parser.add_argument("--out", metavar="FILE", help="render: write here (mode 0600), not stdout")
    parser.add_argument(
        "--redis-version",
        default="7.0",
        metavar="VERSION",
        help="render: for this Redis (7.0 and later: a selector per grant; apply asks Redis)",
    )
    return parser


def redis_acl_main(argv: list[str] | None = None) -> int:
    """``meridian redis-acl``; exit code 2 on a bad argument, file or unreachable Redis."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    try:
        return _run(args)
    except ConfigError as exc:
        print(f"meridian redis-acl: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    users = fleet_users(load_topology(args.config))
    directory, default = Path(args.dir), DefaultUser(args.default)
    if args.action == "passwords":
        for name in write_passwords(directory, users):
            print(f"wrote a password for {name}")
        return 0
    passwords = read_passwords(directory, users)
    if args.action == "render":
        selectors = selectors_supported(args.redis_version)
        text = acl_file(users, passwords, default, selectors=selectors)
        if args.out is None:
            sys.stdout.write(text)
        else:
            fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(text)
        return 0
    for url in args.redis or topology_redis_urls(load_topology(args.config)):
        try:
            saved = apply_users(url, users, passwords, default)
        except (redis.RedisError, OSError) as exc:
            print(f"meridian redis-acl: {redact(url)}: {exc}", file=sys.stderr)
            return 2
        kept = "saved to its aclfile" if saved else "in memory only: no aclfile to save to"
        print(f"{redact(url)}: {len(users)} users and default ({default.value}); {kept}")
    return 0


ACL_FILE = "users.acl"


class FleetAcl:
    """The ACL of a fleet on one machine (``meridian up``): passwords and an ACL file
    in ``directory``, which the embedded Redis servers load (``--aclfile``) and each
    tier process logs in from (``--redis-password-file``, its own file only). The
    ``default`` user may read and not write (``DefaultUser.READ_ONLY``): tools, tests
    and dashboards on the machine read without a password, every write needs a role.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.acl_file = directory / ACL_FILE

    def write(self, topology: Topology) -> None:
        """Passwords for users that have none yet (a run directory used again keeps
        them), then the ACL file for every user of ``topology``."""
        users = fleet_users(topology)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_passwords(self.directory, users)
        passwords = read_passwords(self.directory, users)
        selectors = selectors_supported(redis_server_version())
        text = acl_file(users, passwords, DefaultUser.READ_ONLY, selectors=selectors)
        fd = os.open(self.acl_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)

    def password_file(self, user: str) -> Path:
        return self.directory / user.removeprefix(USER_PREFIX)
