"""Identity at the edge: API keys to tenants, what a tenant may ask for, and
who may call the Admin API (``AdminGuard``).

Keys are never stored: the configuration holds their SHA-256 digests, and a
presented key is hashed and looked up. A missing, malformed or unknown key is
UNAUTHENTICATED. A tenant asking for what it may not have — a priority above
its ceiling, a client region outside its allowed regions — is
PERMISSION_DENIED; a tenant that asks for no priority gets ``standard``
lowered to its ceiling. Turning authentication off (``auth.enabled: false``)
is an explicit choice for a trusted private deployment: every request is then
the ``anonymous`` tenant with no limits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets

import grpc

from common.basics.errors import RouteError
from common.config.access import ANONYMOUS, AuthConfig, TenantConfig
from common.request.routing import PRIORITY, RouteHints

AUTHORIZATION = "authorization"
KEY_PREFIX = "mk_"


# Longer authorization metadata is refused unread (a key is ~35 characters).
MAX_AUTHORIZATION_CHARS = 512


def bearer_key(metadata: object, what: str = "api key") -> str:
    """The key in ``authorization: Bearer <key>`` metadata (the last such entry);
    UNAUTHENTICATED when it is missing, not ``Bearer <key>``, or over 512 characters.
    ``what`` names the key the caller wants in the message."""
    value = None
    for key, item in metadata or ():  # type: ignore[attr-defined]
        if key == AUTHORIZATION:
            value = item
    if value is None:
        raise RouteError(
            grpc.StatusCode.UNAUTHENTICATED, f"missing 'authorization: Bearer <{what}>' metadata"
        )
    if (
        not isinstance(value, str)
        or not value.startswith("Bearer ")
        or len(value) > MAX_AUTHORIZATION_CHARS
    ):
        raise RouteError(
            grpc.StatusCode.UNAUTHENTICATED, f"metadata 'authorization' must be 'Bearer <{what}>'"
        )
    return value[len("Bearer ") :].strip()


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh API key and the SHA-256 digest to put in the configuration."""
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    return key, hash_key(key)


class Authenticator:
    """Maps ``authorization: Bearer <key>`` to a tenant and checks what it asks for."""

    def __init__(self, auth: AuthConfig) -> None:
        self.enabled = auth.enabled
        self._by_hash = {digest: t for t in auth.tenants for digest in t.key_hashes}

    def tenant(self, metadata: object) -> TenantConfig:
        """The caller's tenant; UNAUTHENTICATED when it cannot be established."""
        if not self.enabled:
            return ANONYMOUS
        tenant = self._by_hash.get(hash_key(bearer_key(metadata)))
        if tenant is None:
            raise RouteError(grpc.StatusCode.UNAUTHENTICATED, "API key not recognised")
        return tenant

    @staticmethod
    def authorise(tenant: TenantConfig, hints: RouteHints, asked_priority: bool) -> RouteHints:
        """Hints as this tenant may have them; PERMISSION_DENIED for what it may not."""
        priority = hints.priority
        ceiling = tenant.priority_ceiling
        if priority.rank < ceiling.rank:
            if asked_priority and tenant is not ANONYMOUS:
                raise RouteError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"tenant '{tenant.id}' may not use priority '{priority}' "
                    f"(its ceiling is '{ceiling}')",
                )
            priority = ceiling
        region = hints.client_region
        if tenant.allowed_regions and region is not None and region not in tenant.allowed_regions:
            raise RouteError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant '{tenant.id}' may be served only in "
                f"{', '.join(sorted(tenant.allowed_regions))}, not {region!r}",
            )
        return dataclasses.replace(
            hints,
            tenant=tenant.id,
            priority=priority,
            allowed_regions=tenant.allowed_regions,
        )


def asked_priority(metadata: object) -> bool:
    return any(key == PRIORITY for key, _ in metadata or ())  # type: ignore[attr-defined]


class AdminGuard:
    """Who may call the Admin API at the edge.

    With admin keys configured (``auth.admin_keys``) a caller must present one,
    whatever ``auth.enabled`` says. Without any, the API is open to every client
    when authentication is off (a trusted private deployment) and closed to
    everyone when it is on. A reload takes the new file's admin keys only:
    ``auth.enabled`` and the tenants (named when their key is refused) stay as
    they were at start, as the reload's reply says.
    """

    def __init__(self, auth: AuthConfig) -> None:
        self.enabled = auth.enabled
        self.tenants = {d: t.id for t in auth.tenants for d in t.key_hashes}
        self.admin = auth.admin_key_hashes

    def take_admin_keys(self, auth: AuthConfig) -> list[str]:
        """A reloaded topology: its admin keys replace the old ones, except any that is
        the key of a tenant this guard still knows (tenants change only at restart).
        Returns what was refused, for the reload's reply."""
        clash = auth.admin_key_hashes & self.tenants.keys()
        self.admin = auth.admin_key_hashes - clash
        return [
            f"auth.admin_keys: a key of tenant {self.tenants[d]!r}, still valid until restart"
            for d in sorted(clash)
        ]

    @property
    def open(self) -> bool:
        return not self.enabled and not self.admin

    def check(self, metadata: object) -> None:
        """Raise UNAUTHENTICATED (no or unknown key) or PERMISSION_DENIED (a tenant's key)."""
        if self.open:
            return
        digest = hash_key(bearer_key(metadata, "admin key"))
        if digest in self.admin:
            return
        if digest in self.tenants:
            raise RouteError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the key of tenant '{self.tenants[digest]}' may not call the Admin API; "
                "use an admin key (auth.admin_keys)",
            )
        raise RouteError(grpc.StatusCode.UNAUTHENTICATED, "admin key not recognised")
