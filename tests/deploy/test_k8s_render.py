"""``meridian deploy k8s``: the committed manifests are the renderer's, every manifest
is valid for Kubernetes 1.31 (strict, offline), and what the tiers dial is what the
manifests define."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from cli.k8s.options import RenderOptions
from cli.k8s.render import HEADER, render
from tests.deploy.k8s_fixtures import (
    COMMITTED,
    KUBERNETES,
    all_documents,
    demo_raw,
    documents,
    real_gpu_raw,
    render_demo,
)

# cert-manager's kinds have no schema in kubernetes-validate (they are CRDs); their
# fields are checked against the names cert-manager.io/v1 defines.
CERT_MANAGER_SPEC_KEYS = {
    "Issuer": {"selfSigned", "ca"},
    "Certificate": {
        "isCA",
        "commonName",
        "secretName",
        "duration",
        "renewBefore",
        "privateKey",
        "uris",
        "dnsNames",
        "ipAddresses",
        "usages",
        "issuerRef",
    },
}
CERT_MANAGER_USAGES = {"digital signature", "server auth", "client auth"}


def test_committed_manifests_are_the_renderers() -> None:
    """deploy/k8s/ is what `meridian deploy k8s` renders from deploy/demo-fleet.yaml now."""
    rendered = render_demo()
    committed = {
        p.name: p.read_text() for p in COMMITTED.glob("*.yaml") if p.read_text().startswith(HEADER)
    }
    assert sorted(committed) == sorted(rendered.files), "render again: meridian deploy k8s ..."
    for name, text in rendered.files.items():
        assert committed[name] == text, f"deploy/k8s/{name} differs from a fresh rendering"
    first = next(iter(rendered.files.values())).splitlines()[0]
    assert first == (
        "# Rendered by: meridian deploy k8s --config deploy/demo-fleet.yaml --with-emulated-gpus"
    )


def test_rendering_is_deterministic() -> None:
    assert (
        render(demo_raw(), RenderOptions(emulated_gpus=True), config="deploy/demo-fleet.yaml").files
        == render_demo().files
    )


def _check_cert_manager(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "cert-manager.io/v1"
    assert set(doc["spec"]) <= CERT_MANAGER_SPEC_KEYS[doc["kind"]], doc["metadata"]["name"]
    assert set(doc["spec"].get("usages", [])) <= CERT_MANAGER_USAGES


def _validate_all(docs: list[dict[str, Any]]) -> int:
    checked = 0
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"].startswith("cert-manager.io/"):
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBERNETES, strict=True)
            _check_cert_manager(doc)
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")
        checked += 1
    return checked


@pytest.mark.parametrize(
    "variant",
    ["committed", "plaintext", "real-gpus", "load-balancer", "inner-openai"],
)
def test_every_manifest_is_valid_kubernetes(variant: str) -> None:
    """Strict (unknown fields refused) against the bundled 1.31 schemas, every document."""
    if variant == "committed":
        docs = [d for p in sorted(COMMITTED.glob("*.yaml")) for d in documents(p.read_text())]
    elif variant == "plaintext":
        docs = all_documents(render_demo(RenderOptions(emulated_gpus=True, tls="none")))
    elif variant == "real-gpus":
        docs = all_documents(render(real_gpu_raw(), RenderOptions(), config="x.yaml"))
    elif variant == "inner-openai":  # a region's and a zone's tier serve OpenAI HTTP too
        raw = demo_raw()
        raw["regions"][0]["openai_listen"] = "127.0.0.1:0"
        raw["regions"][0]["zones"][0]["openai_listen"] = "127.0.0.1:0"
        docs = all_documents(render(raw, RenderOptions(emulated_gpus=True), config="x.yaml"))
    else:
        options = RenderOptions(
            emulated_gpus=True, global_service_type="LoadBalancer", namespace="prod-inference"
        )
        docs = all_documents(render_demo(options))
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    assert _validate_all(docs) >= 20


def test_a_manifest_with_an_unknown_field_fails_validation() -> None:
    """The check can fail: a misspelt field in a rendered Deployment is refused."""
    deployment = next(d for d in all_documents(render_demo()) if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readynessProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


def test_demo_fleet_raw_is_not_changed_by_rendering() -> None:
    raw = demo_raw()
    before = repr(raw)
    render(raw, RenderOptions(emulated_gpus=True), config="x")
    assert repr(raw) == before
