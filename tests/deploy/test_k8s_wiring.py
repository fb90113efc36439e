"""What the rendered manifests promise: every address a tier dials is a Service (or the
pod's own emulated GPU) with that port, the ConfigMap's topology is what the tiers read,
and the workloads are laid out as the README's Deploying section says."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.auth_file import load_with_auth
from cli.k8s.names import is_loopback
from cli.k8s.options import RenderOptions
from cli.k8s.render import Rendered, render
from common.config.node import ConfigError
from common.config.pki import generate_pki
from common.config.tls import fleet_identities
from common.request.server import V2_SERVICE
from common.tenancy.auth import hash_key
from tests.deploy.k8s_fixtures import all_documents, demo_raw, real_gpu_raw, render_demo

NS = "meridian"


_PARSED: dict[int, tuple[Rendered, list[dict[str, Any]]]] = {}


def _by_kind(rendered: Rendered, kind: str) -> dict[str, dict[str, Any]]:
    """The rendering's documents of ``kind`` by name (parsed once per rendering)."""
    if id(rendered) not in _PARSED or _PARSED[id(rendered)][0] is not rendered:
        _PARSED[id(rendered)] = (rendered, all_documents(rendered))
    docs = _PARSED[id(rendered)][1]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _dials(topology: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(key path, address, dialled with TLS to a GPU) of everything a tier dials."""
    out = []
    for i, region in enumerate(topology["regions"]):
        out.append((f"regions[{i}].address", region["address"], False))
        for j, zone in enumerate(region["zones"]):
            out.append((f"regions[{i}].zones[{j}].address", zone["address"], False))
            for k, gpu in enumerate(zone["gpus"]):
                for key in ("listen", "metrics_listen"):
                    if key in gpu:
                        tls = gpu.get("tls") not in (None, False)
                        out.append((f"regions[{i}].zones[{j}].gpus[{k}].{key}", gpu[key], tls))
    return out


def _pod_port(deployment: dict[str, Any], port: int, names: set[str] | None = None) -> bool:
    pod = deployment["spec"]["template"]["spec"]
    for container in pod["containers"] + pod.get("initContainers", []):
        for p in container.get("ports", []):
            if p["containerPort"] == port and (names is None or p["name"] in names):
                return True
    return False


def _check_dial(rendered: Rendered, key: str, address: str, tls_gpu: bool) -> None:
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    deployments = _by_kind(rendered, "Deployment")
    if is_loopback(host):  # an emulated GPU in the local tier's own pod
        zone = rendered.topology["regions"][int(key[8])]["zones"][int(key.split("[")[2][0])]
        local = deployments[f"meridian-local-{zone['name']}"]
        assert _pod_port(local, port), f"{key}: no container of {zone['name']} listens on {port}"
        return
    suffix = f".{NS}.svc.cluster.local"
    if tls_gpu:
        assert not host.endswith(suffix), f"{key}: a TLS GPU keeps the host its certificate names"
        return
    assert host.endswith(suffix), f"{key}: {address} is not a Service of namespace {NS}"
    service = _by_kind(rendered, "Service").get(host.removesuffix(suffix))
    assert service is not None, f"{key}: no Service {host}"
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert port in ports, f"{key}: Service {host} has no port {port}"
    selector = service["spec"].get("selector")
    if service["spec"].get("type") == "ExternalName":
        return
    if selector is None:  # a real GPU server: an EndpointSlice names it
        slices = [
            s
            for s in _by_kind(rendered, "EndpointSlice").values()
            if s["metadata"]["labels"]["kubernetes.io/service-name"] == host.split(".")[0]
        ]
        assert slices and any(p["port"] == port for s in slices for p in s["ports"]), key
        return
    chosen = [
        d
        for d in deployments.values()
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(chosen) == 1, f"{key}: Service {host} selects {len(chosen)} Deployments"
    assert _pod_port(chosen[0], port, {ports[port]["targetPort"]}), (
        f"{key}: the pods behind {host} do not serve port {port} as {ports[port]['targetPort']}"
    )


@pytest.mark.parametrize("variant", ["demo", "real-gpus"])
def test_every_address_a_tier_dials_is_a_service_with_that_port(variant: str) -> None:
    rendered = (
        render_demo() if variant == "demo" else render(real_gpu_raw(), RenderOptions(), config="x")
    )
    dials = _dials(rendered.topology)
    assert len(dials) > 6
    for key, address, tls in dials:
        _check_dial(rendered, key, address, tls)
    # Each tier binds, on every interface, the port its Service sends to.
    for region in rendered.topology["regions"]:
        assert region["listen"] == "0.0.0.0:" + region["address"].rsplit(":", 1)[1]


def test_the_dial_check_fails_for_a_port_no_service_has() -> None:
    rendered = render_demo()
    with pytest.raises(AssertionError, match="has no port 8003"):
        _check_dial(
            rendered,
            "regions[0].address",
            "meridian-regional-us-east.meridian.svc.cluster.local:8003",
            False,
        )


def test_real_gpu_servers_are_services_without_pods() -> None:
    rendered = render(real_gpu_raw(), RenderOptions(), config="x")
    services = _by_kind(rendered, "Service")
    slices = _by_kind(rendered, "EndpointSlice")
    assert slices["meridian-gpu-a-gpu0-1"]["endpoints"][0]["addresses"] == ["10.1.0.5"]
    assert slices["meridian-gpu-a-gpu1-1"]["addressType"] == "IPv6"
    assert [p["port"] for p in services["meridian-gpu-a-gpu0"]["spec"]["ports"]] == [8001, 8002]
    assert slices["meridian-gpu-a-gpu1-metrics-1"]["endpoints"][0]["addresses"] == ["10.1.0.9"]
    assert services["meridian-gpu-b-gpu0"]["spec"] == {
        "type": "ExternalName",
        "externalName": "gpu7.dc.example.com",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
    }
    assert "meridian-gpu-b-gpu1" not in services  # TLS: dialled at its own name
    assert not any(
        d["kind"] == "Deployment" and "gpus" in str(d) and "worker" in str(d)
        for d in all_documents(rendered)
    )


def test_loopback_gpus_need_the_emulated_workers() -> None:
    with pytest.raises(ConfigError) as err:
        render(demo_raw(), RenderOptions(), config="x")
    assert str(err.value) == (
        "regions[0].zones[0].gpus[0].listen: 127.0.0.1:0 cannot be reached from a cluster "
        "(loopback or port 0); give the GPU server's address, or render with --with-emulated-gpus"
    )


def test_configmap_topology_is_what_the_tiers_read(tmp_path: Path) -> None:
    """The ConfigMap's topology and the auth Secret, as the pods mount them, load with
    the tiers' own loader (``meridian global --auth-file``)."""
    rendered = render_demo(RenderOptions(emulated_gpus=True, tls="none"), generate_keys=True)
    config = _by_kind(rendered, "ConfigMap")["meridian-topology"]["data"]["topology.yaml"]
    auth = _by_kind(rendered, "Secret")["meridian-auth"]["stringData"]["auth.yaml"]
    # The raw data: every tier binds all interfaces and is dialled at its Service.
    topology = yaml.safe_load(config)
    assert topology["global"]["listen"] == "0.0.0.0:8001"
    zone = topology["regions"][1]["zones"][0]
    assert zone["address"] == "meridian-local-eu-west-1a.meridian.svc.cluster.local:8001"
    assert topology["regions"][1]["redis_url"] == (
        "redis://meridian-redis-eu-west.meridian.svc.cluster.local:6379/0"
    )
    (tmp_path / "topology.yaml").write_text(config)
    (tmp_path / "auth.yaml").write_text(auth)
    parsed = load_with_auth(tmp_path / "topology.yaml", tmp_path / "auth.yaml")
    assert str(parsed.regions[1].zones[0].address) == zone["address"]
    assert str(parsed.regions[1].zones[0].endpoint) == "0.0.0.0:8001"  # where it binds
    assert str(parsed.regions[1].address) == topology["regions"][1]["address"]
    assert parsed.auth.tenant("demo") is not None


def test_key_digests_are_in_the_secret_only() -> None:
    rendered = render_demo(generate_keys=True)
    config = _by_kind(rendered, "ConfigMap")["meridian-topology"]["data"]["topology.yaml"]
    auth = yaml.safe_load(_by_kind(rendered, "Secret")["meridian-auth"]["stringData"]["auth.yaml"])
    assert not re.search(r"[0-9a-f]{64}", config)
    digests = {t["id"]: t["api_key_sha256"] for t in auth["auth"]["tenants"]}
    assert digests == {t: [hash_key(k)] for t, k in rendered.keys.fresh.items()}
    assert auth["auth"]["admin_keys"] == [hash_key(rendered.keys.admin_key or "")]
    # Without --generate-keys nobody has a key, and the Secret says so.
    plain = render_demo()
    text = _by_kind(plain, "Secret")["meridian-auth"]["stringData"]["auth.yaml"]
    assert text.startswith("# No key yet for tenant demo, tenant free-tier, the Admin API")
    assert plain.keys.fresh == {} and not re.search(r"[0-9a-f]{64}", text)


def test_only_the_global_tier_mounts_the_key_digests() -> None:
    for name, deployment in _by_kind(render_demo(), "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        mounts_auth = any(v["name"] == "auth" for v in pod["volumes"])
        assert mounts_auth == (name == "meridian-global") == ("--auth-file" in args), name


def test_an_inner_tier_with_an_openai_edge_exposes_it_and_mounts_the_key_digests() -> None:
    raw = demo_raw()
    region, zone = raw["regions"][0], raw["regions"][0]["zones"][0]
    region["openai_listen"] = "127.0.0.1:0"  # port 0: the convention's, 8000
    zone["openai_listen"] = "127.0.0.1:9100"
    rendered = render(raw, RenderOptions(emulated_gpus=True), config="x")
    topology = rendered.topology
    assert topology["regions"][0]["openai_listen"] == "0.0.0.0:8000"
    assert topology["regions"][0]["zones"][0]["openai_listen"] == "0.0.0.0:9100"
    assert "openai_listen" not in topology["regions"][0]["zones"][1]
    deployments, services = _by_kind(rendered, "Deployment"), _by_kind(rendered, "Service")
    serving = {f"meridian-regional-{region['name']}": 8000, f"meridian-local-{zone['name']}": 9100}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        port = serving.get(name, 8000 if name == "meridian-global" else None)
        assert (port is not None) == _pod_port(deployment, port or 8000, {"openai"}), name
        ports = {p["name"]: p["port"] for p in services[name]["spec"]["ports"]}
        assert ports.get("openai") == port, name
        # Every tier that authenticates clients has the tenants' key digests.
        mounts_auth = any(v["name"] == "auth" for v in pod["volumes"])
        assert mounts_auth == (port is not None) == ("--auth-file" in pod["containers"][0]["args"])


def test_replicas_budgets_and_autoscalers() -> None:
    rendered = render_demo()
    deployments = _by_kind(rendered, "Deployment")
    hpas = _by_kind(rendered, "HorizontalPodAutoscaler")
    pdbs = _by_kind(rendered, "PodDisruptionBudget")
    assert set(pdbs) == set(deployments)
    assert hpas["meridian-global"]["spec"]["minReplicas"] >= 2
    # The edges' quota shares while Redis is down add up to each limit at most.
    config = _by_kind(rendered, "ConfigMap")["meridian-topology"]["data"]["topology.yaml"]
    edges = yaml.safe_load(config)["global"]["replicas"]
    assert edges == hpas["meridian-global"]["spec"]["maxReplicas"]
    assert "replicas" not in deployments["meridian-global"]["spec"]  # the HPA owns it
    assert hpas["meridian-regional-eu-west"]["spec"]["minReplicas"] == 2
    locals_ = [n for n in deployments if n.startswith("meridian-local-")]
    assert len(locals_) == 6 and not set(locals_) & set(hpas)
    assert all(deployments[n]["spec"]["replicas"] == 1 for n in locals_)
    for deployment in deployments.values():
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {
            "maxSurge": 1,
            "maxUnavailable": 0,
        }


def _zones(deployment: dict[str, Any]) -> list[str]:
    terms = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    (expr,) = terms[0]["matchExpressions"]
    assert expr["key"] == "topology.kubernetes.io/zone" and expr["operator"] == "In"
    return list(expr["values"])


def test_local_tiers_are_pinned_to_their_zone_and_regional_to_their_region() -> None:
    deployments = _by_kind(render_demo(), "Deployment")
    assert _zones(deployments["meridian-local-eu-west-1b"]) == ["eu-west-1b"]
    assert _zones(deployments["meridian-regional-eu-west"]) == ["eu-west-1a", "eu-west-1b"]
    spread = deployments["meridian-global"]["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert [s["topologyKey"] for s in spread] == [
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    ]


@pytest.mark.parametrize("tls", ["cert-manager", "none"])
def test_probes_ask_grpc_health_where_the_kubelet_can(tls: str) -> None:
    """The kubelet's gRPC probe is plaintext: a tier on mutual TLS is asked /readyz instead."""
    for name, deployment in _by_kind(
        render_demo(RenderOptions(emulated_gpus=True, tls=tls)), "Deployment"
    ).items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        ready = container["readinessProbe"]
        if tls == "none" or name == "meridian-global":
            assert ready["grpc"] == {"port": 8001, "service": V2_SERVICE}, name
        else:
            assert ready["httpGet"] == {"path": "/readyz", "port": "ops"}, name
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "ops"}


def test_grace_sets_the_termination_grace_period() -> None:
    options = RenderOptions(emulated_gpus=True, grace_s=12.5)
    deployments = _by_kind(render_demo(options), "Deployment")
    local = deployments["meridian-local-us-east-1a"]["spec"]["template"]["spec"]
    edge = deployments["meridian-global"]["spec"]["template"]["spec"]
    assert local["terminationGracePeriodSeconds"] == 13 + 5  # --grace rounded up + margin
    assert edge["terminationGracePeriodSeconds"] == 13 + 5 + 5  # and its preStop pause
    assert edge["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert local["containers"][0]["args"][-4:-2] == ["--grace", "12.5"]


def test_pods_run_non_root_read_only_and_are_scraped() -> None:
    for name, deployment in _by_kind(render_demo(), "Deployment").items():
        template = deployment["spec"]["template"]
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["allowPrivilegeEscalation"] is False
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
        notes = template["metadata"]["annotations"]
        ops = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}["ops"]
        assert (notes["prometheus.io/scrape"], notes["prometheus.io/port"]) == ("true", str(ops))


def test_certificates_name_each_identity_and_the_name_it_is_dialled_at() -> None:
    rendered = render_demo()
    assert not any("PRIVATE KEY" in text for text in rendered.files.values())
    certs = _by_kind(rendered, "Certificate")
    spec = certs["meridian-tls-regional-eu-west"]["spec"]
    assert spec["uris"] == ["spiffe://meridian/regional/eu-west"]
    assert "meridian-regional-eu-west.meridian.svc.cluster.local" in spec["dnsNames"]
    assert set(spec["usages"]) == {"digital signature", "server auth", "client auth"}
    assert len(certs) == 1 + 1 + 3 + 6  # the CA, global, 3 regional, 6 local
    # Each pod mounts its own certificate as the topology's tls section names it.
    pod = _by_kind(rendered, "Deployment")["meridian-local-eu-west-1b"]["spec"]["template"]["spec"]
    tls = next(v for v in pod["volumes"] if v["name"] == "tls")["projected"]["sources"]
    assert tls[0]["secret"]["name"] == "meridian-tls-local-eu-west-eu-west-1b"
    assert [i["path"] for i in tls[0]["secret"]["items"]] == [
        "certs/local/eu-west/eu-west-1b/cert.pem",
        "certs/local/eu-west/eu-west-1b/key.pem",
        "ca.pem",
    ]


def test_tls_secrets_embed_the_topologys_files(tmp_path: Path) -> None:
    raw = demo_raw()
    raw["regions"] = raw["regions"][:1]
    raw["auth"]["tenants"][1]["allowed_regions"] = ["us-east"]
    with pytest.raises(ConfigError, match=r"^--tls secrets: the topology has no tls section"):
        render(raw, RenderOptions(emulated_gpus=True, tls="secrets"), config="x")
    probe = render(raw, RenderOptions(emulated_gpus=True, tls="none"), config="x").plan.topology
    tls = generate_pki(tmp_path / "pki", fleet_identities(probe))
    raw["tls"] = {"ca": tls.ca, "certs": tls.certs}
    rendered = render(raw, RenderOptions(emulated_gpus=True, tls="secrets"), config="x")
    secret = _by_kind(rendered, "Secret")["meridian-tls-local-us-east-us-east-1a"]
    assert secret["type"] == "kubernetes.io/tls"
    cert = Path(tls.certs, "local", "us-east", "us-east-1a", "cert.pem").read_bytes()
    assert base64.b64decode(secret["data"]["tls.crt"]) == cert
    assert base64.b64decode(secret["data"]["ca.crt"]) == Path(tls.ca).read_bytes()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"global_replicas": 1},
            "--global-replicas: at least 2 (one replica cannot roll or be "
            "drained without dropping the edge), not 1",
        ),
        (
            {"namespace": "Prod_1"},
            "--namespace: 'Prod_1' is not a DNS label (lower case letters, "
            "digits, '-', at most 63 characters)",
        ),
        ({"tls": "spiffe"}, "--tls: must be one of cert-manager, secrets, none, not 'spiffe'"),
        ({"image": "meridian 1"}, "--image: not an image reference: 'meridian 1'"),
    ],
)
def test_bad_options_are_refused_naming_the_flag(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        RenderOptions(**options)
    assert str(err.value) == message


def test_a_name_kubernetes_cannot_take_is_refused_naming_its_key() -> None:
    raw = demo_raw()
    raw["regions"][2]["zones"][1]["name"] = "ap_southeast_1b_" + "x" * 60
    with pytest.raises(ConfigError, match=r"^regions\[2\]\.zones\[1\]\.name: 'ap_southeast_1b_x"):
        render(raw, RenderOptions(emulated_gpus=True, tls="none"), config="x")


def test_an_emulated_gpu_on_the_fleets_ca_gets_its_own_certificate() -> None:
    raw = demo_raw()
    raw["regions"][0]["zones"][1]["gpus"][0]["tls"] = True
    rendered = render(raw, RenderOptions(emulated_gpus=True), config="x")
    cert = _by_kind(rendered, "Certificate")["meridian-tls-gpu-us-east-us-east-1b"]["spec"]
    assert cert["uris"] == ["spiffe://meridian/gpu/us-east/us-east-1b"]
    assert cert["ipAddresses"] == ["127.0.0.1"]  # dialled on loopback in its pod
    assert "client auth" not in cert["usages"]
    pod = _by_kind(rendered, "Deployment")["meridian-local-us-east-1b"]["spec"]["template"]["spec"]
    sources = next(v for v in pod["volumes"] if v["name"] == "tls")["projected"]["sources"]
    assert [s["secret"]["name"] for s in sources] == [
        "meridian-tls-local-us-east-us-east-1b",
        "meridian-tls-gpu-us-east-us-east-1b",
    ]
    with pytest.raises(ConfigError) as err:
        render(raw, RenderOptions(emulated_gpus=True, tls="none"), config="x")
    assert str(err.value) == (
        "regions[0].zones[1].gpus[0].tls: true needs the fleet's CA, but --tls is none"
    )


def test_shared_redis_keeps_every_region_on_the_one_redis() -> None:
    topology = render_demo(RenderOptions(emulated_gpus=True, redis_per_region=False)).topology
    assert topology["redis_url"] == "redis://meridian-redis.meridian.svc.cluster.local:6379/0"
    assert not any("redis_url" in region for region in topology["regions"])
    raw = demo_raw()
    raw["redis_url"] = "redis+sentinel://sentinel-0.redis:26379,sentinel-1.redis:26379/mymaster/0"
    kept = render(raw, RenderOptions(emulated_gpus=True, tls="none"), config="x").topology
    assert kept["redis_url"] == raw["redis_url"]  # not loopback: the operator's, as written


def test_a_load_balancer_publishes_the_edge_ports_only() -> None:
    options = RenderOptions(emulated_gpus=True, global_service_type="LoadBalancer")
    services = _by_kind(render_demo(options), "Service")
    edge = services["meridian-global"]["spec"]
    assert edge["type"] == "LoadBalancer"
    assert [p["name"] for p in edge["ports"]] == ["grpc", "openai"]
    ops = services["meridian-global-ops"]["spec"]
    assert (ops["type"], [p["port"] for p in ops["ports"]]) == ("ClusterIP", [8002])
