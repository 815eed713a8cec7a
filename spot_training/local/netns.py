"""Node addresses for local clusters: a network namespace per node on a bridge, or loopback.

Shared by local mode's cluster drill (:mod:`spot_training.local.cluster_drill`) and the cluster stories'
harness (tests/cluster/cluster_harness.py). Each node gets its own namespace and address in a
private /24 we create (``10.213.X.0/24``, X random among those no interface holds yet, so that parallel
runs (the MXNet and PyTorch test runs beside the main one) do not meet), so every
framework process can listen on the cluster's configured ports, as on separate instances. Without
``ip netns`` (no root, no iproute2), or with ``SPOT_TRAINING_TEST_LOOPBACK=1``, nodes fall back to
127.0.0.1 with a distinct port offset each (said on stdout). :meth:`Network.close` removes
everything created, also after a failure.

Hand-rolled on ``ip`` (iproute2): no library in the environment manages namespaces and bridges.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


def _free_subnet() -> int:
    """A random X in 1..254 such that no interface on this host has an address in ``10.213.X.0/24``.

    Two runs that picked the same X would each route it to their own bridge and lose each other's
    traffic. A race between two runs choosing at the same instant remains, at 1/254 per pair.

    Returns:
        The third octet X (1..254); a random one when ``ip`` cannot list the addresses.
    """
    listed = _ip("-o", "-4", "addr", "show") if shutil.which("ip") else None
    text = listed.stdout if listed is not None and listed.returncode == 0 else ""
    used = {int(octet) for octet in re.findall(r"\binet 10\.213\.(\d+)\.", text)}
    free = [x for x in range(1, 255) if x not in used]
    return random.choice(free or list(range(1, 255)))


class Network:
    """Node addresses: network namespaces on a bridge when possible, else loopback.

    ``add(name) -> (netns or None, address, port_offset)``; ``close()`` removes everything created.
    """

    def __init__(self) -> None:
        self.token = f"{os.getpid() % 10000:04d}{random.randint(0, 99):02d}"
        self.subnet = _free_subnet()
        self.bridge = f"stc{self.token}"
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self.netns = False
        self.reason = ""
        self._count = 0
        if os.environ.get("SPOT_TRAINING_TEST_LOOPBACK"):
            self.reason = "SPOT_TRAINING_TEST_LOOPBACK is set"
        elif shutil.which("ip") is None:
            self.reason = "iproute2 not installed"
        else:
            made = _ip("link", "add", self.bridge, "type", "bridge")
            if made.returncode == 0:
                self.links.append(self.bridge)
                ok = (_ip("addr", "add", f"10.213.{self.subnet}.1/24", "dev", self.bridge).returncode == 0
                      and _ip("link", "set", self.bridge, "up").returncode == 0)
                self.netns = ok
                self.reason = "" if ok else "cannot configure the bridge"
            else:
                self.reason = made.stderr.strip() or "cannot create a bridge"
        if not self.netns:
            print(f"cluster harness: network namespaces unavailable ({self.reason}); falling back to loopback "
                  "addresses with distinct ports", flush=True)

    def add(self, name: str) -> tuple[str | None, str, int]:
        """A new node: (namespace or None, its address, port offset to add to the cluster ports)."""
        self._count += 1
        index = self._count
        if not self.netns:
            return None, "127.0.0.1", 10 * index
        ns = f"stc{self.token}n{index}"
        host_end, ns_end = f"stc{self.token}h{index}", f"stc{self.token}p{index}"
        address = f"10.213.{self.subnet}.{10 + index}"
        steps = [("netns", "add", ns), ("link", "add", host_end, "type", "veth", "peer", "name", ns_end),
                 ("link", "set", ns_end, "netns", ns), ("link", "set", host_end, "master", self.bridge),
                 ("link", "set", host_end, "up"), ("-n", ns, "addr", "add", f"{address}/24", "dev", ns_end),
                 ("-n", ns, "link", "set", ns_end, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for i, step in enumerate(steps):
            done = _ip(*step)
            if i == 0 and done.returncode == 0:
                self.namespaces.append(ns)
            if i == 1 and done.returncode == 0:
                self.links.append(host_end)
            if done.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)} failed: {done.stderr.strip()}")
        return ns, address, 0

    def close(self) -> None:
        """Delete the namespaces (their veth ends go with them), the host ends and the bridge."""
        for ns in self.namespaces:
            _ip("netns", "del", ns)
        for link in reversed(self.links):
            _ip("link", "del", link)
        self.namespaces.clear()
        self.links.clear()
