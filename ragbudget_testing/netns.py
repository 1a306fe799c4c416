"""Separate network hosts on one machine: Linux network namespaces joined to this one by veth pairs.

Each :class:`NetNamespace` is one "host": its own network stack, reached from this (the
host) namespace over a veth pair with loopback-range addresses only, so nothing is ever
routed off the machine. Namespace ``N`` has ``127.77.N.1`` on the host end (``rbhN``)
and ``127.77.N.2`` inside (``rbnN``), a /30 link between them, and ``lo`` up inside (its
own ``127.0.0.1``). Linux drops 127/8 packets on any interface but ``lo`` unless that
interface's ``route_localnet`` is set (``Documentation/networking/ip-sysctl.rst``:
"route_localnet - BOOLEAN: Do not consider loopback addresses as martian source or
destination while routing"; the kernel reads it as the interface's value OR ``all``'s), so it
is set on both veth ends, and ``all`` inside the namespace (its own copy); the host's
``all`` is left as it is. Each end also gets a /32 route to the other with ``src`` set, so
a connection from either side leaves from its own veth address.

A process runs inside with :meth:`NetNamespace.command` (``ip netns exec NAME ...``). The
namespaces are named ``ragbudget-<pid>-<N>``: :func:`network_namespaces` picks free ``N``
under a file lock (concurrent test runs never share a subnet) and first deletes namespaces
whose creating process is gone (a run that was killed). It deletes its own, and their veth
pairs, on exit, whatever happened.

Needs root (``CAP_NET_ADMIN``) and iproute2's ``ip``; :func:`unavailable_reason` says
why not when they are missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import InvalidConfig

PREFIX = "ragbudget"
LOCK_PATH = Path("/tmp/ragbudget-netns.lock")
SUBNET = "127.77.0.0/16"  # every namespace's link lies in it (pg_hba.conf, firewall rules)
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)$")
MAX_NAMESPACES = 254


@dataclass(frozen=True)
class NetNamespace:
    """One namespace ("host") and the veth pair that joins it to the host namespace."""

    name: str
    index: int

    @property
    def host_ip(self) -> str:
        """The host end's address, ``127.77.N.1``: what a process inside dials to reach the host."""
        return f"127.77.{self.index}.1"

    @property
    def ns_ip(self) -> str:
        """The namespace end's address, ``127.77.N.2``: what the host dials to reach a process inside."""
        return f"127.77.{self.index}.2"

    @property
    def host_if(self) -> str:
        """The host end's interface name (``rbhN``; 15 characters at most, as Linux requires)."""
        return f"rbh{self.index}"

    @property
    def ns_if(self) -> str:
        """The namespace end's interface name (``rbnN``)."""
        return f"rbn{self.index}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace: ``["ip", "netns", "exec", name, *argv]``."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not Linux, not root, no ``ip``), or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run the tests as root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def existing() -> list[str]:
    """Names of every network namespace on the machine (``ip netns list``)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete(name: str, host_if: str | None = None) -> None:
    """Delete namespace ``name`` and its veth pair (idempotent). The pair is deleted first, by
    its host end, because a deleted namespace's devices go away later, from a kernel work queue."""
    if host_if is not None:
        _ip("link", "delete", host_if, check=False)
    _ip("netns", "delete", name, check=False)


def _used_indices(names: Sequence[str]) -> set[int]:
    used = {int(m.group(2)) for n in names if (m := _NAME.match(n))}
    links = _ip("-o", "link", "show").stdout  # a host end left behind by some other tool
    used |= {int(i) for i in re.findall(r"\brbh(\d+)\b", links)}
    addrs = _ip("-o", "-4", "addr", "show").stdout
    used |= {int(i) for i in re.findall(r"\b127\.77\.(\d+)\.\d+", addrs)}
    return used


def _sysctl(setting: str, namespace: str | None = None) -> None:
    argv = ["sysctl", "-q", "-w", setting]
    if namespace is not None:
        argv = ["ip", "netns", "exec", namespace, *argv]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


def _create(ns: NetNamespace) -> None:
    """Make ``ns``: the namespace, the veth pair, addresses, ``route_localnet`` and routes."""
    _ip("netns", "add", ns.name)
    _ip("link", "add", ns.host_if, "type", "veth", "peer", "name", ns.ns_if, "netns", ns.name)
    _ip("addr", "add", f"{ns.host_ip}/30", "dev", ns.host_if)
    _ip("-n", ns.name, "addr", "add", f"{ns.ns_ip}/30", "dev", ns.ns_if)
    _sysctl(f"net.ipv4.conf.{ns.host_if}.route_localnet=1")
    _sysctl(f"net.ipv4.conf.{ns.ns_if}.route_localnet=1", ns.name)
    _sysctl("net.ipv4.conf.all.route_localnet=1", ns.name)
    _ip("link", "set", ns.host_if, "up")
    _ip("-n", ns.name, "link", "set", "lo", "up")
    _ip("-n", ns.name, "link", "set", ns.ns_if, "up")
    _ip("route", "replace", f"{ns.ns_ip}/32", "dev", ns.host_if, "src", ns.host_ip)
    _ip("-n", ns.name, "route", "replace", f"{ns.host_ip}/32", "dev", ns.ns_if, "src", ns.ns_ip)


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    with LOCK_PATH.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale() -> list[str]:
    """Delete ``ragbudget-<pid>-<N>`` namespaces whose process ``pid`` is gone; returns their names."""
    gone = [n for n in existing() if (m := _NAME.match(n)) and not _pid_alive(int(m.group(1)))]
    for name in gone:
        _delete(name, f"rbh{_NAME.match(name).group(2)}")  # type: ignore[union-attr]
    return gone


@contextlib.contextmanager
def network_namespaces(count: int) -> Iterator[list[NetNamespace]]:
    """``count`` fresh namespaces, each joined to this one by a veth pair (see the module doc);
    all deleted on exit, also when the body or a later creation fails.

    Raises:
        InvalidConfig: namespaces cannot be made here (:func:`unavailable_reason`), or no free
            subnet index is left.
        subprocess.CalledProcessError: an ``ip`` or ``sysctl`` command failed (its stderr is
            in the exception).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise InvalidConfig(reason)
    made: list[NetNamespace] = []
    try:
        with _lock():
            remove_stale()
            used = _used_indices(existing())
            free = [i for i in range(1, MAX_NAMESPACES + 1) if i not in used][:count]
            if len(free) < count:
                raise InvalidConfig(f"no free 127.77.N.0/30 subnet for {count} namespaces")
            for i in free:
                ns = NetNamespace(f"{PREFIX}-{os.getpid()}-{i}", i)
                made.append(ns)
                _create(ns)
        yield made
    finally:
        for ns in made:
            _delete(ns.name, ns.host_if)
