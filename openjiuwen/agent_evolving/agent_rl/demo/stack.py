"""The demo's stack: the model, the processes, their health waits, the signed clients, and stopping all of it.

Set-up: a tiny random model (`make_tiny_model`) or SmolLM2-135M-Instruct (provisioned by `model_makers/smollm2.py`), a
private `redis-server`, a real vLLM server (CPU build, from its own environment, runtime LoRA updating on), the
reference gateway (`openjiuwen-rl gateway --config`) with an HMAC key file made here, and its RL Service child with
the local PPO trainer (configs from `stack_config.py`). Every process runs in its own process group on a free
loopback port, with its log in the run directory (`demo-run/<timestamp>/`). `--instances URL...` uses running
OpenAI-compatible servers (e.g. fake vLLMs) instead of starting vLLM.

Clients: `signed` sends HMAC-signed control requests with the operator key, or with the demo agents' own agent key
(which may only start, stop and reward their Tasks); `agent` is the agents' `openai` SDK client through the gateway.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ContextManager
from urllib.parse import urlsplit

from ..common.wire import routes
from .failures import DemoFailed
from .processes import ManagedProcess, ancestors, children, free_port, pids_mentioning, wait_gone
from .progress import Bar
from .family_objectives import training_samples
from .stack_config import gateway_config, ppo_config, rl_service_config

DEMO_AGENT_KEY_ID = "demo-agent"  # the agents' own key in the gateway's key file (agentHmacKeys)
Stage = Callable[[str, "Path | None"], ContextManager[None]]  # the driver's step: its name and its log


class Stack:
    def __init__(self, args: argparse.Namespace, run_dir: Path, stage: Stage, t0: float) -> None:
        self.args = args
        self.run_dir = run_dir
        self.stage = stage
        self.t0 = t0
        self.procs: dict[str, ManagedProcess] = {}
        self.pids: dict[str, int] = {}
        self.timings: dict[str, float] = {}  # the set-up's, in the report's timings.setup
        self.model_conversion_s: float | None = None  # a model conversion the driver did: preparation, not demo
        self.model_dir: Path | None = None
        self.gateway_url = ""
        self.ppo_yaml: dict[str, Any] = {}
        self.vllm_port: int | None = None
        self.owns_run_dir = False  # set by the driver once it made the run directory: leftovers there are ours
        self._auth: Any = None  # the HmacAuth of the operator's key (the operator's calls)
        self._agent_auth: Any = None  # the HmacAuth of the demo agents' own agent key (Task start, stop, reward)
        self._http: Any = None
        self.agent: Any = None  # the agents' OpenAI client through the gateway (open_agent)

    # ------------------------------------------------------------------------------------------ set-up

    def setup(self) -> None:
        a = self.args
        bar = Bar("set-up", total=5, unit="steps")
        try:
            with self.stage("model", self.run_dir / "demo.log"):
                t = time.monotonic()
                self.provide_model(bar)
                self.timings["model_s"] = round(time.monotonic() - t, 2)
                bar.update(1, "model ready")

            vllm_started = time.monotonic()
            if a.instances is None:
                with self.stage("vLLM start", self.run_dir / "vllm.log"):
                    instances = [self.start_vllm()]
            else:
                instances = [(f"vllm-{n}", urlsplit(u).hostname or "127.0.0.1", urlsplit(u).port or 0)
                             for n, u in enumerate(a.instances)]

            with self.stage("redis", self.run_dir / "redis" / "redis.log"):
                t = time.monotonic()
                redis_url = self.start_redis()
                self.timings["redis_s"] = round(time.monotonic() - t, 2)
                bar.update(1, "redis ready")

            with self.stage("gateway", self.run_dir / "gateway" / "gateway.log"):
                t = time.monotonic()
                self.start_gateway(redis_url, instances)
                self.timings["gateway_s"] = round(time.monotonic() - t, 2)
                bar.update(1, "gateway ready")

            # The gateway keeps its child's stdout/stderr beside its LoRA state file, i.e. in gateway/.
            with self.stage("RL Service", self.run_dir / "gateway" / "rl-service.stderr.log"):
                t = time.monotonic()
                self.start_rl_service()
                self.timings["rl_service_s"] = round(time.monotonic() - t, 2)
                bar.update(1, "RL Service running")

            with self.stage("vLLM start", self.run_dir / "vllm.log"):
                if a.instances is None:
                    self.wait_vllm(instances[0][2], bar, vllm_started)
                else:
                    self.wait_instances(a.instances)
                self.wait_gateway_serving(bar)
                self.timings["vllm_ready_s"] = round(time.monotonic() - vllm_started, 2)
                bar.update(1, "vLLM serving")
        finally:
            bar.close()
        self.timings["total_s"] = round(time.monotonic() - self.t0, 2)

    def provide_model(self, bar: Bar) -> None:
        """SmolLM2 from its cache (converted there on a first run), a given --model, or a fresh tiny model."""
        a = self.args
        t = time.monotonic()
        if a.model is None and a.family == "calculator" and (a.trainer == "local" or a.instances is None):
            from ..model_makers.smollm2 import ProvisionError, default_cache_dir, provision

            bar.note("provisioning SmolLM2-135M-Instruct")
            try:
                with self._log_to(self.run_dir / "demo.log"):
                    self.model_dir, marker = provision(default_cache_dir())
            except ProvisionError as exc:
                raise DemoFailed(f"{exc} (`openjiuwen-rl model smollm2` provisions it)") from exc
            if not marker["reused"]:
                self.model_conversion_s = round(time.monotonic() - t, 2)
        elif a.model is not None:
            self.model_dir = a.model.resolve()
            if not (self.model_dir / "config.json").is_file():
                raise DemoFailed(f"--model {self.model_dir} has no config.json")
        elif a.trainer == "local" or a.instances is None:
            from ..model_makers.tiny import make_tiny_model

            bar.note("generating the tiny model")
            with self._log_to(self.run_dir / "demo.log"):
                self.model_dir = make_tiny_model(self.run_dir / "model", seed=a.seed,
                                                 hidden_size=a.hidden_size, num_heads=a.hidden_size // 64)
        else:  # scripted trainer on given instances: nothing reads the weights
            self.model_dir = self.run_dir / "model"

    @contextlib.contextmanager
    def _log_to(self, path: Path) -> Iterator[None]:
        """Send this process's stdout/stderr chatter (e.g. transformers' progress bars) to `path` for a moment."""
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])

    def _spawn(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> ManagedProcess:
        proc = ManagedProcess(name, argv, log_path=log, env=env, cwd=self.run_dir)
        self.procs[name] = proc
        self.pids[name] = proc.pid
        return proc

    def check(self, name: str) -> None:
        """Fail the step when the process `name` has ended, with the last lines of its log."""
        proc = self.procs[name]
        if not proc.alive():
            tail = "\n    ".join(proc.log_tail(1500).splitlines()[-12:])
            raise DemoFailed(f"{name} {proc.exit_description()}; last lines of {proc.log_path}:\n    {tail}")

    # ------------------------------------------------------------------------------------------ vLLM

    def start_vllm(self) -> tuple[str, str, int]:
        python = Path(os.path.abspath(self.args.vllm_python))  # absolute, but not resolved: it is a venv link
        if not python.exists():
            raise DemoFailed(f"no vLLM environment at {python}: run `make venv-vllm` (or `make demo`), or pass "
                             "--vllm-python")
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
        env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="true", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.args.model_id, "--enable-lora", "--max-lora-rank", "16",
                "--max-loras", "4", "--dtype", self.args.dtype, "--max-model-len", "1024",
                # captured logprobs must be the sampling distribution's (docs/training.md, "Sampling")
                "--logprobs-mode", "processed_logprobs",
                "--host", "127.0.0.1", "--port", str(port), "--seed", str(self.args.seed)]
        self._spawn("vllm", argv, self.run_dir / "vllm.log", env)
        self.vllm_port = port
        return ("vllm-0", "127.0.0.1", port)

    def wait_vllm(self, port: int, bar: Bar, started: float) -> None:
        import httpx

        deadline = started + self.args.vllm_timeout
        with httpx.Client(timeout=5, trust_env=False) as http:
            while True:
                self.check("vllm")
                try:
                    if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise DemoFailed(f"vLLM did not answer /health within {self.args.vllm_timeout:.0f} s")
                bar.note(f"waiting for vLLM ({time.monotonic() - started:.0f} s)")
                time.sleep(1)

    def wait_instances(self, urls: list[str]) -> None:
        import httpx

        with httpx.Client(timeout=5, trust_env=False) as http:
            for url in urls:
                deadline = time.monotonic() + self.args.vllm_timeout
                while True:
                    try:
                        if http.get(url.rstrip("/") + "/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise DemoFailed(f"instance {url} did not answer /health")
                    time.sleep(0.5)

    def wait_gateway_serving(self, bar: Bar, timeout_s: float = 120.0) -> None:
        """Until the gateway routes to every instance: a vLLM slower to start than the gateway's health checks allow
        is out of routing until its next good probe (first requests would be 503 `no_healthy_instances`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check("gateway")
            r = self.signed("GET", "/aigw/v1/instances")
            if r.status_code != 200:
                raise DemoFailed(f"GET /aigw/v1/instances answered {r.status_code}: {r.text[:300]}")
            waiting = [i["name"] for i in r.json()["items"] if not i.get("serving")]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise DemoFailed(f"the gateway does not route to {', '.join(waiting)} {timeout_s:.0f} s after "
                                 "vLLM answered /health (see its health-check lines in gateway.log)")
            bar.note(f"waiting for the gateway to readmit {', '.join(waiting)}")
            time.sleep(0.5)

    # ------------------------------------------------------------------------------------------ redis

    def start_redis(self) -> str:
        import socket

        binary = shutil.which("redis-server")
        if binary is None:
            raise DemoFailed("redis-server not found on PATH (`make demo` installs it with apt-get when it can)")
        workdir = self.run_dir / "redis"
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
                "--appendonly", "no", "--logfile", str(workdir / "redis.log"), "--protected-mode", "yes",
                "--daemonize", "no"]
        self._spawn("redis", argv, workdir / "redis.stdout.log")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            self.check("redis")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return f"redis://127.0.0.1:{port}/0"
            except OSError:
                time.sleep(0.05)
        raise DemoFailed("redis-server did not answer PING within 15 s")

    # ------------------------------------------------------------------------------------------ gateway

    def start_gateway(self, redis_url: str, instances: list[tuple[str, str, int]]) -> None:
        import httpx
        import yaml

        a = self.args
        gw_dir = self.run_dir / "gateway"
        gw_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "loras").mkdir(exist_ok=True)
        port, rl_port = free_port(), free_port()
        while rl_port == port:
            rl_port = free_port()
        key_file = self.make_keys(gw_dir)
        self.ppo_yaml = ppo_config(a)
        ppo_path = gw_dir / "ppo.yaml"
        ppo_path.write_text(yaml.safe_dump(self.ppo_yaml))
        per_lineage = None
        if a.lineages > 1 and a.family == "calculator":
            per_lineage = training_samples(a.tasks)
        rl_config = rl_service_config(a, run_dir=self.run_dir, rl_port=rl_port, gateway_port=port,
                                      redis_url=redis_url, model_dir=self.model_dir, ppo_path=ppo_path,
                                      per_lineage=per_lineage)
        rl_path = gw_dir / "rl-service.yaml"
        rl_path.write_text(yaml.safe_dump(rl_config, sort_keys=False))
        gw_path = gw_dir / "gateway.json"
        gw_path.write_text(json.dumps(gateway_config(a, run_dir=self.run_dir, port=port, rl_port=rl_port,
                                                     key_file=key_file, rl_config_path=rl_path,
                                                     instances=instances), indent=2))
        argv = [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "gateway",
                "--config", str(gw_path)]
        self._spawn("gateway", argv, gw_dir / "gateway.log", self.gateway_env(gw_dir))
        self.gateway_url = f"http://127.0.0.1:{port}"
        self._http = httpx.Client(base_url=self.gateway_url, timeout=120, trust_env=False)
        self.wait_gateway_health()

    def make_keys(self, gw_dir: Path) -> Path:
        """The gateway's HMAC key file (mode 0600, created fresh) and this driver's two signers."""
        from ..common.hmac_signing import HmacAuth
        from ..common.signing_keys import SigningKey, decode_key

        api_hex, agent_hex = secrets.token_hex(32), secrets.token_hex(32)
        key_file = gw_dir / "hmac-keys.json"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"apiHmacKey": api_hex, "insHmacKey": secrets.token_hex(32),
                       "agentHmacKeys": [{"id": DEMO_AGENT_KEY_ID, "key": agent_hex}]}, f)
        # One signer per key for every thread: strictly increasing timestamps. The agents sign with their own agent
        # key, which may only start, stop and reward their Tasks; the operator key stays with the demo's operator.
        self._auth = HmacAuth(decode_key(api_hex))
        self._agent_auth = HmacAuth(SigningKey(decode_key(agent_hex), DEMO_AGENT_KEY_ID))
        return key_file

    def gateway_env(self, gw_dir: Path) -> dict[str, str]:
        """The gateway's environment: none of the caller's RL Service settings; the scripted trainer's plan."""
        env = {k: v for k, v in os.environ.items() if k not in ("RL_SERVICE_TOKEN", "RL_SERVICE_CONFIG")}
        env["ONLINE_RL_DETERMINISTIC_SEED"] = str(self.args.seed)
        if self.args.trainer == "scripted":
            plan = gw_dir / "scripted-plan.json"
            if not plan.exists():
                plan.write_text(json.dumps({"outcome": "succeed"}))
            env.setdefault("ONLINE_RL_SCRIPTED_PLAN", str(plan))
        return env

    def wait_gateway_health(self, timeout_s: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            self.check("gateway")
            try:
                if self._http.get("/aigw/v1/health").json().get("status") == "ok":
                    return
            except (httpx.TransportError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise DemoFailed(f"the gateway did not answer /aigw/v1/health within {timeout_s:.0f} s")
            time.sleep(0.1)

    def start_rl_service(self) -> None:
        r = self.signed(*routes.SERVICE_START.at())
        if r.status_code != 200 or r.json().get("status") != "running":
            raise DemoFailed(f"POST /v1/rl/service/start answered {r.status_code}: {r.text[:500]}")
        kids = children(self.pids["gateway"])
        if kids:
            self.pids["rl-service"] = kids[0]

    # ------------------------------------------------------------------------------------------ clients

    def signed(self, method: str, path: str, *, json_body: Any = None, headers: dict[str, str] | None = None,
               params: dict[str, Any] | None = None, agent: bool = False) -> Any:
        """An HMAC-signed control request (common/hmac_signing.py: strictly increasing timestamps, so concurrent
        identical bodies never look like a replay), with the operator key, or the agents' key when `agent`."""
        import orjson

        body = b"" if json_body is None else orjson.dumps(json_body)
        h = {"content-type": "application/json"} if json_body is not None else {}
        h.update(headers or {})
        return self._http.request(method, path, content=body, headers=h, params=params,
                                  auth=self._agent_auth if agent else self._auth)

    def open_agent(self) -> None:
        """The agents' client: the official `openai` SDK through the gateway (no retries: a failure fails the Task)."""
        import httpx
        import openai

        self.agent = openai.OpenAI(base_url=self.gateway_url + "/v1", api_key="demo-agent", max_retries=0,
                                   timeout=120, http_client=httpx.Client(trust_env=False, timeout=120))

    # ------------------------------------------------------------------------------------------ shutdown

    def stop(self) -> None:
        """Stop every process the demo started (gateway first: it drains and stops its RL Service), close the
        clients, then kill by pid anything left that names a path in the run directory."""
        live = [p for p in self.procs.values() if p.alive()]
        if live:
            print(f"stopping {', '.join(p.name for p in live)} ...", flush=True)
        for name, grace in (("gateway", 15.0), ("vllm", 10.0), ("redis", 5.0)):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop(grace)
        for client in (self.agent, self._http):
            with contextlib.suppress(Exception):
                if client is not None:
                    client.close()
        # Anything still running that the demo (or the gateway for it) started: its command line names a
        # path inside the fresh run directory (never this process or its ancestors). Stopped by pid.
        left: list[int] = []
        if self.owns_run_dir:
            spared = ancestors(os.getpid())
            left = [pid for pid in pids_mentioning(f"{self.run_dir}{os.sep}") if pid not in spared]
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        still = wait_gone(left, 10)
        if still:
            print(f"warning: processes {still} are still running", file=sys.stderr, flush=True)
        elif self.procs:
            print("all demo processes stopped", flush=True)
