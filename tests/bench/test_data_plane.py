"""bench/data_plane's harness: the pieces whose failure would make its figures wrong.

The bare hop passes bytes and statuses through unchanged (unary and stream); nginx,
HAProxy and Envoy, started from the configs the bench renders, forward a request and a
stream to an emulated GPU and refuse a caller without a certificate; the closed-loop
driver counts answers and errors apart; the /proc accounting sees a busy process.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.data_plane_fleet import Credentials, Proc, identity_files
from bench.data_plane_hop import BareHop
from bench.data_plane_load import Job, cpu_ticks, descendants, run_job
from bench.data_plane_peers import PeerTls, binary, plan, write_files
from common.basics.redis_embed import free_port
from common.config.identity import regional
from common.config.node import Endpoint
from common.config.pki import generate_pki
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers

PAYLOADS = [b"", b"\x00\xff not a protobuf \x80", bytes(range(256)) * 64]


class Echo(grpc.GenericRpcHandler):
    """An upstream that records what reached it and answers it back, byte for byte;
    method ``/t.T/Fail`` ends with RESOURCE_EXHAUSTED instead."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.endswith("/ModelStreamInfer"):

            async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
                async for request in requests:
                    self.seen.append(request)
                    yield request[::-1]

            return grpc.stream_stream_rpc_method_handler(stream)

        async def unary(request: bytes, context: Any) -> bytes:
            self.seen.append(request)
            if method == "/t.T/Fail":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota spent; retry in 2 s")
            return request[::-1]

        return grpc.unary_unary_rpc_method_handler(unary)


async def test_bare_hop_passes_bytes_and_statuses_through_unchanged() -> None:
    echo = Echo()
    upstream = grpc.aio.server()
    upstream.add_generic_rpc_handlers([echo])
    port = upstream.add_insecure_port("127.0.0.1:0")
    await upstream.start()
    hop = BareHop("127.0.0.1:0", [f"127.0.0.1:{port}"])
    await hop.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{hop.port}") as channel:
            unary = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            assert [await unary(p) for p in PAYLOADS] == [p[::-1] for p in PAYLOADS]
            assert echo.seen == PAYLOADS
            echo.seen.clear()
            call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
                iter(PAYLOADS)
            )
            assert [reply async for reply in call] == [p[::-1] for p in PAYLOADS]
            assert echo.seen == PAYLOADS
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await channel.unary_unary("/t.T/Fail")(b"x")
            assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert failed.value.details() == "quota spent; retry in 2 s"
    finally:
        await hop.stop()
        await upstream.stop(0)


@pytest.fixture
async def gpu(redis_server: Any) -> AsyncIterator[str]:
    """One emulated A100 at near-instant speed; yields its address."""
    mapping = one_zone_mapping(redis_server.url, gpus=1, model="m", slow_start_window_s=0)
    topo = topology_from_mapping(mapping)
    workers = ZoneWorkers(topo.regions[0].zones[0], region="r", time_scale=0.001)
    await workers.start()
    try:
        yield topo.regions[0].zones[0].gpus[0].endpoint.address
    finally:
        await workers.stop(0)


@pytest.fixture
def caller(tmp_path: Path) -> Credentials:
    """A fleet CA and the certificate the bench's driver presents to hops and peers."""
    tls = generate_pki(tmp_path / "pki", [regional("r")])
    return identity_files({"ca": tls.ca, "certs": tls.certs}, regional("r"))


def job(target: str, mode: str, creds: Credentials | None = None, model: str = "m") -> Job:
    files = (
        {} if creds is None else {"tls_ca": creds.ca, "tls_cert": creds.cert, "tls_key": creds.key}
    )
    return Job([target], mode, model, concurrency=2, seconds=0.3, warmup_s=0.05, **files)


async def test_driver_counts_answers_and_errors_apart(gpu: str) -> None:
    for mode in ("unary", "stream"):
        window = await run_job(job(gpu, mode))
        assert window.done > 0 and window.errors == 0, window
        assert 0 < window.p50_ms <= window.p99_ms
    refused = await run_job(job(gpu, "unary", model="nope"))
    assert refused.done == 0 and refused.errors > 0
    assert refused.first_error.startswith("NOT_FOUND: model 'nope' is not served by GPU g0")
    refused = await run_job(job(gpu, "stream", model="nope"))
    assert refused.done == 0 and refused.errors > 0
    assert refused.first_error.startswith("NOT_FOUND: model 'nope' is not served by GPU g0")


async def until_ready(proc: Proc, address: str, creds: Credentials, timeout_s: float = 20) -> None:
    """Until ServerReady passes through the peer (the GPU serves in this test's loop)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.secure_channel(address, creds.channel()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            assert proc.alive(), proc.tail()
            try:
                if (await stub.ServerReady(pb.ServerReadyRequest(), timeout=1)).ready:
                    return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
    raise AssertionError(f"{proc.name} not forwarding within {timeout_s} s: {proc.tail()}")


def ca_only(creds: Credentials) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(Path(creds.ca).read_bytes())


@pytest.mark.parametrize("name", ["nginx", "haproxy", "envoy"])
async def test_peer_config_starts_and_forwards(
    name: str, gpu: str, caller: Credentials, tmp_path: Path
) -> None:
    if binary(name) is None:
        how = "make envoy" if name == "envoy" else "make peers"
        pytest.skip(f"no {name} binary on this machine: `{how}` installs it")
    listen = Endpoint("127.0.0.1", free_port())
    tls = PeerTls(caller.ca, caller.cert, caller.key)
    host, port = gpu.rsplit(":", 1)
    admin = Endpoint("127.0.0.1", free_port())
    peer = plan(name, tmp_path / name, listen, [Endpoint(host, int(port))], tls, admin)
    assert peer is not None
    write_files(peer, tmp_path / name)
    proc = Proc(name, peer.argv, tmp_path / f"{name}.log")
    proc.start()
    try:
        await until_ready(proc, listen.address, caller)
        for mode in ("unary", "stream"):
            window = await run_job(job(listen.address, mode, caller))
            assert window.done > 0 and window.errors == 0, (window, proc.tail())
        # Mutual TLS: a caller that trusts the CA but has no certificate is turned away.
        async with grpc.aio.secure_channel(listen.address, ca_only(caller)) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    generate_request("m", "hi", 1), timeout=5
                )
    finally:
        proc.stop()


@pytest.fixture
def busy() -> Iterator[subprocess.Popen[bytes]]:
    """A child that burns CPU for up to 5 s, with a child of its own."""
    code = (
        "import subprocess, sys, time\n"
        "kid = subprocess.Popen(['sleep', '5'])\n"
        "end = time.monotonic() + 5\n"
        "while time.monotonic() < end: pass\n"
        "kid.kill(); kid.wait()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield process
    finally:
        process.kill()
        process.wait()
        for pid in descendants(process.pid)[1:]:
            subprocess.run(["kill", "-9", str(pid)], check=False)


def test_proc_accounting_sees_a_busy_process_and_its_children(
    busy: subprocess.Popen[bytes],
) -> None:
    deadline = time.monotonic() + 4.5
    while len(descendants(busy.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    family = descendants(busy.pid)
    assert len(family) == 2
    kid = family[1]
    before, kid_before = cpu_ticks(busy.pid), cpu_ticks(kid)
    # Ticks of 10 ms; on a crowded machine the loop may wait its turn for a while.
    while cpu_ticks(busy.pid) - before < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cpu_ticks(busy.pid) - before >= 5
    assert cpu_ticks(kid) - kid_before <= 1  # it sleeps
    assert cpu_ticks(2**22 + 7) == 0  # no such process
