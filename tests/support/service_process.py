"""The RL Service as a real process: `python -m openjiuwen.agent_evolving.agent_rl.online.service --config FILE`.

    with ServiceProcess(tmp_path, redis_url) as svc:      # writes the YAML config, starts, awaits GET /health 200
        httpx.get(svc.url + "/health")
        svc.sigterm(); assert svc.wait(10) == 0

Each process runs in its own process group, with stdout/stderr in files under `tmp`; leaving the `with` block always
kills the whole group (only the group it created). `via_parent=True` starts it under an intermediate Python
launcher, so a test can SIGKILL that parent (`kill_parent()`) and check the parent-death watchdog; `pid` is then the
service's pid, `parent_pid` the launcher's. `with ServiceProcess(...).start(wait_ready=False) as svc:` plus `svc.wait()`
covers processes that must refuse to start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULE = "openjiuwen.agent_evolving.agent_rl.online.service"
READY_TIMEOUT_S = 20.0

# The intermediate parent: starts the service, writes its pid, then just waits for it (never forwards signals).
_LAUNCHER = (
    "import subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[2:])\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    f.write(str(child.pid))\n"
    "sys.exit(child.wait())\n"
)


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs: absent, or a zombie nobody reaped yet (PID 1 here may not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    state = stat.rsplit(")", 1)[1].split()[0]  # the comm field may hold spaces and parentheses
    return state in ("Z", "X")


def worker_pids(pid: int) -> set[int]:
    """The worker processes of a worker group (`workers` > 1): the children of the group's process."""
    out: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out |= {int(c) for c in (task / "children").read_text().split()}
    except OSError:
        pass
    return out


class ServiceProcess:
    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        *,
        name: str = "svc",
        env: dict[str, str] | None = None,
        via_parent: bool = False,
        port: int | None = None,
        **overrides: Any,
    ) -> None:
        self.dir = Path(tmp) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config: dict[str, Any] = {
            "listen_host": "127.0.0.1",
            "listen_port": self.port,
            "redis_url": redis_url,
            "model_id": "tiny",
            "base_model_path": "/models/tiny",
            "lora_repository_path": str((Path(tmp) / "loras").resolve()),
            "log_path": str((Path(tmp) / "rl-service.log").resolve()),
            "record_dir": str((Path(tmp) / "records").resolve()),
            "turn_publish_timeout_seconds": 5.0,
            **overrides,
        }
        self.config_path = self.dir / "rl-service.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = Path(self.config["log_path"])
        self.stdout_path = self.dir / "stdout.txt"
        self.stderr_path = self.dir / "stderr.txt"
        self.pid_path = self.dir / "service.pid"
        self.env = {k: v for k, v in os.environ.items() if k not in ("RL_SERVICE_TOKEN", "RL_SERVICE_CONFIG")}
        self.env.update(env or {})
        self.via_parent = via_parent
        self.proc: subprocess.Popen[bytes] | None = None  # the launcher when via_parent, else the service
        self.pid: int | None = None  # the service

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def parent_pid(self) -> int:
        assert self.proc is not None and self.via_parent
        return self.proc.pid

    def start(self, *, wait_ready: bool = True, timeout_s: float = READY_TIMEOUT_S) -> "ServiceProcess":
        command = [sys.executable, "-m", MODULE, "--config", str(self.config_path)]
        if self.via_parent:
            command = [sys.executable, "-c", _LAUNCHER, str(self.pid_path), *command]
        with self.stdout_path.open("ab") as out, self.stderr_path.open("ab") as err:
            self.proc = subprocess.Popen(
                command, cwd=REPO_ROOT, env=self.env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        if not self.via_parent:
            self.pid = self.proc.pid
        if wait_ready:
            self.wait_ready(timeout_s)
        return self

    def _service_pid(self, deadline: float) -> int:
        while self.pid is None:
            text = self.pid_path.read_text() if self.pid_path.exists() else ""
            if text.strip():
                self.pid = int(text)
            elif time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                self.fail("the launcher did not report the service pid")
            else:
                time.sleep(0.05)
        return self.pid

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll GET /health until 200; fail with the process output if it exits or the deadline passes."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        pid = self._service_pid(deadline)
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None or process_gone(pid):
                    self.fail("the service exited before it was ready")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        self.fail(f"GET /health did not answer 200 within {timeout_s} s")

    def output(self) -> str:
        parts = []
        for label, path in (("stdout", self.stdout_path), ("stderr", self.stderr_path), ("log", self.log_path)):
            text = path.read_text(errors="replace") if path.exists() else "<missing>"
            parts.append(f"--- {label} ({path}) ---\n{text[-6000:]}")
        return "\n".join(parts)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def fail(self, why: str) -> None:
        self.kill_group()
        raise AssertionError(f"{why}\n{self.output()}")

    # ----------------------------------------------------------------- signals

    def _signal(self, sig: signal.Signals) -> None:
        assert self.pid is not None
        os.kill(self.pid, sig)

    def sigterm(self) -> None:
        self._signal(signal.SIGTERM)

    def sigkill(self) -> None:
        self._signal(signal.SIGKILL)

    def kill_parent(self) -> None:
        """SIGKILL the intermediate launcher only (never its group): the service must notice on its own."""
        os.kill(self.parent_pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(timeout=10)

    def wait(self, timeout_s: float) -> int:
        """The service's exit status (negative: killed by that signal); AssertionError after `timeout_s`."""
        assert self.proc is not None
        if self.via_parent:
            # The launcher exits with the service's status (or dies first, when a test kills it).
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.fail(f"the service did not exit within {timeout_s} s")
            raise  # unreachable: fail() raises

    def wait_gone(self, timeout_s: float) -> float:
        """Seconds until the service pid is gone (reaped or zombie); AssertionError after `timeout_s`."""
        assert self.pid is not None
        start = time.monotonic()
        while not process_gone(self.pid):
            if time.monotonic() - start > timeout_s:
                self.fail(f"service pid {self.pid} still alive after {timeout_s} s")
            time.sleep(0.05)
        return time.monotonic() - start

    def kill_group(self) -> None:
        """SIGKILL every process of the group this helper started; reap the direct child."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group id is the first child's pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        if self.pid is not None and self.pid != self.proc.pid and not process_gone(self.pid):
            try:  # the service left the group only if it was re-parented; it is still ours
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "ServiceProcess":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill_group()
