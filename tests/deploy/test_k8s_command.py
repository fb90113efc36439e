"""The ``meridian deploy k8s`` command and ``meridian global --auth-file``: output,
errors naming the flag or key, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cli.auth_file import load_with_auth
from cli.main import main
from common.config.node import ConfigError
from common.tenancy.auth import hash_key
from tests.conftest import small_fleet_spec
from tests.deploy.k8s_fixtures import DEMO, render_demo


def test_it_writes_the_manifests_and_prints_fresh_keys_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "k8s"
    out.mkdir()
    (out / "99-old.yaml").write_text("# Rendered by: meridian deploy k8s --config x\n")
    (out / "mine.yaml").write_text("kind: ConfigMap\n")  # not the renderer's: kept
    argv = [
        "deploy",
        "k8s",
        "--config",
        str(DEMO),
        "--with-emulated-gpus",
        "--out",
        str(out),
        "--namespace",
        "inference",
        "--image",
        "registry.example/meridian:1.2",
        "--generate-keys",
    ]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    printed = capsys.readouterr().out.splitlines()
    assert sorted(p.name for p in out.glob("*.yaml")) == sorted([*render_demo().files, "mine.yaml"])
    assert f"wrote {out / '30-global.yaml'}" in printed
    keys = dict(line.split(" key ") for line in printed if line.startswith("tenant "))
    assert set(keys) == {"tenant demo", "tenant free-tier"}
    secret = next(
        d for d in yaml.safe_load_all((out / "10-config.yaml").read_text()) if d["kind"] == "Secret"
    )
    auth = yaml.safe_load(secret["stringData"]["auth.yaml"])["auth"]
    assert auth["tenants"][0]["api_key_sha256"] == [hash_key(keys["tenant demo"])]
    deployment = yaml.safe_load_all((out / "30-global.yaml").read_text())
    first = next(d for d in deployment if d["kind"] == "Deployment")
    assert first["metadata"]["namespace"] == "inference"
    assert first["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example/meridian:1.2"
    )
    assert (out / "30-global.yaml").read_text().splitlines()[0] == (
        f"# Rendered by: meridian deploy k8s --config {DEMO} --image registry.example/meridian:1.2 "
        "--namespace inference --with-emulated-gpus"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--config", "/nonexistent/topology.yaml"],
            "meridian: configuration error: /nonexistent/topology.yaml: cannot read: "
            "No such file or directory",
        ),
        (
            ["--config", str(DEMO)],
            "meridian: configuration error: regions[0].zones[0].gpus[0].listen: 127.0.0.1:0 cannot "
            "be reached from a cluster (loopback or port 0); give the GPU server's address, or "
            "render with --with-emulated-gpus",
        ),
        (
            ["--config", str(DEMO), "--with-emulated-gpus", "--namespace", "Prod"],
            "meridian: configuration error: --namespace: 'Prod' is not a DNS label (lower case "
            "letters, digits, '-', at most 63 characters)",
        ),
        (
            ["--config", str(DEMO), "--global-replicas", "0"],
            "meridian deploy k8s: error: argument --global-replicas: must be a whole number > 0, "
            "not '0'",
        ),
        (
            ["--config", str(DEMO), "--tls", "vault"],
            "meridian deploy k8s: error: argument --tls: invalid choice: 'vault' (choose from "
            "'cert-manager', 'secrets', 'none')",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_flag_or_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["deploy", "k8s", *argv, "--out", str(tmp_path / "out")])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert not (tmp_path / "out").exists()  # nothing written


def _files(tmp_path: Path, auth: object) -> tuple[Path, Path]:
    topology = tmp_path / "topology.yaml"
    spec = small_fleet_spec(regions=1, zones=1, gpus=1)
    spec["auth"] = {"enabled": True, "tenants": [{"id": "demo", "api_key_sha256": []}]}
    topology.write_text(yaml.safe_dump(spec))
    auth_file = tmp_path / "auth.yaml"
    auth_file.write_text(yaml.safe_dump(auth))
    return topology, auth_file


def test_the_auth_file_replaces_the_topologys_auth_section(tmp_path: Path) -> None:
    digest = hash_key("mk-secret")
    topology, auth_file = _files(
        tmp_path,
        {
            "auth": {
                "enabled": True,
                "tenants": [{"id": "demo", "api_key_sha256": [digest]}],
                "admin_keys": [hash_key("mk-admin")],
            }
        },
    )
    parsed = load_with_auth(topology, auth_file)
    tenant = parsed.auth.tenant("demo")
    assert tenant is not None and tenant.key_hashes == {digest}
    assert parsed.auth.admin_key_hashes == {hash_key("mk-admin")}


def test_a_bad_auth_file_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topology, auth_file = _files(tmp_path, {"auth": {"enabled": True}, "tls": {}})
    with pytest.raises(SystemExit) as done:
        main(["global", "--config", str(topology), "--auth-file", str(auth_file)])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"meridian: configuration error: {auth_file}: expected exactly one key, auth; "
        "got ['auth', 'tls']"
    )
    topology, auth_file = _files(
        tmp_path,
        {
            "auth": {
                "enabled": True,
                "tenants": [{"id": "demo", "api_key_sha256": ["not-a-digest"]}],
            }
        },
    )
    with pytest.raises(ConfigError) as err:
        load_with_auth(topology, auth_file)
    assert str(err.value) == (
        "auth.tenants[0].api_key_sha256[0]: expected a SHA-256 hex digest (64 hex characters; "
        "`meridian keygen` prints one)"
    )


def test_its_help_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["deploy", "k8s", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--config FILE",
        "--image IMAGE",
        "--namespace NAMESPACE",
        "--out DIR",
        "--grace SECONDS",
        "--with-emulated-gpus",
        "--tls",
        "--generate-keys",
        "--global-replicas N",
        "--shared-redis",
        "--global-service-type",
    ):
        assert flag in text, flag
    assert "(default: deploy/k8s)" in text and "(default: meridian:0.1.0)" in text
