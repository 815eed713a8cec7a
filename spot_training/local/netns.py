"""Node addresses for local clusters: a network namespace per node on a bridge, or loopback.

Shared by local mode's cluster drill (:mod:`spot_training.local.cluster_drill`) and the cluster stories'
harness (tests/cluster/cluster_harness.py). Each node gets its own namespace and address in a
private /24 we create (``10.213.X.0/24``, X random so that parallel runs do not meet), so every
framework process can listen on the cluster's configured ports, as on separate instances. Without
``ip netns`` (no root, no iproute2), or with ``SPOT_TRAINING_TEST_LOOPBACK=1``, nodes fall back to
127.0.0.1 with a distinct port offset each (said on stdout). :meth:`Network.close` removes
everything created, also after a failure.

Hand-rolled on ``ip`` (iproute2): no library in the environment manages namespaces and bridges.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


class Network:
    """Node addresses: network namespaces on a bridge when possible, else loopback.

    ``add(name) -> (netns or None, address, port_offset)``; ``close()`` removes everything created.
    """

    def __init__(self) -> None:
        self.token = f"{os.getpid() % 10000:04d}{random.randint(0, 99):02d}"
        self.subnet = random.randint(1, 254)
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
