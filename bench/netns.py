"""Two Linux network namespaces joined by a veth pair: the ranks in one, the aggregator in the
other, so a run can partition and heal the link between them (bench/outage.py and
tests/test_netns_faults.py).

Addresses are in a private /30 assigned inside the namespaces only (``TRAIN_ADDR`` and
``AGG_ADDR``); traffic flows only between these two namespaces, each with its own loopback.
Needs root and iproute2: :func:`unavailable` says why they cannot be used here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

TRAIN_ADDR, AGG_ADDR = "10.231.7.1", "10.231.7.2"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"gwprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _remove_stale() -> None:
    """Delete namespaces left by runs whose process is gone (killed before its finalizer ran)."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        m = re.fullmatch(r"gw-[a-z]*(\d+)-(train|agg)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)


class NetnsPair:
    """Namespaces ``train`` and ``agg`` with a veth pair ``TRAIN_ADDR/30 <-> AGG_ADDR/30``.

    Names carry this process id so that concurrent runs do not collide. ``close()`` deletes both
    namespaces (and with them the veth pair and anything left bound in them); it never raises.
    """

    def __init__(self, tag: str = ""):
        n = f"{tag}{os.getpid()}"
        self.train, self.agg = f"gw-{n}-train", f"gw-{n}-agg"
        self.veth_train, self.veth_agg = f"gwt{n}"[:15], f"gwa{n}"[:15]  # interface names: 15 chars

    def up(self) -> "NetnsPair":
        _remove_stale()
        try:
            _ip("netns", "add", self.train)
            _ip("netns", "add", self.agg)
            _ip("link", "add", self.veth_train, "type", "veth", "peer", "name", self.veth_agg)
            _ip("link", "set", self.veth_train, "netns", self.train)
            _ip("link", "set", self.veth_agg, "netns", self.agg)
            for ns, dev, addr in ((self.train, self.veth_train, TRAIN_ADDR), (self.agg, self.veth_agg, AGG_ADDR)):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")  # gloo and /metrics use loopback inside
        except subprocess.CalledProcessError as e:
            self.close()
            raise RuntimeError(f"setting up namespaces failed: {e.cmd}: {e.stderr}") from e
        return self

    def cmd(self, ns: str, *args: str) -> list[str]:
        """``args`` run inside namespace ``ns`` (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", ns, *args]

    def partition(self) -> None:
        """Take the link down: both ends lose carrier, packets between the namespaces go nowhere."""
        _ip("-n", self.train, "link", "set", self.veth_train, "down")

    def heal(self) -> None:
        _ip("-n", self.train, "link", "set", self.veth_train, "up")

    def close(self) -> None:
        for ns in (self.train, self.agg):
            _ip("netns", "del", ns, check=False)
