"""The topology's key directives and its ``auth`` section, split for a cluster.

``api_key: generate``, ``auth.admin_key: generate`` and ``auth.operator_key:
generate`` are launcher directives (``cli.launcher``). Rendered manifests must
be the same on every run, so by default a tenant that says ``generate`` gets no
key: its entry is rendered with ``api_key_sha256: []`` and named in ``pending``
(the operator adds digests from ``meridian keygen`` to the Secret).
``generate=True`` makes fresh keys instead, returned once (the digests go into
the Secret, the keys nowhere else).

The key digests live in a Secret (``auth.yaml``, the whole ``auth`` section);
the ConfigMap's topology keeps the tenants (ids, limits, weights: every tier
labels metrics and weighs fairness by them) without any digest.
The operator keys' digests (``auth.operator_key_sha256``) are in the Secret
only, so only the global tier's ops HTTP can check them: with ``auth.enabled``
the inner tiers' ``/api/*`` refuse every key (closed, not open), and the
dashboard shows them as refusing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from common.tenancy.auth import new_key

GENERATE = "generate"


@dataclass
class Keys:
    """What became of the directives: fresh keys by tenant id, and who still needs one."""

    fresh: dict[str, str] = field(default_factory=dict)
    admin_key: str | None = None
    operator_key: str | None = None
    pending: list[str] = field(default_factory=list)


def resolve_directives(raw: dict[str, Any], *, generate: bool) -> Keys:
    """Replace ``generate`` directives in ``raw`` (in place)."""
    keys = Keys()
    auth = raw.get("auth")
    if not isinstance(auth, dict):
        return keys
    for tenant in auth.get("tenants") or []:
        if isinstance(tenant, dict) and tenant.get("api_key") == GENERATE:
            del tenant["api_key"]
            digests = tenant.setdefault("api_key_sha256", [])
            tenant_id = str(tenant.get("id"))
            if generate:
                key, digest = new_key()
                digests.append(digest)
                keys.fresh[tenant_id] = key
            elif not digests:
                keys.pending.append(f"tenant {tenant_id}")
    if auth.get("admin_key") == GENERATE:
        del auth["admin_key"]
        if generate:
            key, digest = new_key()
            auth.setdefault("admin_keys", []).append(digest)
            keys.admin_key = key
        elif not auth.get("admin_keys"):
            keys.pending.append("the Admin API")
    if auth.get("operator_key") == GENERATE:
        del auth["operator_key"]
        if generate:
            key, digest = new_key()
            auth.setdefault("operator_key_sha256", []).append(digest)
            keys.operator_key = key
        elif not auth.get("operator_key_sha256"):
            keys.pending.append("the ops HTTP's /api/*")
    return keys


def public_auth(auth: dict[str, Any]) -> dict[str, Any]:
    """The ``auth`` section without a single key digest (for the ConfigMap)."""
    out = copy.deepcopy(auth)
    out.pop("admin_keys", None)
    out.pop("operator_key_sha256", None)
    for tenant in out.get("tenants") or []:
        if isinstance(tenant, dict):
            tenant["api_key_sha256"] = []
    return out
