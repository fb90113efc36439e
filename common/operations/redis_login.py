"""How a process logs in to Redis: as its role's ACL user, over TLS with the fleet's CA.

The user is the process's role (``common.operations.redis_acl``); its password
comes from a file or the environment, read once at start, never from the
topology (which is shared by every process and often checked in):

1. ``--redis-password-file FILE`` (a mounted Kubernetes Secret, a file the
   launcher wrote with mode 0600);
2. else ``$MERIDIAN_REDIS_PASSWORD_FILE``, the same as an environment variable;
3. else ``$MERIDIAN_REDIS_PASSWORD``, the password itself.

None of them: the process logs in as its URL says (the ``default`` user, or a
user the URL names): Redis without ACL users keeps working as it did. A file's
trailing newline is not part of the password.

A ``rediss://`` URL that names no CA of its own (``ssl_ca_certs``) is verified
against the topology's fleet CA (``tls.ca``), and the process presents its own
instance certificate (``tls.certs``), so a Redis with ``tls-auth-clients yes``
admits only the fleet's processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from common.basics.redis_url import with_credentials, with_tls_files
from common.config.identity import Identity
from common.config.node import ConfigError
from common.config.topology import Topology

PASSWORD_FILE_ENV = "MERIDIAN_REDIS_PASSWORD_FILE"
PASSWORD_ENV = "MERIDIAN_REDIS_PASSWORD"


def read_password(file: str | None, environ: Mapping[str, str]) -> str | None:
    """The password from ``file``, else from the environment (see above); None when no
    source is given; ``ConfigError`` naming the source when it is unreadable or empty."""
    if file is None and environ.get(PASSWORD_FILE_ENV):
        file, source = environ[PASSWORD_FILE_ENV], f"${PASSWORD_FILE_ENV}"
    else:
        source = "--redis-password-file"
    if file is not None:
        try:
            password = Path(file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read {file!r}: {exc.strerror}") from None
        if not password:
            raise ConfigError(f"{source}: {file!r} is empty; it must hold the Redis password")
        return password
    if PASSWORD_ENV in environ:
        if not environ[PASSWORD_ENV]:
            raise ConfigError(f"${PASSWORD_ENV} is set but empty")
        return environ[PASSWORD_ENV]
    return None


@dataclass(frozen=True)
class RedisLogin:
    """Who a process is towards Redis: ``user`` with ``password`` (None: as each URL
    says), and the TLS files a ``rediss://`` URL is completed with (None: none)."""

    user: str
    password: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def url(self, url: str) -> str:
        """``url`` logging in as this process."""
        if self.password is not None:
            url = with_credentials(url, self.user, self.password)
        if self.ca is not None:
            url = with_tls_files(url, self.ca, self.cert, self.key)
        return url


def tier_login(
    topology: Topology, user: str, password: str | None, identity: Identity | None
) -> RedisLogin:
    """``user``'s login, with the fleet's CA and ``identity``'s certificate and key when
    the topology has a ``tls`` section (the certificate only when its files exist: the
    ``usage`` command has none)."""
    tls = topology.tls
    if tls is None:
        return RedisLogin(user, password)
    cert = key = None
    if identity is not None and tls.cert_file(identity).is_file():
        cert, key = str(tls.cert_file(identity)), str(tls.key_file(identity))
    return RedisLogin(user, password, tls.ca, cert, key)


def with_login(topology: Topology, login: RedisLogin) -> Topology:
    """``topology`` with every Redis URL it names logging in as ``login``."""
    try:
        regions = tuple(
            dataclasses.replace(r, redis_url=login.url(r.redis_url)) if r.redis_url else r
            for r in topology.regions
        )
        return dataclasses.replace(
            topology, redis_url=login.url(topology.redis_url), regions=regions
        )
    except ValueError as exc:
        raise ConfigError(f"redis_url: {exc}") from None
