"""Each tier instance's certificate: cert-manager Certificates, or Secrets from files.

``--tls cert-manager`` (the default) renders a self-signed bootstrap Issuer, the
fleet CA as a cert-manager Certificate, a CA Issuer signing with it, and one
Certificate per identity (``common.config.identity``) carrying its URI SAN and
the DNS names it is dialled at, into the Secret its pods mount. No key material
is in the manifests. ``--tls secrets`` embeds the files a topology's ``tls``
section names (``ca``, ``certs/<identity>/cert.pem``, ``key.pem``) as
``kubernetes.io/tls`` Secrets of the same layout (``tls.crt``, ``tls.key``,
``ca.crt``), private keys included: keep such a rendering out of version control.
A tier reads its certificate once at start: a renewed one is used from the next
restart (``kubectl rollout restart``), so renewal (``renewBefore``) leaves weeks.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cli.k8s.names import APP, NAME, PART_OF, fqdn
from cli.k8s.options import RenderOptions
from cli.k8s.plan import Plan
from cli.k8s.pods import tls_secret
from common.config.identity import Identity
from common.config.node import ConfigError

CA_NAME = "meridian-ca"
BOOTSTRAP = "meridian-selfsigned"
_LABELS = {NAME: APP, PART_OF: APP}
_KEY = {"algorithm": "ECDSA", "size": 256, "encoding": "PKCS8", "rotationPolicy": "Always"}


def identities(plan: Plan) -> list[tuple[Identity, list[str]]]:
    """Each identity to issue with the DNS names it is dialled at (GPU servers: none,
    they are dialled on loopback)."""
    out: list[tuple[Identity, list[str]]] = []
    for instance in plan.instances:
        for identity in instance.identities:
            if identity.kind == "gpu":
                out.append((identity, []))
            else:
                out.append((identity, [instance.name]))
    return out


def _meta(name: str, options: RenderOptions) -> dict[str, Any]:
    return {"name": name, "namespace": options.namespace, "labels": dict(_LABELS)}


def cert_manager(plan: Plan, options: RenderOptions) -> list[dict[str, Any]]:
    api = "cert-manager.io/v1"
    issuer_ref = {"name": CA_NAME, "kind": "Issuer", "group": "cert-manager.io"}
    out: list[dict[str, Any]] = [
        {
            "apiVersion": api,
            "kind": "Issuer",
            "metadata": _meta(BOOTSTRAP, options),
            "spec": {"selfSigned": {}},
        },
        {
            "apiVersion": api,
            "kind": "Certificate",
            "metadata": _meta(CA_NAME, options),
            "spec": {
                "isCA": True,
                "commonName": "Meridian fleet CA",
                "secretName": CA_NAME,
                "duration": "87600h",
                "privateKey": dict(_KEY),
                "issuerRef": {"name": BOOTSTRAP, "kind": "Issuer", "group": "cert-manager.io"},
            },
        },
        {
            "apiVersion": api,
            "kind": "Issuer",
            "metadata": _meta(CA_NAME, options),
            "spec": {"ca": {"secretName": CA_NAME}},
        },
    ]
    for identity, services in identities(plan):
        spec: dict[str, Any] = {
            "secretName": tls_secret(identity),
            "duration": "2160h",
            "renewBefore": "720h",
            "privateKey": dict(_KEY),
            "uris": [identity.uri],
            "usages": ["digital signature", "server auth"]
            + ([] if identity.kind == "gpu" else ["client auth"]),
            "issuerRef": dict(issuer_ref),
        }
        if services:
            spec["dnsNames"] = list(_dns_names(services, options.namespace))
        else:
            spec["ipAddresses"] = ["127.0.0.1"]
        out.append(
            {
                "apiVersion": api,
                "kind": "Certificate",
                "metadata": _meta(tls_secret(identity), options),
                "spec": spec,
            }
        )
    return out


def _dns_names(services: Iterable[str], namespace: str) -> Iterable[str]:
    for service in services:
        yield fqdn(service, namespace)
        yield f"{service}.{namespace}.svc"
        yield f"{service}.{namespace}"
        yield service


def file_secrets(plan: Plan, options: RenderOptions) -> list[dict[str, Any]]:
    """The topology's own files, as Secrets (``--tls secrets``)."""
    tls = plan.topology.tls
    assert tls is not None  # plan.validate refused --tls secrets without a tls section
    ca = Path(tls.ca).read_bytes()
    out = []
    for identity, _ in identities(plan):
        cert, key = tls.cert_file(identity), tls.key_file(identity)
        for path in (cert, key):
            if not path.is_file():
                raise ConfigError(
                    f"tls.certs: no certificate for {identity.uri}: no such file {str(path)!r}"
                )
        data = {"tls.crt": cert.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": ca}
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": _meta(tls_secret(identity), options),
                "type": "kubernetes.io/tls",
                "data": {k: base64.b64encode(v).decode("ascii") for k, v in data.items()},
            }
        )
    return out
