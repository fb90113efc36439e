"""A real MLServer (PyPI, a stock KServe V2 server with no grpc.health.v1) behind the
local tier, beside an emulated GPU in the same zone, through all three tiers.

MLServer runs from its own virtualenv (``make mlserver`` builds ``.venv-mlserver``;
``make test`` depends on it) with the tiny model in ``tests/e2e/mlserver_model``.
Its health answers UNIMPLEMENTED, so the local tier checks it by ServerReady and
ModelReady; it sends no load trailer and no metric the tier reads, so it is routed
by the tier's own in-flight count; its ModelStreamInfer is not Triton's, so streams
to it go as ModelInfer. Stopping it marks it down (traffic fails over to the
emulated GPU), restarting it brings it back.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import yaml

from cli.launcher import Fleet, tier_ready
from cli.processes import TierProcess
from common.basics.redis_embed import free_port
from common.request.v2 import generate_request, response_text
from tests.client import V2Client, zone_of
from tests.conftest import small_fleet_spec
from tests.until import wait_until

ROOT = Path(__file__).resolve().parents[2]
MLSERVER = ROOT / ".venv-mlserver" / "bin" / "mlserver"
MODEL = Path(__file__).resolve().parent / "mlserver_model"
ZONE = "us-east-1a"
ML_GPU, EMULATED_GPU = f"{ZONE}-gpu0", f"{ZONE}-gpu1"
NEAR = [("x-meridian-client-geo", "39.03,-77.47")]

pytestmark = pytest.mark.skipif(
    not MLSERVER.exists(), reason=f"no MLServer at {MLSERVER}: run `make mlserver`"
)


@dataclass
class MLServer:
    """One MLServer process serving ``demo-llm`` on loopback ports; restartable."""

    folder: Path
    grpc_port: int
    metrics_port: int
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    @classmethod
    def prepare(cls, folder: Path) -> MLServer:
        folder.mkdir(parents=True)
        for name in ("echo_model.py", "model-settings.json"):
            shutil.copy(MODEL / name, folder / name)
        server = cls(folder, free_port(), free_port())
        settings = {
            "host": "127.0.0.1",
            "grpc_port": server.grpc_port,
            "http_port": free_port(),
            "metrics_port": server.metrics_port,
            "parallel_workers": 0,
        }
        (folder / "settings.json").write_text(json.dumps(settings))
        return server

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.log = (self.folder / "mlserver.log").open("ab")
        self.process = subprocess.Popen(
            [str(MLSERVER), "start", str(self.folder)],
            cwd=self.folder,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not tier_ready(self.address, None, 0.5):
            assert self.process.poll() is None, self.tail()
            assert time.monotonic() < deadline, f"MLServer not ready: {self.tail()}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self.log is not None:
            self.log.close()
            self.log = None

    def tail(self) -> str:
        return (self.folder / "mlserver.log").read_text(errors="replace")[-2000:]


def fleet_spec(ml: MLServer) -> dict[str, Any]:
    """One region, one zone: GPU 0 is MLServer (H100: the faster, so an idle zone picks
    it), GPU 1 an emulated A100."""
    spec = small_fleet_spec(regions=1, zones=1, gpus=2)
    # The stock-server GPU keepalive, as in front of Triton (deploy/demo-fleet.yaml).
    spec.pop("gpu_keepalive", None)
    spec["slow_start_window_s"] = 0.0  # back at full share at once once healthy again
    gpus = spec["regions"][0]["zones"][0]["gpus"]
    assert [g["name"] for g in gpus] == [ML_GPU, EMULATED_GPU]
    gpus[0].update(
        hardware="H100", listen=ml.address, metrics_listen=f"127.0.0.1:{ml.metrics_port}"
    )
    gpus[1].update(hardware="A100")
    return spec


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, MLServer]]:
    """MLServer, then the fleet, whose emulated worker serves GPU 1 only."""
    ml = MLServer.prepare(tmp_path / "mlserver")
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet_spec(ml)))
    launched = Fleet(tmp_path / "fleet.yaml", tmp_path / "run")
    # The worker of the zone gets a topology without MLServer's GPU (it would bind its port).
    worker_raw = yaml.safe_load(launched.config_path.read_text())
    zone = worker_raw["regions"][0]["zones"][0]
    zone["gpus"] = [g for g in zone["gpus"] if g["name"] != ML_GPU]
    worker_config = tmp_path / "run" / "worker-topology.yaml"
    worker_config.write_text(yaml.safe_dump(worker_raw, sort_keys=False))
    name = f"worker-{ZONE}"
    old = launched.processes[name]
    argv = [str(worker_config) if a == str(launched.config_path) else a for a in old.argv]
    launched.processes[name] = TierProcess(name, argv, old.log_path)
    try:
        ml.start()
        launched.start(timeout_s=90)
        yield launched, ml
    finally:
        launched.stop()
        ml.stop()


def gpu_of(route: str) -> str:
    return route.split("/")[2]


def local_state(fleet: Fleet) -> dict[str, Any]:
    ops = fleet.raw["regions"][0]["zones"][0]["ops_listen"]
    with urllib.request.urlopen(f"http://{ops}/api/state", timeout=5) as response:
        state: dict[str, Any] = json.loads(response.read())
    return state


def gpu_state(fleet: Fleet, name: str) -> dict[str, Any]:
    return next(c for c in local_state(fleet)["children"] if c["name"] == name)


def routes(client: V2Client, n: int, prompt: str = "hello") -> list[tuple[str, str]]:
    """``n`` requests one after another: (GPU, text) of each; any failure fails the test."""
    replies = [client.infer(f"{prompt} {i}", 4, metadata=NEAR) for i in range(n)]
    return [(gpu_of(r.route), r.text) for r in replies]


def test_mlserver_behind_the_local_tier_through_three_tiers(
    fleet: tuple[Fleet, MLServer],
) -> None:
    launched, ml = fleet
    log = launched.processes[f"local-{ZONE}"].log_path
    with V2Client(launched.global_address) as client:
        # Healthy by ServerReady/ModelReady (its grpc.health.v1 is UNIMPLEMENTED), and
        # picked by this tier's own in-flight count (it reports no load).
        served = routes(client, 6)
        assert {gpu for gpu, _ in served} == {ML_GPU}, served
        assert served[0][1] == "mlserver says: hello 0"
        assert f"event=health_source child={ML_GPU}" in log.read_text()
        assert gpu_state(launched, ML_GPU)["healthy"] is True

        # A stream request: its ModelStreamInfer is not Triton's, so it goes as ModelInfer
        # and comes back as one stream response with the whole text.
        for i in range(2):
            request = generate_request("demo-llm", f"streamed {i}", 4, stream=True)
            responses, route = client.stream([request], metadata=NEAR)
            assert [r.error_message for r in responses] == [""], responses
            assert response_text(responses[0].infer_response) == f"mlserver says: streamed {i}"
            assert gpu_of(route) == ML_GPU and zone_of(route) == ZONE
        assert f"event=gpu_stream_unary child={ML_GPU}" in log.read_text()

        # Stopped: every request still succeeds (a failed attempt fails over), and the
        # local tier marks it down and sends everything to the emulated GPU.
        ml.stop()
        after = routes(client, 10, "failover")
        assert all(text for _, text in after)
        wait_until(lambda: gpu_state(launched, ML_GPU)["healthy"] is False)
        assert "ServerReady" in gpu_state(launched, ML_GPU)["last_error"]
        assert {gpu for gpu, _ in routes(client, 10, "while down")} == {EMULATED_GPU}

        # Restarted: back by ServerReady/ModelReady, and picked again.
        ml.start()
        wait_until(lambda: gpu_state(launched, ML_GPU)["healthy"] is True)
        wait_until(lambda: routes(client, 1, "back")[0][0] == ML_GPU)
    text = log.read_text()
    assert "child_down" in text and "child_up" in text
