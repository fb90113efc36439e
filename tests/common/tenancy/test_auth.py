"""common.tenancy.auth: API keys to tenants, what a tenant may ask for, the Admin API guard."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from common.basics.errors import RouteError
from common.basics.vocabulary import Priority
from common.config.access import AuthConfig, TenantConfig
from common.request.routing import CLIENT_REGION, PRIORITY, RouteHints, parse_hints
from common.tenancy.auth import (
    MAX_AUTHORIZATION_CHARS,
    AdminGuard,
    Authenticator,
    asked_priority,
    bearer_key,
    hash_key,
    new_key,
)

ACME_KEY = "mk_acme-key"
GLOBEX_KEY = "mk_globex-key"
ADMIN_KEY = "mk_admin-key"

ACME = TenantConfig(id="acme", key_hashes=frozenset({hash_key(ACME_KEY)}))
# Sheddable at best, served in eu-west only.
GLOBEX = TenantConfig(
    id="globex",
    key_hashes=frozenset({hash_key(GLOBEX_KEY)}),
    priority_ceiling=Priority.SHEDDABLE,
    allowed_regions=frozenset({"eu-west"}),
)
CRITICAL = TenantConfig(id="vip", key_hashes=frozenset(), priority_ceiling=Priority.CRITICAL)

Metadata = list[tuple[str, str]]


def auth(enabled: bool = True, admin: bool = False) -> AuthConfig:
    return AuthConfig(
        enabled=enabled,
        tenants=(ACME, GLOBEX),
        admin_key_hashes=frozenset({hash_key(ADMIN_KEY)}) if admin else frozenset(),
    )


def bearer(key: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {key}")


def refusal(call: Callable[..., object], *args: object) -> RouteError:
    with pytest.raises(RouteError) as info:
        call(*args)
    return info.value


def hints(metadata: Metadata) -> RouteHints:
    return parse_hints(metadata, trust_internal=False)


# ------------------------------------------------------------------ bearer_key


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        pytest.param([bearer("mk_abc")], "mk_abc", id="plain"),
        pytest.param([bearer("  mk_abc  ")], "mk_abc", id="surrounding-spaces-stripped"),
        pytest.param([bearer("mk_old"), ("x", "y"), bearer("mk_new")], "mk_new", id="last-wins"),
        pytest.param(
            [("authorization", "Bearer " + "k" * (MAX_AUTHORIZATION_CHARS - 7))],
            "k" * (MAX_AUTHORIZATION_CHARS - 7),
            id="exactly-the-limit",
        ),
    ],
)
def test_bearer_key_reads(metadata: Metadata, key: str) -> None:
    assert bearer_key(metadata) == key


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        pytest.param(None, "missing", id="no-metadata"),
        pytest.param([], "missing", id="empty-metadata"),
        pytest.param([("x-other", "Bearer mk_abc")], "missing", id="other-key-only"),
        pytest.param([("authorization", "mk_abc")], "must be 'Bearer", id="no-scheme"),
        pytest.param([("authorization", "Basic abc")], "must be 'Bearer", id="basic-scheme"),
        pytest.param([("authorization", "bearer mk_abc")], "must be 'Bearer", id="lowercase"),
        pytest.param([("authorization", b"Bearer mk_abc")], "must be 'Bearer", id="binary-value"),
        pytest.param(
            [("authorization", "Bearer " + "k" * (MAX_AUTHORIZATION_CHARS - 6))],
            "must be 'Bearer",
            id="one-over-the-limit",
        ),
    ],
)
def test_bearer_key_refuses(metadata: object, words: str) -> None:
    err = refusal(bearer_key, metadata)
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    assert words in err.message
    assert "<api key>" in err.message


def test_bearer_key_names_what_it_wants() -> None:
    err = refusal(bearer_key, [], "admin key")
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    assert "<admin key>" in err.message


def test_new_key_is_prefixed_and_its_digest_matches() -> None:
    key, digest = new_key()
    assert key.startswith("mk_")
    assert digest == hash_key(key)
    assert len(digest) == 64
    assert new_key()[0] != key


# ------------------------------------------------------------------ Authenticator.tenant


def test_tenant_by_key() -> None:
    authn = Authenticator(auth())
    assert authn.tenant([bearer(ACME_KEY)]) is ACME
    assert authn.tenant([bearer(GLOBEX_KEY)]) is GLOBEX


def test_unknown_key_is_unauthenticated() -> None:
    err = refusal(Authenticator(auth()).tenant, [bearer("mk_nobody")])
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    assert "not recognised" in err.message


def test_missing_key_is_unauthenticated() -> None:
    err = refusal(Authenticator(auth()).tenant, [])
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    assert "missing" in err.message


def test_admin_key_is_not_a_tenant_key() -> None:
    err = refusal(Authenticator(auth(admin=True)).tenant, [bearer(ADMIN_KEY)])
    assert err.code == grpc.StatusCode.UNAUTHENTICATED


def test_auth_off_everyone_is_anonymous_with_no_limits() -> None:
    tenant = Authenticator(auth(enabled=False)).tenant([])
    assert tenant.id == "anonymous"
    assert tenant.requests_per_s is None
    assert tenant.tokens_per_min is None
    assert tenant.max_concurrent is None
    assert tenant.allowed_regions == frozenset()


# ------------------------------------------------------------------ Authenticator.authorise


def authorise(tenant: TenantConfig, metadata: Metadata) -> RouteHints:
    return Authenticator.authorise(tenant, hints(metadata), asked_priority(metadata))


@pytest.mark.parametrize(
    ("tenant", "metadata", "priority"),
    [
        pytest.param(ACME, [], "standard", id="standard-tenant-asks-nothing"),
        pytest.param(ACME, [(PRIORITY, "standard")], "standard", id="standard-asks-standard"),
        pytest.param(ACME, [(PRIORITY, "sheddable")], "sheddable", id="below-ceiling-kept"),
        pytest.param(CRITICAL, [(PRIORITY, "critical")], "critical", id="critical-ceiling"),
        pytest.param(GLOBEX, [], "sheddable", id="default-lowered-to-ceiling"),
        pytest.param(GLOBEX, [(PRIORITY, "sheddable")], "sheddable", id="asks-its-ceiling"),
    ],
)
def test_authorise_priority(tenant: TenantConfig, metadata: Metadata, priority: str) -> None:
    out = authorise(tenant, metadata)
    assert out.priority == priority
    assert out.tenant == tenant.id
    assert out.allowed_regions == tenant.allowed_regions


@pytest.mark.parametrize(
    ("tenant", "asked", "ceiling"),
    [
        pytest.param(ACME, "critical", "standard", id="standard-asks-critical"),
        pytest.param(GLOBEX, "standard", "sheddable", id="sheddable-asks-standard"),
        pytest.param(GLOBEX, "critical", "sheddable", id="sheddable-asks-critical"),
    ],
)
def test_authorise_priority_above_ceiling_is_denied(
    tenant: TenantConfig, asked: str, ceiling: str
) -> None:
    err = refusal(authorise, tenant, [(PRIORITY, asked)])
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    assert f"'{tenant.id}'" in err.message
    assert f"priority '{asked}'" in err.message
    assert f"ceiling is '{ceiling}'" in err.message


def test_anonymous_asking_critical_is_lowered_not_denied() -> None:
    anonymous = Authenticator(auth(enabled=False)).tenant([])
    out = authorise(anonymous, [(PRIORITY, "critical")])
    assert out.priority == "standard"
    assert out.tenant == "anonymous"


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param([(CLIENT_REGION, "eu-west")], id="allowed-region"),
        pytest.param([], id="no-region-declared"),
    ],
)
def test_authorise_allowed_region(metadata: Metadata) -> None:
    out = authorise(GLOBEX, metadata)
    assert out.allowed_regions == frozenset({"eu-west"})
    assert out.client_region == (metadata[0][1] if metadata else None)


def test_authorise_region_outside_allowed_is_denied() -> None:
    err = refusal(authorise, GLOBEX, [(CLIENT_REGION, "us-east")])
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    assert "'globex'" in err.message
    assert "eu-west" in err.message
    assert "'us-east'" in err.message


def test_authorise_any_region_without_allowed_regions() -> None:
    out = authorise(ACME, [(CLIENT_REGION, "us-east")])
    assert out.client_region == "us-east"
    assert out.allowed_regions == frozenset()


def test_asked_priority() -> None:
    assert asked_priority([(PRIORITY, "standard")])
    assert not asked_priority([("x-meridian-session", "s")])
    assert not asked_priority(None)


# ------------------------------------------------------------------ AdminGuard


@pytest.mark.parametrize(
    ("enabled", "admin", "is_open"),
    [
        pytest.param(False, False, True, id="auth-off-no-admin-keys-open"),
        pytest.param(True, False, False, id="auth-on-no-admin-keys-closed"),
        pytest.param(False, True, False, id="auth-off-admin-keys-closed"),
        pytest.param(True, True, False, id="auth-on-admin-keys-closed"),
    ],
)
def test_admin_guard_open(enabled: bool, admin: bool, is_open: bool) -> None:
    assert AdminGuard(auth(enabled, admin)).open is is_open


def test_admin_guard_open_lets_anyone_in() -> None:
    AdminGuard(auth(enabled=False)).check([])


@pytest.mark.parametrize("enabled", [True, False], ids=["auth-on", "auth-off"])
def test_admin_guard_admits_an_admin_key(enabled: bool) -> None:
    AdminGuard(auth(enabled, admin=True)).check([bearer(ADMIN_KEY)])


@pytest.mark.parametrize(
    ("enabled", "admin", "metadata", "code", "words"),
    [
        pytest.param(
            True, False, [bearer(ADMIN_KEY)], "UNAUTHENTICATED", "not recognised",
            id="closed-without-admin-keys",
        ),
        pytest.param(
            True, True, [], "UNAUTHENTICATED", "<admin key>", id="no-key",
        ),
        pytest.param(
            False, True, [bearer("mk_nobody")], "UNAUTHENTICATED", "not recognised",
            id="unknown-key",
        ),
        pytest.param(
            True, True, [bearer(ACME_KEY)], "PERMISSION_DENIED", "tenant 'acme'",
            id="tenant-key",
        ),
        pytest.param(
            False, True, [bearer(GLOBEX_KEY)], "PERMISSION_DENIED", "auth.admin_keys",
            id="tenant-key-auth-off",
        ),
    ],
)  # fmt: skip
def test_admin_guard_refuses(
    enabled: bool, admin: bool, metadata: Metadata, code: str, words: str
) -> None:
    err = refusal(AdminGuard(auth(enabled, admin)).check, metadata)
    assert err.code == grpc.StatusCode[code]
    assert words in err.message


def test_take_admin_keys_replaces_the_old_ones() -> None:
    guard = AdminGuard(auth(admin=True))
    new_admin = "mk_new-admin"
    refused = guard.take_admin_keys(
        AuthConfig(enabled=True, admin_key_hashes=frozenset({hash_key(new_admin)}))
    )
    assert refused == []
    guard.check([bearer(new_admin)])
    err = refusal(guard.check, [bearer(ADMIN_KEY)])
    assert err.code == grpc.StatusCode.UNAUTHENTICATED


def test_take_admin_keys_refuses_a_known_tenants_key() -> None:
    guard = AdminGuard(auth(admin=True))
    refused = guard.take_admin_keys(
        AuthConfig(
            enabled=True,
            admin_key_hashes=frozenset({hash_key(ACME_KEY), hash_key(ADMIN_KEY)}),
        )
    )
    assert len(refused) == 1
    assert "auth.admin_keys" in refused[0]
    assert "'acme'" in refused[0]
    assert "until restart" in refused[0]
    guard.check([bearer(ADMIN_KEY)])
    err = refusal(guard.check, [bearer(ACME_KEY)])
    assert err.code == grpc.StatusCode.PERMISSION_DENIED


def test_take_no_admin_keys_closes_an_auth_on_guard() -> None:
    guard = AdminGuard(auth(admin=True))
    guard.take_admin_keys(AuthConfig(enabled=False))
    assert not guard.open  # auth.enabled stays as it was at start
    err = refusal(guard.check, [bearer(ADMIN_KEY)])
    assert err.code == grpc.StatusCode.UNAUTHENTICATED


def test_take_no_admin_keys_opens_an_auth_off_guard() -> None:
    guard = AdminGuard(auth(enabled=False, admin=True))
    guard.take_admin_keys(AuthConfig(enabled=True))
    assert guard.open
    guard.check([])
