"""Network namespaces of a test's own, for test_host_partitions.py: "hosts" linked to a
"services" namespace by veth pairs, each link its own /24, so one host's link can be cut
and restored.

Needs root (``ip netns``). Everything is named ``ce<6 hex>…`` per run and removed by
``Topology.close()`` (deleting a namespace deletes its processes' sockets and the veth
ends inside it; the ends in the root namespace go with their peers). Traffic stays in
these namespaces: the root namespace gets one link of its own (to migrate, publish
and read the history), on a subnet checked not to be routed already.

    with Topology.create(["a", "b"]) as net:
        subprocess.Popen([*net.prefix("services"), "redis-server", ...])
        net.cut("a"); net.restore("a")
"""

from __future__ import annotations

import ipaddress
import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

ROOT = "root"
SERVICES = "services"


def ip(*args: str, netns: str | None = None) -> str:
    command = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def namespaces() -> set[str]:
    """``ip netns list``: the names only (it may append ``(id: N)``)."""
    return {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}


def _free_base() -> int:
    """A third octet ``x`` such that 10.213.x.0/24 .. 10.213.x+7.0/24 are not routed here
    (another run's, or the machine's own)."""
    routed = [
        ipaddress.ip_network(line.split()[0], strict=False)
        for line in ip("route", "show").splitlines()
        if line.split() and line.split()[0] != "default"
    ]
    for _ in range(50):
        base = secrets.randbelow(31) * 8
        wanted = ipaddress.ip_network(f"10.213.{base}.0/21")
        if not any(net.overlaps(wanted) for net in routed):
            return base
    raise RuntimeError("no free 10.213.x.0/21 for the test's links")


@dataclass
class Link:
    """One veth pair: ``outer`` in the host's namespace (or the root one), ``inner`` in
    the services namespace; the services end is ``services_ip`` on this link."""

    host: str
    outer: str
    inner: str
    host_ip: str
    services_ip: str


@dataclass
class Topology:
    tag: str
    hosts: list[str]
    base: int
    netns: dict[str, str] = field(default_factory=dict)  # role -> namespace name
    links: dict[str, Link] = field(default_factory=dict)  # host (or "root") -> link

    @classmethod
    def create(cls, hosts: Sequence[str]) -> Topology:
        net = cls(tag=f"ce{secrets.token_hex(3)}", hosts=list(hosts), base=_free_base())
        try:
            net._build()
        except BaseException:
            net.close()
            raise
        return net

    def _build(self) -> None:
        for role in [SERVICES, *self.hosts]:
            name = f"{self.tag}{role[0]}{len(self.netns)}"
            ip("netns", "add", name)
            self.netns[role] = name
            ip("link", "set", "lo", "up", netns=name)
        for index, host in enumerate([ROOT, *self.hosts]):
            # Interface names: at most 15 characters (IFNAMSIZ).
            outer, inner = f"{self.tag}h{index}", f"{self.tag}s{index}"
            subnet = f"10.213.{self.base + index}"
            link = Link(host, outer, inner, f"{subnet}.2", f"{subnet}.1")
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.links[host] = link
            ip("link", "set", inner, "netns", self.netns[SERVICES])
            ip("addr", "add", f"{link.services_ip}/24", "dev", inner, netns=self.netns[SERVICES])
            ip("link", "set", inner, "up", netns=self.netns[SERVICES])
            host_ns = None if host == ROOT else self.netns[host]
            if host_ns is not None:
                ip("link", "set", outer, "netns", host_ns)
            ip("addr", "add", f"{link.host_ip}/24", "dev", outer, netns=host_ns)
            ip("link", "set", outer, "up", netns=host_ns)

    def prefix(self, role: str) -> list[str]:
        """The command prefix that runs a program in ``role``'s namespace."""
        return ["ip", "netns", "exec", self.netns[role]]

    def services_ip(self, host: str) -> str:
        """The address ``host`` (or ``"root"``) reaches the services at."""
        return self.links[host].services_ip

    def cut(self, host: str) -> None:
        """Pull the cable: the services end of ``host``'s link goes down. The host's own
        interface keeps its address and route (no carrier): its packets are dropped,
        its sockets see nothing but silence, as on a real partition."""
        ip("link", "set", self.links[host].inner, "down", netns=self.netns[SERVICES])

    def restore(self, host: str) -> None:
        ip("link", "set", self.links[host].inner, "up", netns=self.netns[SERVICES])

    def close(self) -> None:
        """Remove every namespace and link of this run (idempotent; errors collected)."""
        errors: list[str] = []
        for name in self.netns.values():
            try:
                ip("netns", "del", name)
            except RuntimeError as exc:
                errors.append(str(exc))
        # The root end goes with its peer when the services namespace is deleted; a
        # half-built run may have left an end unpaired in the root namespace.
        for line in ip("-o", "link", "show").splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith(self.tag):
                try:
                    ip("link", "del", name)
                except RuntimeError as exc:
                    errors.append(str(exc))
        self.netns.clear()
        self.links.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
