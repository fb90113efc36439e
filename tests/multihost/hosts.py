"""Several hosts on one machine: Linux network namespaces joined by links that can be cut.

Each host is a namespace ``mrd-<pid>-<name>`` (unique per run, so parallel runs never
collide) with ``lo`` up and one service address, ``10.213.0.N/32`` on ``lo``, that its
processes bind. A link between two hosts is a bridge of its own in a wiring namespace
(``mrd-<pid>-wire``) with one veth port per host; each end gets an address in the link's
own /24 and a host route to the peer's service address through it. Hosts without a link
between them cannot reach each other (nothing forwards), so the links are the topology.

**Cutting a link** detaches one host's port from the link's bridge. The host's own veth
keeps its carrier and its routes, so its processes get no local error; what they send
arrives at a port that belongs to no bridge, in a namespace with no address and no
forwarding, and is dropped without an ICMP; ARP requests go unanswered. Neither side sees
an RST or a FIN: TCP just retransmits and a new connection's SYN goes unanswered, as
across a real WAN partition (``test_hosts.py`` checks it). ``ip link set DEV down`` in a
host would not do: the host's routes go with the link, so its connects fail at once with
ENETUNREACH, a local error. ``tc netem`` is missing on this kind of machine and there
is no nftables or iptables, so this is the one silent drop the kernel offers here.

Every process is started through ``ip netns exec`` behind a tiny wrapper that asks the
kernel to end it when the harness dies (PR_SET_PDEATHSIG, kept across execve); ``close()``
(also run by ``atexit`` and on SIGTERM) stops them, kills whatever is still inside the
namespaces and deletes the namespaces, which deletes their links. Namespaces left by a
run that was SIGKILLed are deleted by the next one (``reap_stale``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from common.basics.processes import stop_process

PREFIX = "mrd"
SERVICE_NET = "10.213.0"  # service addresses, one per host, on lo
LINK_NET = "10.213"  # link k uses 10.213.k.0/24 (k >= 1): .1 on side a, .2 on side b
_STALE = re.compile(rf"^{PREFIX}-(\d+)-")

# Runs between `ip netns exec` and the real program: PR_SET_PDEATHSIG (SIGTERM when the
# harness dies), give up if the harness already died, then become the program.
_DIE_WITH_HARNESS = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def unavailable() -> str | None:
    """Why this machine cannot run the harness, or None when it can."""
    if os.geteuid() != 0:
        return "needs root: network namespaces and veth links are created with `ip`"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _delete_netns(netns: str) -> None:
    # A process inside keeps the namespace (and its links) alive after `ip netns del`:
    # everything inside is ours (the namespace is), so it is killed first.
    for pid in _pids_in(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def reap_stale() -> list[str]:
    """Delete this harness's namespaces left by a run whose process is gone; return them.

    A run is stale only when its pid is gone *and* nothing runs in any of its namespaces:
    a pid seen from another PID namespace could look gone while its run is alive.
    """
    runs: dict[str, list[str]] = {}
    for netns in _netns_list():
        match = _STALE.match(netns)
        if match and not Path(f"/proc/{match[1]}").exists():
            runs.setdefault(match[1], []).append(netns)
    gone = []
    for names in runs.values():
        if any(_pids_in(n) for n in names):
            continue
        for netns in names:
            _delete_netns(netns)
            gone.append(netns)
    return gone


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str  # the service address its processes bind


@dataclass
class Link:
    index: int
    a: Host
    b: Host
    bridge: str
    ports: dict[str, str]  # host name -> its port's name in the wiring namespace
    cut_ends: set[str] = field(default_factory=set)


@dataclass
class HostProcess:
    """One process on one host; its output goes to ``log_path``."""

    name: str
    host: Host
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_file = self.log_path.open("ab")
        wrapped = [sys.executable, "-I", "-S", "-c", _DIE_WITH_HARNESS, str(os.getpid())]
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", self.host.netns, *wrapped, *self.argv],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 5.0) -> None:
        stop_process(self.process, sig, timeout_s)
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


class Hosts:
    """Namespaces, links and processes of one run; ``close()`` removes every one."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = f"{PREFIX}-{os.getpid()}"
        self.hosts: dict[str, Host] = {}
        self.links: list[Link] = []
        self.processes: list[HostProcess] = []
        self._namespaces: list[str] = []
        self._closed = False
        self._old_sigterm: Any = None
        reap_stale()
        self.wire = self._netns("wire")
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through every finally, then atexit

    def _netns(self, name: str) -> str:
        netns = f"{self.run_id}-{name}"
        _ip("netns", "add", netns)
        self._namespaces.append(netns)
        _ip("-n", netns, "link", "set", "lo", "up")
        return netns

    def add_host(self, name: str) -> Host:
        if name in self.hosts or name == "wire":
            raise ValueError(f"host {name!r} exists")
        netns = self._netns(name)
        host = Host(name, netns, f"{SERVICE_NET}.{len(self.hosts) + 1}")
        _ip("-n", netns, "addr", "add", f"{host.address}/32", "dev", "lo")
        self.hosts[name] = host
        return host

    def link(self, a: str, b: str) -> Link:
        """Join hosts ``a`` and ``b`` by a link of their own."""
        k = len(self.links) + 1
        ha, hb = self.hosts[a], self.hosts[b]
        tag = f"m{os.getpid()}l{k}"  # <= 15 chars; pid-unique even outside our namespaces
        bridge = f"{tag}br"
        _ip("-n", self.wire, "link", "add", bridge, "type", "bridge", "forward_delay", "0")
        _ip("-n", self.wire, "link", "set", bridge, "up")
        ports = {}
        for side, host, peer in (("a", ha, hb), ("b", hb, ha)):
            port, dev = f"{tag}{side}", f"l{k}"
            _ip("link", "add", port, "netns", self.wire, "type", "veth",
                "peer", "name", dev, "netns", host.netns)  # fmt: skip
            _ip("-n", self.wire, "link", "set", port, "master", bridge)
            _ip("-n", self.wire, "link", "set", port, "up")
            mine, theirs = (1, 2) if side == "a" else (2, 1)
            _ip("-n", host.netns, "addr", "add", f"{LINK_NET}.{k}.{mine}/24", "dev", dev)
            _ip("-n", host.netns, "link", "set", dev, "up")
            _ip("-n", host.netns, "route", "add", f"{peer.address}/32",
                "via", f"{LINK_NET}.{k}.{theirs}", "dev", dev)  # fmt: skip
            ports[host.name] = port
        link = Link(k, ha, hb, bridge, ports)
        self.links.append(link)
        return link

    def link_between(self, a: str, b: str) -> Link:
        for link in self.links:
            if {link.a.name, link.b.name} == {a, b}:
                return link
        raise KeyError(f"no link between {a} and {b}")

    def cut(self, a: str, b: str, at: str | None = None) -> float:
        """Silently cut the link between ``a`` and ``b`` at ``at``'s end (default ``b``);
        returns the moment (``time.monotonic()``) the cut took effect."""
        link = self.link_between(a, b)
        end = at or b
        _ip("-n", self.wire, "link", "set", link.ports[end], "nomaster")
        link.cut_ends.add(end)
        return time.monotonic()

    def heal(self, a: str, b: str) -> float:
        """Put every cut end of the link back on its bridge; returns the moment."""
        link = self.link_between(a, b)
        for end in sorted(link.cut_ends):
            _ip("-n", self.wire, "link", "set", link.ports[end], "master", link.bridge)
        link.cut_ends.clear()
        return time.monotonic()

    def spawn(self, name: str, host: str, argv: list[str], env: dict[str, str] | None = None
              ) -> HostProcess:  # fmt: skip
        proc = HostProcess(name, self.hosts[host], argv, self.log_dir / f"{name}.log")
        self.processes.append(proc)
        proc.start(env)
        return proc

    def run(self, host: str, argv: list[str], timeout_s: float = 30.0) -> str:
        """Run ``argv`` on ``host`` to its end; its stdout (``RuntimeError`` if it fails)."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.hosts[host].netns, *argv],
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} on {host} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # SIGTERM to all first (newest first: upper tiers stop sending before the ones
        # below go), then wait for each: one at a time took seconds per process.
        for proc in reversed(self.processes):
            if proc.alive() and proc.process is not None:
                proc.process.terminate()
        for proc in reversed(self.processes):
            proc.stop(timeout_s=3.0)
        for netns in reversed(self._namespaces):
            _delete_netns(netns)
        atexit.unregister(self.close)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
