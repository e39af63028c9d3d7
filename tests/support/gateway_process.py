"""The reference gateway as a real process (`openjiuwen-rl gateway --config FILE`) with its RL Service child.

    with GatewayProcess(tmp_path, redis_url, instances=[vllm_a, vllm_b], judge_url=judge.url) as gw:
        gw.signed("POST", "/v1/rl/service/start")               # HMAC-signed control call (httpx.Response)
        gw.signed("POST", "/v1/rl/tasks/start", agent="agent-a", ...)  # signed with an agent key instead
        gw.wait_run(run_id)                                     # a Training Run's record once it is terminal
        openai.OpenAI(base_url=gw.url + "/v1", api_key="x")     # agents talk to gw.url, unsigned

`nofile_soft=1024` starts the gateway with that soft open-files limit (systemd's default for a service), `nofile_hard`
with that hard one.
It writes the HMAC key file (mode 0600: the gateway refuses any other; the operator, instance and agent keys of
`API_KEY`, `INS_KEY`, `AGENT_KEYS` unless told otherwise), the RL Service YAML (scripted trainer, the test's Redis
and Judge) and the gateway JSON config, starts the gateway in its own process group, and waits for
`GET /aigw/v1/health`. Leaving the block kills
the gateway's group and the child's (the child's own parent-death signal covers a gateway SIGKILL too).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import RequestSigner
from tests.support.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = b"k" * 32
INS_KEY = b"i" * 32
AGENT_KEYS = {"agent-a": b"A" * 32, "agent-b": b"B" * 32}
READY_TIMEOUT_S = 30.0
# The fake vLLM instances listen on loopback, which registration refuses unless the operator allows it.
LOOPBACK_REGISTRATION = {"registration": {"allowedNetworks": ["127.0.0.0/8"]}}


def write_key_file(path: Path, document: dict[str, Any]) -> None:
    """A key file private to its owner from its first byte (the gateway refuses one group or others may read)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
        handle.write(orjson.dumps(document))


class GatewayProcess:
    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        *,
        instances: list[Any],
        judge_url: str = "",
        model_id: str = "tiny",
        rl_overrides: dict[str, Any] | None = None,
        online_overrides: dict[str, Any] | None = None,
        lora_overrides: dict[str, Any] | None = None,
        global_overrides: dict[str, Any] | None = None,
        extra_config: dict[str, Any] | None = None,
        listen_host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        log_level: str = "INFO",
        api_key: bytes = API_KEY,
        ins_key: bytes = INS_KEY,
        agent_keys: dict[str, bytes] | None = None,
        agent_caps: dict[str, int] | None = None,
        nofile_soft: int | None = None,
        nofile_hard: int | None = None,
    ) -> None:
        self.dir = Path(tmp) / "gateway"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.rl_port = free_port()
        self.lora_root = (Path(tmp) / "loras").resolve()
        self.lora_root.mkdir(parents=True, exist_ok=True)
        self.model_id = model_id
        self.key_file = self.dir / "hmac.json"
        self.agent_keys = dict(AGENT_KEYS if agent_keys is None else agent_keys)
        assert all(len(key) == 32 for key in self.agent_keys.values())  # written as 64 hex digits
        write_key_file(self.key_file, {
            "apiHmacKey": api_key.decode(), "insHmacKey": ins_key.decode(),
            "agentHmacKeys": [{"id": key_id, "key": key.hex(),
                               **({"maxLineages": (agent_caps or {})[key_id]} if key_id in (agent_caps or {}) else {})}
                              for key_id, key in self.agent_keys.items()],
        })
        self.api_key = api_key
        self.log_level = log_level
        rl_config = {
            "listen_port": self.rl_port,
            "redis_url": redis_url,
            "model_id": model_id,
            "base_model_path": "/models/tiny",
            "aigw_endpoint": f"http://127.0.0.1:{self.port}",
            "lora_repository_path": str(self.lora_root),
            "log_path": str(self.dir / "rl-service.log"),
            "record_dir": str(self.dir / "records"),
            "trainer_backend": "scripted",
            "min_samples_for_training": 1,
            "max_samples_per_run": 8,
            "turn_publish_timeout_seconds": 5.0,
            "lora_activation_timeout": 10.0,
            "training_tmp_root": str(self.dir / "train-tmp"),
        }
        if judge_url:
            rl_config.update(judge_endpoint=judge_url, judge_model="judge", judge_retries=0, judge_timeout=5.0)
        rl_config.update(rl_overrides or {})
        self.rl_config_path = self.dir / "rl-service.yaml"
        self.rl_config_path.write_text(yaml.safe_dump(rl_config))
        self.plan_path = self.dir / "scripted-plan.json"
        self.plan_path.write_bytes(orjson.dumps({"outcome": "succeed"}))
        online = {
            "command": [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.online.service"],
            "configPath": str(self.rl_config_path),
            "modelId": model_id,
            "endpoint": f"http://127.0.0.1:{self.rl_port}",
            "hookTimeout": "5s",
            "hookRetries": 1,
            "drainTimeout": "2s",
            "controlTimeout": "30s",
            **(online_overrides or {}),
        }
        self.config = {
            "global": {"listen": f"{listen_host}:{self.port}", "hmacKeyFile": str(self.key_file),
                       **(global_overrides or {})},
            "instances": [
                {"name": v.name, "model": model_id, "instanceIp": "127.0.0.1", "port": v.port} for v in instances
            ],
            "lora": {"root": str(self.lora_root), "statePath": str(self.dir / "lora-state.json"),
                     "operationTimeout": "5s", **(lora_overrides or {})},
            "onlineRL": online,
            **(extra_config or {}),  # further top-level sections (instanceHealth, registration)
        }
        self.config_path = self.dir / "gateway.json"
        self.config_path.write_bytes(orjson.dumps(self.config))
        self.env = {k: v for k, v in os.environ.items() if k not in ("RL_SERVICE_TOKEN", "RL_SERVICE_CONFIG")}
        self.env["ONLINE_RL_SCRIPTED_PLAN"] = str(self.plan_path)
        self.env.update(env or {})
        self.nofile_soft = nofile_soft  # start with this soft RLIMIT_NOFILE (systemd's default is 1024)
        self.nofile_hard = nofile_hard  # and this hard one (None: the test's own)
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self._signers: dict[tuple[bytes, str | None], RequestSigner] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def rl_url(self) -> str:
        return f"http://127.0.0.1:{self.rl_port}"

    # ------------------------------------------------------------ process

    def start(self) -> "GatewayProcess":
        stderr = open(self.dir / "gateway.stderr.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "gateway",
             "--config", str(self.config_path), "--log-level", self.log_level],
            cwd=REPO_ROOT, env=self.env, stdout=stderr, stderr=stderr, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=self._limit_open_files if self.nofile_soft else None,
        )
        stderr.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}:\n{self.stderr()[-3000:]}")
            try:
                if self.http.get("/aigw/v1/health").json().get("status") == "ok":
                    return self
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"gateway not ready in {READY_TIMEOUT_S} s:\n{self.stderr()[-3000:]}")

    def _limit_open_files(self) -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile_soft, self.nofile_hard or hard))

    def rl_log(self) -> str:
        """The RL Service's business log (`log_path` of its config)."""
        path = self.dir / "rl-service.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stderr(self) -> str:
        path = self.dir / "gateway.stderr.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def sigkill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def __enter__(self) -> "GatewayProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.http.close()

    # ------------------------------------------------------------ calls

    def signed(self, method: str, path: str, *, json: Any = None, headers: dict[str, str] | None = None,
               key: bytes | None = None, agent: str | None = None, **kwargs: Any) -> httpx.Response:
        """A signed control call: with the operator key, `key`, or the agent key of id `agent`."""
        return self.http.send(self.signed_request(method, path, json=json, headers=headers, key=key, agent=agent,
                                                  **kwargs))

    def signed_request(self, method: str, path: str, *, json: Any = None, headers: dict[str, str] | None = None,
                       key: bytes | None = None, agent: str | None = None, **kwargs: Any) -> httpx.Request:
        """The signed request `signed` sends, built and not sent (to tamper with it, as an interceptor would)."""
        body = b"" if json is None else orjson.dumps(json)
        h = {"content-type": "application/json"} if json is not None else {}
        h.update(headers or {})
        request = self.http.build_request(method, path, content=body, headers=h, **kwargs)
        signing = (self.agent_keys[agent], agent) if agent is not None else (key or self.api_key, None)
        # One signer per key: strictly increasing timestamps, so identical calls in one millisecond are no replay.
        signer = self._signers.setdefault(signing, RequestSigner(signing[0], key_id=signing[1]))
        return signer.sign_httpx(request)

    def agent_key_file(self, agent: str) -> Path:
        """The agent's own key file (what `openjiuwen-rl keys add-agent` writes), for clients run as processes."""
        path = self.dir / f"{agent}.key.json"
        write_key_file(path, {"agentKeyId": agent, "agentHmacKey": self.agent_keys[agent].hex()})
        return path

    def start_service(self) -> None:
        r = self.signed("POST", "/v1/rl/service/start")
        assert r.status_code == 200 and r.json()["status"] == "running", r.text

    def start_task(self, session: str, mode: str = "terminal", *, agent: str | None = None) -> httpx.Response:
        return self.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": mode},
                           headers={"X-Agent-Session-Id": session}, agent=agent)

    def wait_run(self, run_id: str, timeout_s: float = 180.0) -> dict[str, Any]:
        """The Training Run's record once it is terminal (succeeded, failed or canceled)."""
        deadline = time.monotonic() + timeout_s
        while (run := self.signed("GET", f"/v1/rl/training/runs/{run_id}").json())["status"] not in (
                "succeeded", "failed", "canceled"):
            assert time.monotonic() < deadline, f"run not terminal in {timeout_s} s: {run}"
            time.sleep(0.5)
        return run

    def set_plan(self, plan: dict[str, Any]) -> None:
        self.plan_path.write_bytes(orjson.dumps(plan))
