"""The harness's cut is a real partition: no RST, no FIN, no local error on either side."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multihost.hosts import Hosts, reap_stale

PORT = 9000
# Host a: accept one connection, then report what each read gives (2 s per read).
SERVER = f"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], {PORT})); s.listen()
print("listening", flush=True)
c, _ = s.accept(); c.settimeout(2)
while True:
    try:
        data = c.recv(100)
    except TimeoutError:
        print("timeout", flush=True); continue
    except OSError as e:
        print("error", type(e).__name__, flush=True); break
    print("eof" if not data else f"got {{len(data)}}", flush=True)
    if not data: break
"""
# Host b: connect, say hello, then send for 2.4 s (the test cuts meanwhile); one read.
CLIENT = f"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], {PORT}), timeout=5); c.settimeout(1.0)
c.sendall(b"hello"); print("sent hello", flush=True); time.sleep(0.3)
for _ in range(6):
    try:
        c.send(b"x"); print("send ok", flush=True)
    except OSError as e:
        print("send error", type(e).__name__, flush=True)
    time.sleep(0.4)
try:
    print("read", c.recv(10), flush=True)
except TimeoutError:
    print("read timeout", flush=True)
except OSError as e:
    print("read error", type(e).__name__, flush=True)
try:  # a new connection across the cut: its SYN goes unanswered (no ENETUNREACH at once)
    socket.create_connection((sys.argv[1], {PORT}), timeout=0.5)
    print("connect ok", flush=True)
except TimeoutError:
    print("connect timeout", flush=True)
except OSError as e:
    print("connect error", type(e).__name__, flush=True)
"""


@pytest.fixture
def two_hosts(netns_ok: None, tmp_path: Path) -> Iterator[Hosts]:
    with Hosts(tmp_path / "logs") as hosts:
        hosts.add_host("a")
        hosts.add_host("b")
        hosts.link("a", "b")
        yield hosts


def _wait_for(path: Path, text: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.05)


def test_a_cut_link_drops_silently_and_a_healed_one_delivers(two_hosts: Hosts) -> None:
    a = two_hosts.hosts["a"]
    server = two_hosts.spawn("server", "a", [sys.executable, "-c", SERVER, a.address])
    _wait_for(server.log_path, "listening")
    client = two_hosts.spawn("client", "b", [sys.executable, "-c", CLIENT, a.address])
    _wait_for(server.log_path, "got 5")
    two_hosts.cut("a", "b")
    assert client.process is not None
    client.process.wait(15)
    seen_by_client = client.log_path.read_text().split("\n")
    # The sender's kernel took every byte (no local error), nothing came back (no RST/FIN).
    assert seen_by_client.count("send ok") == 6, seen_by_client
    assert "read timeout" in seen_by_client, seen_by_client
    # `ip link set DEV down` on the client's side would fail this connect at once
    # (ENETUNREACH: its routes go with the link); across a real partition it just hangs.
    assert "connect timeout" in seen_by_client, seen_by_client
    seen_by_server = server.log_path.read_text().split("\n")
    assert seen_by_server[-2] == "timeout", seen_by_server  # neither data, nor EOF, nor RST
    two_hosts.heal("a", "b")
    # TCP retransmits the 6 bytes sent during the cut, and the client's exit (its FIN)
    # arrives after them.
    _wait_for(server.log_path, "eof", timeout_s=15)
    after = server.log_path.read_text().split("\n")
    assert sum(int(line.split()[1]) for line in after if line.startswith("got ")) == 11, after


def test_closing_removes_every_namespace(netns_ok: None, tmp_path: Path) -> None:
    hosts = Hosts(tmp_path / "logs")
    hosts.add_host("x")
    sleeper = hosts.spawn("sleeper", "x", [sys.executable, "-c", "import time; time.sleep(60)"])
    netns = [hosts.wire, hosts.hosts["x"].netns]
    hosts.close()
    assert not sleeper.alive()
    listed = Path("/run/netns")
    assert not [n for n in netns if (listed / n).exists()]
    assert reap_stale() == []  # nothing of a live run is taken for stale
