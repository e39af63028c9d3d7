"""Peer capture gateways for the capture bench, each in its own throw-away virtual environment under bench/.peers/
(git-ignored), installed from PyPI by `ensure(name)` on first use. Our code never imports them: they run as processes.

    .venv/bin/python bench/peers.py install [rllm ...]    # what capture_bench does itself

A peer is started pointing at the bench upstream; `session_request(i)` gives the HTTP path and headers through which
session i's completions are captured by that peer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "bench" / ".peers"

# name: (pip requirement, what it is)
PEERS: dict[str, tuple[str, str]] = {
    "rllm": ("rllm-model-gateway==0.1.0",
             "rllm-model-gateway: FastAPI + httpx proxy, traces per /sessions/{id}/v1, default sqlite store"),
}


def python_of(name: str) -> Path:
    return PEERS_DIR / name / "bin" / "python"


def ensure(name: str) -> tuple[bool, str]:
    """(installed, why not). Creates bench/.peers/<name> and pip-installs the pinned peer once."""
    requirement, _ = PEERS[name]
    py = python_of(name)
    stamp = PEERS_DIR / name / ".installed"
    if stamp.exists() and stamp.read_text() == requirement:
        return True, ""
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_DIR / name)], check=True, timeout=300)
        done = subprocess.run([str(py), "-m", "pip", "install", "-q", requirement], capture_output=True, text=True,
                              timeout=900)
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

    def session_request(self, i: int) -> tuple[str, dict[str, str]]:
        if self.name == "rllm":
            return f"/sessions/bench-{i}/v1/chat/completions", {}
        raise KeyError(self.name)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(name: str, *, port: int, upstream_url: str, workdir: Path) -> RunningPeer:
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / f"{name}.log", "wb")
    if name == "rllm":
        argv = [str(python_of(name)), "-m", "rllm_model_gateway", "--host", "127.0.0.1", "--port", str(port),
                "--worker", upstream_url, "--db-path", str(workdir / "rllm-traces.db"), "--log-level", "warning"]
    else:
        raise KeyError(name)
    proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=workdir)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"peer {name} exited: {(workdir / f'{name}.log').read_text()[-1500:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return RunningPeer(name, port, proc)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"peer {name} not ready in 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["install"])
    parser.add_argument("names", nargs="*", default=sorted(PEERS))
    args = parser.parse_args()
    for name in args.names:
        ok, why = ensure(name)
        print(f"{name}: {'installed' if ok else why}")


if __name__ == "__main__":
    main()
