"""Which process owns a piece of state, and whether that process still runs (one host).

A process is named by ``(host, pid, token)``. On Linux ``token`` is
``<boot id>/<start time>``: the kernel's boot id (``/proc/sys/kernel/random/boot_id``)
and the process's start time in clock ticks after boot (field 22 of
``/proc/<pid>/stat``, proc(5)), so a pid reused by another process, or the same
pid after a reboot or a container restart, is not taken for the owner. Elsewhere
``token`` is empty and liveness falls back to ``os.kill(pid, 0)`` alone.

Liveness can only be judged on the owner's own host: :func:`owner_gone` answers
False (alive, as far as anyone here can tell) for another host's process.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class ProcessIdentity:
    """``host`` (``socket.gethostname()``), ``pid`` and ``token`` (see the module docstring)."""

    host: str
    pid: int
    token: str


def _start_ticks(pid: int) -> str | None:
    """Field 22 (starttime) of ``/proc/<pid>/stat``; None when there is no such process or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ")".
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None  # fields[0] is field 3 (state)


def _boot_id() -> str | None:
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def process_token(pid: int) -> str:
    """``<boot id>/<start ticks>`` of ``pid`` on this host, or ``""`` where /proc cannot tell."""
    boot, start = _boot_id(), _start_ticks(pid)
    return f"{boot}/{start}" if boot and start else ""


def current_process() -> ProcessIdentity:
    """This process's identity."""
    pid = os.getpid()
    return ProcessIdentity(host=socket.gethostname(), pid=pid, token=process_token(pid))


def process_alive(pid: int, token: str) -> bool:
    """Whether the process ``(pid, token)`` of this host still runs.

    With a token: a process with that pid exists and has that boot id and start time.
    Without one: ``os.kill(pid, 0)`` succeeds or is refused for permission (the pid exists).
    """
    if pid <= 0:
        return False
    if token:
        return process_token(pid) == token
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_gone(host: str, pid: int, token: str) -> bool:
    """True when the process that wrote ``(host, pid, token)`` is known to have ended: it ran on
    this host and is no longer alive. Another host's process is never judged gone from here."""
    return host == socket.gethostname() and not process_alive(pid, token)
