"""Peer capture gateways for the capture bench, and the online-RL service of PyPI's `openjiuwen` SDK for the hook and
storage benches, each in its own throw-away virtual environment under bench/.peers/ (git-ignored), installed from
PyPI by `ensure(name)` on first use. Our code never imports them: they run as processes.

    .venv/bin/python bench/peers.py install [rllm openjiuwen ...]    # what the benches do themselves

A peer is started pointing at the bench upstream; `session_request(i)` gives the HTTP path and headers through which
session i's completions are captured by that peer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "bench" / ".peers"

# name: (pip requirements, what it is)
INSTALLS: dict[str, tuple[tuple[str, ...], str]] = {
    "rllm": (("rllm-model-gateway==0.1.0",),
             "rllm-model-gateway: FastAPI + httpx proxy, traces per /sessions/{id}/v1, default sqlite store"),
    "agentlightning": (("agentlightning==0.3.0",),
                       "agentlightning LLMProxy: LiteLLM proxy + middlewares, OpenTelemetry spans into an in-memory "
                       "LightningStore, per /rollout/{r}/attempt/{a}/v1 (bench/peer_agentlightning.py)"),
    # The `online-rl` extra alone does not start: service.py imports openjiuwen.extensions.observability, which
    # needs opentelemetry-exporter-otlp (ModuleNotFoundError: No module named 'opentelemetry.exporter'), shipped by
    # the `observability` extra.
    "openjiuwen": (("openjiuwen[online-rl,observability]==0.1.19.post2",),
                   "the online-RL service of PyPI's openjiuwen SDK (FastAPI + redis-py, same hook routes)"),
}
# The capture gateways measured by capture_bench (the SDK's service is not a gateway: hooks and storage benches).
PEERS: dict[str, tuple[tuple[str, ...], str]] = {k: v for k, v in INSTALLS.items() if k != "openjiuwen"}
# Nothing here may pull a CUDA torch: the CPU wheel on this machine's disk, if anything asks for torch at all.
CONSTRAINTS = "torch==2.13.0\n"


def python_of(name: str) -> Path:
    return PEERS_DIR / name / "bin" / "python"


def ensure(name: str) -> tuple[bool, str]:
    """(installed, why not). Creates bench/.peers/<name> and pip-installs the pinned peer once."""
    requirements, _ = INSTALLS[name]
    requirement = " ".join(requirements)
    py = python_of(name)
    stamp = PEERS_DIR / name / ".installed"
    if stamp.exists() and stamp.read_text() == requirement:
        return True, ""
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_DIR / name)], check=True, timeout=300)
        constraints = PEERS_DIR / "constraints.txt"
        constraints.write_text(CONSTRAINTS)
        done = subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(constraints), *requirements],
                              capture_output=True, text=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        return False, f"install failed: {exc}"
    if done.returncode != 0:
        return False, "pip install failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]
    stamp.write_text(requirement)
    return True, ""


@dataclass
class RunningPeer:
    name: str
    port: int
    proc: subprocess.Popen
    sessions: list | None = None  # agentlightning: (rollout id, attempt id) per session

    def session_request(self, i: int) -> tuple[str, dict[str, str]]:
        if self.name == "rllm":
            return f"/sessions/bench-{i}/v1/chat/completions", {}
        if self.name == "agentlightning" and self.sessions:
            rollout, attempt = self.sessions[i % len(self.sessions)]
            return f"/rollout/{rollout}/attempt/{attempt}/v1/chat/completions", {}
        raise KeyError(self.name)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(name: str, *, port: int, upstream_url: str, workdir: Path, sessions: int = 256) -> RunningPeer:
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / f"{name}.log", "wb")
    sessions_file = workdir / f"{name}-sessions.json"
    sessions_file.unlink(missing_ok=True)
    if name == "rllm":
        argv = [str(python_of(name)), "-m", "rllm_model_gateway", "--host", "127.0.0.1", "--port", str(port),
                "--worker", upstream_url, "--db-path", str(workdir / "rllm-traces.db"), "--log-level", "warning"]
    elif name == "agentlightning":
        argv = [str(python_of(name)), str(ROOT / "bench" / "peer_agentlightning.py"), "--port", str(port),
                "--upstream", upstream_url, "--sessions", str(sessions), "--sessions-file", str(sessions_file)]
    else:
        raise KeyError(name)
    proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=workdir)
    log.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"peer {name} exited: {(workdir / f'{name}.log').read_text()[-1500:]}")
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            ready = False
        if ready and name != "agentlightning":
            return RunningPeer(name, port, proc)
        if ready and sessions_file.exists():
            return RunningPeer(name, port, proc, json.loads(sessions_file.read_text()))
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"peer {name} not ready in 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["install"])
    parser.add_argument("names", nargs="*", default=sorted(INSTALLS))
    args = parser.parse_args()
    for name in args.names:
        ok, why = ensure(name)
        print(f"{name}: {'installed' if ok else why}")


if __name__ == "__main__":
    main()
