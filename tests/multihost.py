"""Hosts on one machine, for tests of the KV plane off loopback (issue 29).

Each host is a network namespace with its own hostname (``unshare --uts``, so instances see
different machines and never take the same-host ipc path) and its own address on a bridge.
A host's link can be rate-limited (``tc ... tbf``, both directions) and cut (``ip link set
down``: no FIN, no RST, packets simply stop). The test process itself is the client host: it
reaches every host through the bridge's own address, and it holds no deployment secret.

Needs root, iproute2 and tc; ``unavailable()`` says why not (the tests then skip with it).
``Network.close()`` removes every namespace, link and process it made, also after a failure.
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess

# Names must fit the kernel's 15 characters: "e<4 digits>n<network>v<host>" stays under them.
_TAG = f"e{os.getpid() % 10000}"
_NETWORKS = itertools.count()


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)}"
    probe = f"{_TAG}probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


class Host:
    def __init__(self, network: "Network", name: str, index: int) -> None:
        self.name = name
        self.ns = f"{network.tag}-{name}"
        self.address = f"{network.subnet}.{index}"
        self.link = f"{network.tag}v{index}"  # its cable's end on the bridge (in the root namespace)
        self._inner = f"{network.tag}i{index}"
        self._bridge = network.bridge

    def create(self) -> None:
        inner = self._inner
        _run("ip", "netns", "add", self.ns)
        _run("ip", "link", "add", inner, "type", "veth", "peer", "name", self.link)
        _run("ip", "link", "set", inner, "netns", self.ns)
        _run("ip", "link", "set", self.link, "master", self._bridge)
        _run("ip", "link", "set", self.link, "up")
        for argv in (("link", "set", "lo", "up"), ("link", "set", inner, "name", "eth0"),
                     ("addr", "add", f"{self.address}/24", "dev", "eth0"), ("link", "set", "eth0", "up")):
            _run("ip", "-n", self.ns, *argv)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host (its network namespace and hostname). The process keeps
        the pid of the returned command: each step execs the next."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *argv]

    def cut(self) -> None:
        """Unplug the host: nothing reaches it or leaves it, and nobody is told."""
        _run("ip", "link", "set", self.link, "down")

    def plug(self) -> None:
        _run("ip", "link", "set", self.link, "up")

    def limit(self, rate: str, burst: str = "256kb") -> None:
        """At most ``rate`` (tc's units: ``100mbit``, ``1gbit``) in and out of this host, after
        a first ``burst`` at full speed (tbf needs at least rate/HZ of it: 256 KB carries 1 Gbit/s;
        give slow links a small one, or their first 256 KB cross at once)."""
        for prefix, dev in (((), self.link), (("ip", "netns", "exec", self.ns), "eth0")):
            _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", burst, "latency", "100ms")

    def unlimit(self) -> None:
        for prefix, dev in (((), self.link), (("ip", "netns", "exec", self.ns), "eth0")):
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)


class Network:
    """A bridge and the hosts on it (``add``); the root namespace is on it too, as the client."""

    def __init__(self) -> None:
        pid, number = os.getpid(), next(_NETWORKS)  # several may exist at once in one process
        self.tag = f"{_TAG}n{number % 100}"
        self.subnet = f"10.{200 + pid % 50}.{(pid * 7 + number) % 250}"
        self.bridge = f"{self.tag}br"
        self.client_address = f"{self.subnet}.254"
        self.hosts: list[Host] = []
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.client_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except Exception:
            self.close()
            raise

    def add(self, name: str) -> Host:
        host = Host(self, name, len(self.hosts) + 1)
        self.hosts.append(host)  # first: close() undoes a half-made host too
        host.create()
        return host

    def close(self) -> None:
        """Every namespace (its processes are the caller's to stop first) and the bridge."""
        for host in self.hosts:
            _run("ip", "netns", "del", host.ns, check=False)
            _run("ip", "link", "del", host.link, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
