"""The demo's own processes: each in its own process group, its output in a log file, stopped by pid and group.

Nothing here kills by name: a process is stopped through the pid (and process group) this module started, and the
final sweep only looks at processes whose command line names the demo's private run directory (every process the
demo starts, directly or through the gateway, carries a path inside it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound and released; the process that needs it binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs: absent, or a zombie (nobody reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def children(pid: int) -> list[int]:
    """The child pids of `pid`, from every thread's `children` list."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(found))


def ancestors(pid: int) -> set[int]:
    """`pid` and every process above it (parent, grandparent, ...)."""
    found = {pid}
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        found.add(pid)
    return found


def pids_mentioning(marker: str) -> list[int]:
    """Live processes (not this one) whose command line contains `marker` (the demo's run directory)."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline and not process_gone(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


class ManagedProcess:
    """One process started by the demo in a new session (its own process group), stdout+stderr to `log_path`."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
            )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def exit_description(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL the group; always reaps the process."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The leader may be gone while members of its group remain: the group is ours either way.
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait until every pid is gone; return those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if not process_gone(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if not process_gone(p)]
    return left
