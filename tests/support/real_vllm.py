"""A real vLLM (CPU build, `.venv-vllm`) as a test server: the tests that check what the fakes cannot.

    with RealVLLM.start(model_dir, log_dir, extra_args=["--enable-lora", ...]) as vllm:
        vllm.url, vllm.port, vllm.name       # what GatewayProcess needs of an instance

It runs as instances serving captured traffic must (`--logprobs-mode processed_logprobs`, docs/training.md
"Sampling"), float32, `--max-model-len 1024`, served as `tiny`, in its own process group (killed on exit). Start-up
takes about a minute on 2 cores. `VLLM_PYTHON` is `.venv-vllm`'s interpreter or RL_TEST_VLLM_PYTHON.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("RL_TEST_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
START_TIMEOUT_S = 240.0
MISSING = f"no vLLM environment at {VLLM_PYTHON} (run `make venv-vllm` or set RL_TEST_VLLM_PYTHON)"


@dataclass(frozen=True)
class RealVLLM:
    """What GatewayProcess needs of an instance, plus the process and its log."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    @staticmethod
    @contextmanager
    def start(model_dir: Path, log_dir: Path, *, extra_args: Sequence[str] = (),
              name: str = "vllm-real") -> Iterator["RealVLLM"]:
        port = free_port()
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="true", VLLM_CPU_KVCACHE_SPACE="1",
                   HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
        log_path = log_dir / "vllm.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                 "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "1024",
                 "--logprobs-mode", "processed_logprobs", *extra_args, "--host", "127.0.0.1", "--port", str(port)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        vllm = RealVLLM(name, port, proc, log_path)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                assert proc.poll() is None, f"vLLM exited with {proc.returncode}:\n{vllm.log_tail()}"
                try:
                    if httpx.get(vllm.url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"vLLM not healthy in {START_TIMEOUT_S} s:\n{vllm.log_tail()}"
                time.sleep(1)
            yield vllm
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # only the group this fixture created
            proc.wait()
