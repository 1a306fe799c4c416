"""Network namespaces as separate hosts (:mod:`ragbudget_testing.netns`): each side reaches a
server on the other over the veth pair's loopback-range addresses, a namespace does not share
the host's loopback, and everything is deleted on exit, also after a failure."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from ragbudget_testing.netns import NetNamespace, existing, network_namespaces
from tests.fleet.conftest import require_netns

# A one-shot TCP echo server: binds (host, port), prints "ready", answers one client with
# "echo:" + what it sent and the client's address.
SERVE_ONE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, addr = s.accept(); data = c.recv(64); c.sendall(b"echo:" + data + b" from " + addr[0].encode())
c.close()
"""
# Dial (host, port), send a word, print the reply (exit 1 with the error when it cannot connect).
DIAL = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
except OSError as exc:
    print(f"cannot connect: {exc}"); sys.exit(1)
s.sendall(b"ping"); print(s.recv(128).decode())
"""


@pytest.fixture
def namespace() -> Iterator[NetNamespace]:
    require_netns()
    with network_namespaces(1) as (ns,):
        yield ns


def echo_server(host: str) -> tuple[socket.socket, threading.Thread, list[str]]:
    """A one-shot echo server on ``host`` in this (the host) namespace."""
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1)
    seen: list[str] = []

    def serve() -> None:
        c, addr = srv.accept()
        seen.append(addr[0])
        c.sendall(b"echo:" + c.recv(64) + b" from " + addr[0].encode())
        c.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return srv, thread, seen


def test_a_process_in_the_namespace_reaches_a_server_on_the_host_end(namespace: NetNamespace) -> None:
    srv, thread, seen = echo_server(namespace.host_ip)
    port = srv.getsockname()[1]
    out = subprocess.run(namespace.command([sys.executable, "-c", DIAL, namespace.host_ip, str(port)]),
                         capture_output=True, text=True, timeout=30)
    thread.join(10)
    srv.close()
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"echo:ping from {namespace.ns_ip}"
    assert seen == [namespace.ns_ip]  # it came over the veth pair, from the namespace's own address


def test_the_host_reaches_a_server_inside_the_namespace(namespace: NetNamespace) -> None:
    port = 18_000 + namespace.index
    proc = subprocess.Popen(namespace.command([sys.executable, "-c", SERVE_ONE, namespace.ns_ip, str(port)]),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with socket.create_connection((namespace.ns_ip, port), timeout=5) as s:
            s.sendall(b"pong")
            assert s.recv(128).decode() == f"echo:pong from {namespace.host_ip}"
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_namespace_has_its_own_loopback(namespace: NetNamespace) -> None:
    """A server on the host's 127.0.0.1 is not there for a process inside: a separate host."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        out = subprocess.run(namespace.command([sys.executable, "-c", DIAL, "127.0.0.1", str(port)]),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and "cannot connect" in out.stdout, out.stdout + out.stderr


def test_namespaces_are_deleted_on_exit_even_after_a_failure() -> None:
    require_netns()
    names: list[str] = []
    ends: list[str] = []
    with pytest.raises(RuntimeError, match="the body failed"), network_namespaces(2) as made:
        names, ends = [ns.name for ns in made], [ns.host_if for ns in made]
        assert set(names) <= set(existing())
        assert made[0].host_ip != made[1].host_ip
        raise RuntimeError("the body failed")
    assert len(names) == 2 and not set(names) & set(existing())
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert not [end for end in ends if f" {end}@" in links or f" {end}:" in links]
