"""`make demo` / `openjiuwen-rl demo`: the whole online-RL loop on one machine, shown as versions of rising success.

The default (`make demo`) is the calculator family below with two Training Runs, about ten minutes on two cores;
`--family words` (`make demo-tiny`) is the tiny random model's fast demo described first.

Set-up: a tiny random model (`make_tiny_model`), a private `redis-server`, a real vLLM server (CPU build, from its own
environment, runtime LoRA updating on), the reference gateway (`openjiuwen-rl gateway --config`) with an HMAC key
file made here, and its RL Service child with the local PPO trainer. Every process runs in its own process group on a
free loopback port, with its log in the run directory (`demo-run/<timestamp>/`).

Rounds: agents (the official `openai` SDK through the gateway, `X-Agent-Session-Id` per Task) run the Tasks of the
"answer in plain words" family (`task_family.py`): signed start with a terminal reward → `--turns` completions →
signed stop → the reward computed from the answers' text → signed reward. Then a Training Run
(`POST /v1/rl/training/runs`) is watched until it ends; its new LoRA is activated by the gateway on vLLM, and the next
round's Tasks are pinned to it. Each round is also the evaluation of the policy that served it (the same Tasks, the
same sampling seeds every round), so the table shows base, v1, v2, … with the mean reward and its 95 % CI.

Outputs: progress bars, the final table, `demo-report.json` and `demo-reward.png` (in `--out-dir` and the run
directory). Ctrl-C or a failure stops every process the demo started and names the step that failed and its log.

`--family calculator` (the default; `make demo-real` with three rounds): SmolLM2-135M-Instruct (provisioned by
`models/smollm2.py`) on the
tool-using family of `calculator_family.py`. Each version, base first, is evaluated on the same held-out problems as
evaluation Tasks (never trained on); training Tasks use fresh train problems; the report carries success and the
shaped reward separately, the activation latency of each new adapter and every answer (docs/learning.md).

`--family words --lineages 2` (`make demo-tiny DEMO_ARGS="--lineages 2"`): two lineages with opposite objectives
learn at once on the same gateway and vLLM, one table per lineage (`lineages.py`); their Training Runs are started
by the RL Service's automatic training (`training_policy.auto`), never by the driver.

For tests, `--instances URL...` uses running OpenAI-compatible servers (e.g. fake vLLMs) instead of starting vLLM,
and `--trainer scripted` the deterministic trainer.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..common.policy_names import BASE_POLICY
from . import report as rep
from . import summary
from .processes import ManagedProcess, ancestors, children, free_port, pids_mentioning, wait_gone
from .progress import Bar
from . import calculator_family as calc
from .task_family import FOLLOW_UP, PROMPTS, word_char_share

TERMINAL_RUN = ("succeeded", "failed", "canceled")
DEMO_AGENT_KEY_ID = "demo-agent"  # the agents' own key in the gateway's key file (agentHmacKeys)
# Per task family: "words" is the tiny random model's "answer in plain words" (fast, for tests and a quick look);
# "calculator" is SmolLM2-135M-Instruct solving word problems with a calculator tool (docs/learning.md says why
# each PPO value is what it is). Its two rounds are what fits in about ten minutes on two cores (docs/demo.md);
# `make demo-real` asks for three.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "words": {"rounds": 8, "tasks": 96, "max_tokens": 16, "model_id": "tiny", "dtype": "float32", "lr": 4.0e-3,
              "ppo_epochs": 2, "mini_batch": 16, "micro_batch": 16, "clip_high": 0.28, "kl_coef": 0.001,
              "entropy_coeff": 0.01,
              "concurrency": 8, "detach_prompt": False, "trainer_threads": 0, "canary_min_tasks": 48},
    "calculator": {"rounds": 2, "tasks": 64, "max_tokens": 24, "model_id": "smollm2", "dtype": "auto",
                   "lr": 5.0e-4, "ppo_epochs": 1, "mini_batch": 16, "micro_batch": 4, "clip_high": 0.28, "kl_coef": 0.0,
                   "entropy_coeff": 0.0, "concurrency": 16, "detach_prompt": True,
                   "trainer_threads": 1, "canary_min_tasks": 32},
}


class DemoFailed(Exception):
    """A step failed; the message says why (the step and its log are known to the Demo)."""


class Interrupted(BaseException):
    """SIGINT/SIGTERM/SIGHUP reached the driver."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="openjiuwen-rl demo",
        description="Run rounds of Tasks -> rewards -> Training Run -> LoRA activation on a real vLLM (CPU) and "
                    "show each policy version's held-out success (calculator) or mean reward (words). See "
                    "docs/demo.md.",
    )
    p.add_argument("--family", choices=tuple(FAMILY_DEFAULTS), default="calculator",
                   help="task family: calculator (the default, `make demo`: SmolLM2-135M-Instruct, word problems with "
                        "a calculator tool, success-based reward, held-out evaluation Tasks) or words (`make "
                        "demo-tiny`: the tiny random model, 'answer in plain words'). The options below default per "
                        "family")
    p.add_argument("--rounds", type=int, default=None, help="Training Runs (words 8, calculator 2; `make demo-real`: "
                   "3)")
    p.add_argument("--tasks", type=int, default=None, help="training Tasks per round (words 96, calculator 64)")
    p.add_argument("--eval-tasks", type=int, default=64,
                   help="calculator: held-out evaluation Tasks per version, the same prompts for every version "
                        "(default 64)")
    p.add_argument("--turns", type=int, default=2, help="words: completions per Task (default 2; calculator: "
                   "always 2, the tool call and the final answer)")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens of each completion (words 16, "
                   "calculator 24)")
    p.add_argument("--concurrency", type=int, default=None, help="agents running Tasks at once (words 8, "
                   "calculator 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model, the sampling and the trainer")
    p.add_argument("--run-dir", type=Path, default=None, help="new directory for logs and state "
                   "(default demo-run/<timestamp>)")
    p.add_argument("--out-dir", type=Path, default=Path("."), help="where demo-report.json and demo-reward.png go")
    p.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"),
                   help="python of the vLLM environment (default .venv-vllm/bin/python, made by `make venv-vllm`)")
    p.add_argument("--instances", nargs="+", metavar="URL", default=None,
                   help="use these running OpenAI-compatible vLLM servers (http://127.0.0.1:PORT) instead of "
                        "starting one; they must serve --model-id with runtime LoRA loading")
    p.add_argument("--model", type=Path, default=None, help="use this model directory instead of generating one "
                   "(words) or provisioning SmolLM2 into its cache directory (calculator)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                   help="vLLM's --dtype (words float32; calculator auto: bfloat16 where the CPU computes it natively "
                        "(avx512_bf16 or amx_bf16), else float32 — emulated bf16 generated ~10x slower here)")
    p.add_argument("--hidden-size", type=int, default=384,
                   help="hidden size of the generated tiny model (default 384 = 6 heads of 64; see docs/demo.md)")
    p.add_argument("--model-id", default=None, help="served model name = RL Service model_id (words tiny, "
                   "calculator smollm2)")
    p.add_argument("--trainer", choices=("local", "scripted"), default="local",
                   help="trainer backend (scripted: deterministic, for tests)")
    p.add_argument("--lr", type=float, default=None, help="PPO learning rate (words 4e-3, calculator 5e-4)")
    p.add_argument("--ppo-epochs", type=int, default=None, help="PPO epochs (words 2, calculator 1)")
    p.add_argument("--mini-batch", type=int, default=None, help="PPO mini-batch (default 16)")
    p.add_argument("--micro-batch", type=int, default=None, help="PPO micro-batch (words 16, calculator 4: the "
                   "activations of 16 SmolLM2 samples of ~250 tokens take about 15 GB)")
    p.add_argument("--clip-high", type=float, default=None, help="PPO clip ratio, upper side (default 0.28)")
    p.add_argument("--kl-coef", type=float, default=None, help="KL-in-reward coefficient (words 0.001, calculator 0: "
                   "no reference forward pass)")
    p.add_argument("--detach-prompt", action=argparse.BooleanOptionalAction, default=None,
                   help="local trainer: no gradient through the prompt tokens (words no, calculator yes: the prompt "
                        "is ~230 of ~250 tokens; see docs/learning.md)")
    p.add_argument("--trainer-threads", type=int, default=None,
                   help="local trainer's torch threads (words 0 = one per CPU; calculator 1: on two cores shared "
                        "with vLLM, two threads ran a training micro-batch 7x slower)")
    p.add_argument("--entropy-coeff", type=float, default=None, help="entropy bonus (words 0.01, calculator 0)")
    p.add_argument("--bad-version", action="store_true",
                   help="after the rounds, train one deliberately bad version (a training round whose published "
                        "rewards are inverted, 1 - r) and show the canary rollout rolling it back: the RL Service runs "
                        "with rollout.mode canary (the demo promotes the rounds' own versions as an operator would), "
                        "Tasks with true rewards run until the decision; see docs/rollout.md")
    p.add_argument("--lineages", type=int, choices=(1, 2), default=1,
                   help="2 runs two lineages at once, each with its own Training Runs (started by the RL Service's "
                        "automatic training, training_policy.auto) and a held-out success table (--eval-tasks per "
                        "version; docs/lineages.md). words: `plain` (rewarded for plain words) and `symbols` (for the "
                        "opposite); calculator (`make demo-real DEMO_ARGS=\"--lineages 2\"`): `calculator` (the "
                        "calculator family) and `sentiment` (is a review positive or negative?), then the cross table (each "
                        "lineage's last version on both families). 1 (default) is the single default lineage")
    p.add_argument("--canary-min-tasks", type=int, default=None,
                   help="--bad-version: rewarded Tasks per arm before the canary decides (words 48, calculator 32)")
    p.add_argument("--preparation-started", type=float, default=None, metavar="UNIX_TIME",
                   help="when the caller began preparing what the demo needs (environments, redis-server, the "
                        "model); the time from then to the driver's start is reported as preparation, apart from "
                        "the demo's own time (`make demo` passes it)")
    p.add_argument("--vllm-timeout", type=float, default=300.0, help="seconds to wait for vLLM's /health")
    p.add_argument("--train-timeout", type=float, default=600.0, help="seconds to wait for one Training Run")
    args = p.parse_args(argv)
    for name, value in FAMILY_DEFAULTS[args.family].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.family == "calculator":
        args.turns = 2
    if args.dtype == "auto":
        args.dtype = "bfloat16" if native_bf16() else "float32"
    if args.hidden_size < 64 or args.hidden_size % 64:
        p.error("--hidden-size must be a positive multiple of 64 (vLLM's CPU attention needs head_dim 64)")
    for name in ("rounds", "tasks", "eval_tasks", "turns", "max_tokens", "concurrency", "ppo_epochs", "mini_batch",
                 "micro_batch", "canary_min_tasks"):
        minimum = 0 if name == "rounds" else 2 if name == "canary_min_tasks" else 1
        if getattr(args, name) < minimum:
            p.error(f"--{name.replace('_', '-')} must be at least {minimum}")
    if args.lineages > 1 and args.bad_version:
        p.error("--lineages 2 and --bad-version cannot be combined")
    if args.preparation_started is not None and not 0 < args.preparation_started <= time.time():
        p.error("--preparation-started must be a Unix time that has passed")
    for url in args.instances or ():
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost", "::1") or not parts.port:
            p.error(f"--instances: {url} is not http://127.0.0.1:PORT (loopback only)")
    return args


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 instructions. Without them vLLM's CPU build emulates bf16: on a 2-core AVX2 machine
    SmolLM2 generated 3-8 tokens/s in bf16 against about ten times that in float32."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path(cpuinfo).read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def sampling_seed(seed: int, round_: int, task: int, turn: int) -> int:
    """vLLM's per-request seed: reproducible for a demo seed, and fresh in every round, so a round never replays
    the samples its policy was trained on (the round's rewards are then an honest evaluation of that policy)."""
    return (seed * 1_000_003 + round_ * 10_007 + task * 101 + turn) % (2**31)


def canary_settings(min_tasks: int) -> dict[str, Any]:
    """The RL Service's `rollout` section under --bad-version. Half of the new Tasks go to the candidate (the
    fastest decision); a tolerance of 0.01 so that only a version about as good as the active one is promoted (a
    worse one meets the regression rule first); no failure rule in practice (the demo's Tasks do not fail); the
    loop looks every second, so the demo waits little after each batch of Tasks."""
    return {"mode": "canary", "share": 0.5, "min_tasks": min_tasks, "tolerance": 0.01, "failure_margin": 0.5,
            "max_duration_seconds": 3600, "on_timeout": "rollback", "decision_interval_seconds": 1.0}


def lineage_training_policy(samples: int, per_lineage: dict[str, int] | None = None) -> dict[str, Any]:
    """The RL Service's `training_policy` under --lineages 2: the scheduler trains every lineage by itself, a line
    once one round of its training Tasks' samples (`samples`, or its own count in `per_lineage` when its Tasks have
    another number of completions) is pending, so the driver starts no run. Evaluation samples are never pending,
    so only the training round fills a line. A tick a second: the demo waits little for each start (the service runs
    one Training Run at a time, so the second lineage's run starts after the first)."""
    policy: dict[str, Any] = {"auto": True, "min_pending_samples": samples, "poll_interval_seconds": 1.0}
    overrides = {name: {"min_pending_samples": n} for name, n in (per_lineage or {}).items() if n != samples}
    if overrides:
        policy["lineages"] = overrides
    return policy


CANARY_BATCHES = 8  # batches of canary Tasks (each about min_tasks per arm) before the demo gives up waiting


def _policy_label(lora_name: str | None) -> str:
    return BASE_POLICY if not lora_name or lora_name == BASE_POLICY else lora_name.rpartition(":")[2]


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.run_dir = (args.run_dir or Path("demo-run") / stamp).resolve()
        self.out_dir = args.out_dir.resolve()
        self.procs: dict[str, ManagedProcess] = {}
        self.pids: dict[str, int] = {}
        self.step = "start"
        self.step_log: Path | None = None
        self.t0 = time.monotonic()
        prepared_since = args.preparation_started
        # What was spent before the demo proper: the caller's preparation, and a model conversion the driver did.
        self.preparation: dict[str, float | None] = {
            "before_driver_s": None if prepared_since is None else round(time.time() - prepared_since, 2),
            "model_conversion_s": None}
        self.timings: dict[str, Any] = {"setup": {}, "rounds": [], "training_runs": []}
        self.versions: list[dict[str, Any]] = []
        self.lineage_run: Any = None  # lineages.TwoLineages under --lineages 2
        self.status = "running"
        self._auth: Any = None  # the HmacAuth of api_key (the operator's calls), made with the key
        self._agent_auth: Any = None  # the HmacAuth of the demo agents' own agent key (Task start, stop, reward)
        self._http: Any = None
        self._agent: Any = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self.model_dir: Path | None = None
        self.gateway_url = ""
        self.api_key = b""
        self.ppo_yaml: dict[str, Any] = {}
        self._owns_run_dir = False
        self.vllm_port: int | None = None
        self.training_rounds: list[dict[str, Any]] = []
        self.rollout_check: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------ driver

    def run(self) -> int:
        try:
            if self.run_dir.exists() and any(self.run_dir.iterdir()):
                raise DemoFailed(f"run directory {self.run_dir} exists and is not empty; pass a new --run-dir")
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._owns_run_dir = True
            print(f"openjiuwen-rl demo: run directory {self.run_dir}", flush=True)
            self.setup()
            self.rounds()
            if self.args.bad_version:
                self.bad_version_check()
            self.status = "completed"
            self.finish()
            return 0
        except (KeyboardInterrupt, Interrupted) as exc:
            self.status = "interrupted"
            name = exc.signame if isinstance(exc, Interrupted) else "SIGINT"
            print(f"\ninterrupted ({name}) during step '{self.step}'; stopping every process the demo started",
                  file=sys.stderr, flush=True)
            self._say_log()
            return 130
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its step and log
            self.status = "failed"
            print(f"\nerror: step '{self.step}' failed: {exc}", file=sys.stderr, flush=True)
            self._say_log()
            return 1
        finally:
            self.shutdown()

    def _say_log(self) -> None:
        if self.step_log is not None:
            print(f"  its log: {self.step_log}", file=sys.stderr, flush=True)
        print(f"  all logs: {self.run_dir}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def stage(self, name: str, log: Path | None) -> Iterator[None]:
        self.step, self.step_log = name, log
        yield

    # ------------------------------------------------------------------------------------------ set-up

    def setup(self) -> None:
        a = self.args
        bar = Bar("set-up", total=5, unit="steps")
        try:
            with self.stage("model", self.run_dir / "demo.log"):
                t = time.monotonic()
                if a.model is None and a.family == "calculator" and (a.trainer == "local" or a.instances is None):
                    from ..models.smollm2 import ProvisionError, default_cache_dir, provision

                    bar.note("provisioning SmolLM2-135M-Instruct")
                    try:
                        with self._log_to(self.run_dir / "demo.log"):
                            self.model_dir, marker = provision(default_cache_dir())
                    except ProvisionError as exc:
                        raise DemoFailed(f"{exc} (`openjiuwen-rl model smollm2` provisions it)") from exc
                    if not marker["reused"]:
                        self.preparation["model_conversion_s"] = round(time.monotonic() - t, 2)
                elif a.model is not None:
                    self.model_dir = a.model.resolve()
                    if not (self.model_dir / "config.json").is_file():
                        raise DemoFailed(f"--model {self.model_dir} has no config.json")
                elif a.trainer == "local" or a.instances is None:
                    from ..models.tiny import make_tiny_model

                    bar.note("generating the tiny model")
                    with self._log_to(self.run_dir / "demo.log"):
                        self.model_dir = make_tiny_model(self.run_dir / "model", seed=a.seed,
                                                         hidden_size=a.hidden_size, num_heads=a.hidden_size // 64)
                else:  # scripted trainer on given instances: nothing reads the weights
                    self.model_dir = self.run_dir / "model"
                self.timings["setup"]["model_s"] = round(time.monotonic() - t, 2)
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
                self.timings["setup"]["redis_s"] = round(time.monotonic() - t, 2)
                bar.update(1, "redis ready")

            with self.stage("gateway", self.run_dir / "gateway" / "gateway.log"):
                t = time.monotonic()
                self.start_gateway(redis_url, instances)
                self.timings["setup"]["gateway_s"] = round(time.monotonic() - t, 2)
                bar.update(1, "gateway ready")

            # The gateway keeps its child's stdout/stderr beside its LoRA state file, i.e. in gateway/.
            with self.stage("RL Service", self.run_dir / "gateway" / "rl-service.stderr.log"):
                t = time.monotonic()
                self.start_rl_service()
                self.timings["setup"]["rl_service_s"] = round(time.monotonic() - t, 2)
                bar.update(1, "RL Service running")

            with self.stage("vLLM start", self.run_dir / "vllm.log"):
                if a.instances is None:
                    self.wait_vllm(instances[0][2], bar, vllm_started)
                else:
                    self.wait_instances(a.instances)
                self.wait_gateway_serving(bar)
                self.timings["setup"]["vllm_ready_s"] = round(time.monotonic() - vllm_started, 2)
                bar.update(1, "vLLM serving")
        finally:
            bar.close()
        self.timings["setup"]["total_s"] = round(time.monotonic() - self.t0, 2)

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

    def _check(self, name: str) -> None:
        proc = self.procs[name]
        if not proc.alive():
            tail = "\n    ".join(proc.log_tail(1500).splitlines()[-12:])
            raise DemoFailed(f"{name} {proc.exit_description()}; last lines of {proc.log_path}:\n    {tail}")

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
                self._check("vllm")
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
            self._check("gateway")
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
            self._check("redis")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return f"redis://127.0.0.1:{port}/0"
            except OSError:
                time.sleep(0.05)
        raise DemoFailed("redis-server did not answer PING within 15 s")

    def start_gateway(self, redis_url: str, instances: list[tuple[str, str, int]]) -> None:
        import httpx
        import yaml

        a = self.args
        gw_dir = self.run_dir / "gateway"
        gw_dir.mkdir(parents=True, exist_ok=True)
        lora_root = self.run_dir / "loras"
        lora_root.mkdir(exist_ok=True)
        port, rl_port = free_port(), free_port()
        while rl_port == port:
            rl_port = free_port()
        api_hex, agent_hex = secrets.token_hex(32), secrets.token_hex(32)
        key_file = gw_dir / "hmac-keys.json"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"apiHmacKey": api_hex, "insHmacKey": secrets.token_hex(32),
                       "agentHmacKeys": [{"id": DEMO_AGENT_KEY_ID, "key": agent_hex}]}, f)
        from ..common.hmac_signing import HmacAuth
        from ..common.signing_keys import SigningKey, decode_key

        self.api_key = decode_key(api_hex)
        # One signer per key for every thread: strictly increasing timestamps. The agents sign with their own agent
        # key, which may only start, stop and reward their Tasks; the operator key stays with the demo's operator.
        self._auth = HmacAuth(self.api_key)
        self._agent_auth = HmacAuth(SigningKey(decode_key(agent_hex), DEMO_AGENT_KEY_ID))
        samples = a.tasks * a.turns
        self.ppo_yaml = {
            "actor_rollout_ref": {"actor": {"optim": {"lr": a.lr}, "ppo_epochs": a.ppo_epochs,
                                            "ppo_mini_batch_size": min(a.mini_batch, samples),
                                            "ppo_micro_batch_size_per_gpu": min(a.micro_batch, a.mini_batch, samples),
                                            "clip_ratio_high": a.clip_high, "entropy_coeff": a.entropy_coeff}},
            "algorithm": {"use_kl_in_reward": a.kl_coef > 0, "kl_ctrl": {"kl_coef": a.kl_coef}},
            "local": {"detach_prompt": a.detach_prompt, "num_threads": a.trainer_threads},
            "data": {"max_prompt_length": 512, "max_response_length": max(64, a.max_tokens)},
        }
        ppo_path = gw_dir / "ppo.yaml"
        ppo_path.write_text(yaml.safe_dump(self.ppo_yaml))
        rl_config = {
            "listen_host": "127.0.0.1",
            "listen_port": rl_port,
            "redis_url": redis_url,
            "model_id": a.model_id,
            "base_model_path": str(self.model_dir),
            "aigw_endpoint": f"http://127.0.0.1:{port}",
            "judge_endpoint": "",
            "lora_activation_timeout": 90.0,
            "lora_activation_attempts": 3,
            "min_samples_for_training": samples,
            "max_samples_per_run": samples,
            "trainer_backend": a.trainer,
            "advantage_estimator": "reinforce_plus_plus",
            "ppo_config_path": str(ppo_path),
            "training_tmp_root": str(self.run_dir / "train-tmp"),
            "lora_repository_path": str(lora_root),
            "record_dir": str(self.run_dir / "records"),
            "log_path": str(gw_dir / "rl-service.log"),
            "log_level": "INFO",
        }
        if a.bad_version:
            rl_config["rollout"] = canary_settings(a.canary_min_tasks)
        if a.lineages > 1:
            per_lineage = None
            if a.family == "calculator":
                from .family_lineages import training_samples  # here: family_lineages.py imports this module

                per_lineage = training_samples(a.tasks)
            rl_config["training_policy"] = lineage_training_policy(samples, per_lineage)
        rl_path = gw_dir / "rl-service.yaml"
        rl_path.write_text(yaml.safe_dump(rl_config, sort_keys=False))
        gw_config = {
            "global": {"listen": f"127.0.0.1:{port}", "hmacKeyFile": str(key_file)},
            "instances": [{"name": n, "model": a.model_id, "instanceIp": h, "port": p} for n, h, p in instances],
            "lora": {"root": str(lora_root), "statePath": str(gw_dir / "lora-state.json"), "operationTimeout": "60s"},
            "onlineRL": {
                "command": [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.online.service"],
                "configPath": str(rl_path),
                "modelId": a.model_id,
                "endpoint": f"http://127.0.0.1:{rl_port}",
                "hookTimeout": "30s",
                "hookRetries": 1,
                "drainTimeout": "10s",
                "controlTimeout": "120s",
            },
        }
        gw_path = gw_dir / "gateway.json"
        gw_path.write_text(json.dumps(gw_config, indent=2))
        env = {k: v for k, v in os.environ.items() if k not in ("RL_SERVICE_TOKEN", "RL_SERVICE_CONFIG")}
        env["ONLINE_RL_DETERMINISTIC_SEED"] = str(a.seed)
        if a.trainer == "scripted":
            plan = gw_dir / "scripted-plan.json"
            if not plan.exists():
                plan.write_text(json.dumps({"outcome": "succeed"}))
            env.setdefault("ONLINE_RL_SCRIPTED_PLAN", str(plan))
        argv = [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "gateway",
                "--config", str(gw_path)]
        self._spawn("gateway", argv, gw_dir / "gateway.log", env)
        self.gateway_url = f"http://127.0.0.1:{port}"
        self._http = httpx.Client(base_url=self.gateway_url, timeout=120, trust_env=False)
        deadline = time.monotonic() + 60
        while True:
            self._check("gateway")
            try:
                if self._http.get("/aigw/v1/health").json().get("status") == "ok":
                    return
            except (httpx.TransportError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise DemoFailed("the gateway did not answer /aigw/v1/health within 60 s")
            time.sleep(0.1)

    def start_rl_service(self) -> None:
        r = self.signed("POST", "/v1/rl/service/start")
        if r.status_code != 200 or r.json().get("status") != "running":
            raise DemoFailed(f"POST /v1/rl/service/start answered {r.status_code}: {r.text[:500]}")
        kids = children(self.pids["gateway"])
        if kids:
            self.pids["rl-service"] = kids[0]

    # ------------------------------------------------------------------------------------------ control calls

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

    def active_policy(self) -> str | None:
        r = self.signed("GET", f"/v1/loras/{self.args.model_id}")
        if r.status_code != 200:
            raise DemoFailed(f"GET /v1/loras/{self.args.model_id} answered {r.status_code}: {r.text[:300]}")
        active = r.json().get("active_lora")
        return active["lora_name"] if active else None

    # ------------------------------------------------------------------------------------------ rounds

    def rounds(self) -> None:
        import httpx
        import openai

        a = self.args
        self._agent = openai.OpenAI(base_url=self.gateway_url + "/v1", api_key="demo-agent", max_retries=0,
                                    timeout=120, http_client=httpx.Client(trust_env=False, timeout=120))
        if a.lineages > 1:
            # Here: both modules import this one.
            from .family_lineages import FamilyLineages
            from .lineages import TwoLineages

            self.lineage_run = FamilyLineages(self) if a.family == "calculator" else TwoLineages(self)
            self.lineage_run.run()
            return
        if a.family == "calculator":
            self.calculator_rounds()
            return
        pending_training: dict[str, Any] | None = None
        for r in range(a.rounds + 1):
            lora = self.active_policy()
            label = _policy_label(lora)
            log = self.run_dir / "gateway" / "gateway.log"
            with self.stage(f"round {r + 1}/{a.rounds + 1} (policy {label})", log):
                t = time.monotonic()
                # Under --bad-version the last round's Tasks are evaluation Tasks: never trained on, so the bad
                # Training Run that follows claims the inverted round's samples only.
                results = self.run_round(r, lora, label, evaluation=a.bad_version and r == a.rounds)
                seconds = round(time.monotonic() - t, 2)
            rewards = [x["reward"] for x in results]
            entry = rep.version_entry(
                label, rewards, sum(x["samples"] for x in results), lora_name=lora, round_seconds=seconds,
                training_seconds=pending_training["seconds"] if pending_training else None,
                training_run_id=pending_training["training_run_id"] if pending_training else None,
                task_rewards=[round(x, 4) for x in rewards], example=results[0]["answers"][0],
            )
            self.versions.append(entry)
            self.timings["rounds"].append({"policy": label, "seconds": seconds})
            print(f"  {label}: mean reward {entry['mean_reward']:.3f}, 95% CI [{entry['ci95'][0]:.3f}, "
                  f"{entry['ci95'][1]:.3f}] over {entry['tasks']} Tasks ({entry['samples']} samples) in "
                  f"{seconds:.1f} s; e.g. {entry['example']!r}", flush=True)
            self.write_reports(final=False)
            if r < a.rounds:
                with self.stage(f"training run {r + 1}/{a.rounds}", self.run_dir / "gateway" / "rl-service.log"):
                    pending_training = self.train(r, lora)

    def calculator_rounds(self) -> None:
        """Evaluate base on the held-out problems (evaluation Tasks), then per round: training Tasks on fresh train
        problems, a Training Run, activation, and the new version's evaluation on the SAME held-out problems."""
        a = self.args
        held_out = calc.problems("held-out", a.eval_tasks, 0)  # fixed: every seed and version sees these
        train = calc.problems("train", a.tasks * max(1, a.rounds), a.seed)
        pending_training: dict[str, Any] | None = None
        self.training_rounds: list[dict[str, Any]] = []
        for r in range(a.rounds + 1):
            lora = self.active_policy()
            label = _policy_label(lora)
            log = self.run_dir / "gateway" / "gateway.log"
            with self.stage(f"evaluation {r + 1}/{a.rounds + 1} (policy {label})", log):
                t = time.monotonic()
                results = self.run_round(r, lora, label, held_out, evaluation=True)
                seconds = round(time.monotonic() - t, 2)
            entry = self.calculator_entry(label, lora, results, seconds, pending_training)
            self.versions.append(entry)
            self.timings["rounds"].append({"policy": label, "kind": "evaluation", "seconds": seconds})
            print(f"  {label} (held-out): success {entry['success_rate']:.3f} [{entry['success_ci95'][0]:.3f}, "
                  f"{entry['success_ci95'][1]:.3f}], shaped reward {entry['mean_reward']:.3f} over "
                  f"{entry['tasks']} Tasks in {seconds:.1f} s; e.g. {entry['example']!r}", flush=True)
            self.write_reports(final=False)
            if r == a.rounds:
                break
            with self.stage(f"training round {r + 1}/{a.rounds} (policy {label})", log):
                t = time.monotonic()
                batch = train[r * a.tasks:(r + 1) * a.tasks]
                results = self.run_round(r, lora, label, batch, evaluation=False)
                seconds = round(time.monotonic() - t, 2)
            succ = [1.0 if x["success"] else 0.0 for x in results]
            rewards = [x["reward"] for x in results]
            self.training_rounds.append({"policy": label, "tasks": len(results), "seconds": seconds,
                                         "success_rate": round(sum(succ) / len(succ), 4),
                                         "mean_reward": round(sum(rewards) / len(rewards), 4)})
            self.timings["rounds"].append({"policy": label, "kind": "training", "seconds": seconds})
            print(f"  training round {r + 1} ({label}): success {sum(succ) / len(succ):.3f}, shaped reward "
                  f"{sum(rewards) / len(rewards):.3f} over {len(results)} Tasks in {seconds:.1f} s", flush=True)
            with self.stage(f"training run {r + 1}/{a.rounds}", self.run_dir / "gateway" / "rl-service.log"):
                pending_training = self.train(r, lora)

    def calculator_entry(self, label: str, lora: str | None, results: list[dict[str, Any]], seconds: float,
                         pending: dict[str, Any] | None) -> dict[str, Any]:
        rewards = [x["reward"] for x in results]
        success = [1.0 if x["success"] else 0.0 for x in results]
        rate, (lo, hi) = rep.mean_ci95(success)
        return rep.version_entry(
            label, rewards, sum(x["samples"] for x in results), lora_name=lora, round_seconds=seconds,
            training_seconds=pending["seconds"] if pending else None,
            training_run_id=pending["training_run_id"] if pending else None,
            activation_latency_s=pending.get("first_served_s") if pending else None,
            success_rate=round(rate, 4), success_ci95=[round(lo, 4), round(hi, 4)],
            task_rewards=[round(x, 4) for x in rewards], task_success=success,
            reasons={k: sum(1 for x in results if x["reason"] == k) for k in sorted({x["reason"] for x in results})},
            answers=[{"question": x["question"], "answer": x["answer"], "completions": x["answers"],
                      "tool_result": x["feedback"], "success": x["success"], "reward": x["reward"]}
                     for x in results],
            example=" | ".join(results[0]["answers"]),
        )

    def run_round(self, r: int, lora: str | None, label: str, problems: list[Any] | None = None,
                  evaluation: bool = False, *, count: int | None = None, invert: bool = False,
                  candidate: str | None = None, title: str | None = None) -> list[dict[str, Any]]:
        """One batch of Tasks. `invert`: publish 1 - reward (the deliberately bad training round); `candidate`: a
        canary's candidate, to which a Task may be pinned instead of `lora`."""
        a = self.args
        count = (a.tasks if count is None else count) if problems is None else len(problems)
        kind = "evaluation" if evaluation else "round" if problems is None else "training"
        # Training rounds are counted like the Training Runs they feed; evaluations and rounds per version.
        step = f"training round {r + 1}/{a.rounds}" if kind == "training" else f"{kind} {r + 1}/{a.rounds + 1}"
        bar = Bar(title or f"{step} ({label})", total=count, unit="tasks")
        self._executor = futures.ThreadPoolExecutor(max_workers=a.concurrency, thread_name_prefix="agent")
        results: list[dict[str, Any]] = []
        pins = {lora or BASE_POLICY, candidate or lora or BASE_POLICY}
        try:
            if problems is None:
                pending = {self._executor.submit(self.run_task, r, i, lora, pins, invert, evaluation)
                           for i in range(count)}
            else:
                pending = {self._executor.submit(self.run_calculator_task, r, i, p, lora, evaluation, pins, invert)
                           for i, p in enumerate(problems)}
            while pending:
                done, pending = futures.wait(pending, timeout=1.0, return_when=futures.FIRST_COMPLETED)
                for fut in done:
                    results.append(fut.result())  # a Task's failure fails the round
                if done:
                    mean = sum(x["reward"] for x in results) / len(results)
                    if problems is None:
                        bar.update(len(done), f"mean reward {mean:.3f}")
                    else:
                        rate = sum(1 for x in results if x["success"]) / len(results)
                        bar.update(len(done), f"success {rate:.3f}, reward {mean:.3f}")
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            bar.close()
        results.sort(key=lambda x: x["task"])
        with open(self.run_dir / "agents.jsonl", "a") as f:
            for x in results:
                f.write(json.dumps(x) + "\n")
        return results

    def run_task(self, r: int, i: int, lora: str | None, pins: set[str], invert: bool = False,
                 evaluation: bool = False) -> dict[str, Any]:
        a = self.args
        session = f"demo-r{r}-t{i}-{secrets.token_hex(3)}"
        t = time.monotonic()
        body: dict[str, Any] = {"reward_mode": "terminal", **({"evaluation": True} if evaluation else {})}
        started = self.signed("POST", "/v1/rl/tasks/start", json_body=body,
                              headers={"X-Agent-Session-Id": session}, agent=True)
        if started.status_code != 201:
            raise DemoFailed(f"Task start answered {started.status_code}: {started.text[:300]}")
        task = started.json()
        task_id = task["rl_task_id"]
        pinned = self._check_pin(task, lora, pins)
        messages: list[dict[str, str]] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        answers: list[str] = []
        for turn in range(a.turns):
            out = self._agent.chat.completions.create(
                model=a.model_id, messages=messages, max_tokens=a.max_tokens, temperature=1.0,
                seed=sampling_seed(a.seed, r, i, turn),
                extra_headers={"X-Agent-Session-Id": session},
            )
            text = out.choices[0].message.content or ""
            answers.append(text)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
        stopped = self.signed("POST", f"/v1/rl/tasks/{task_id}/stop", agent=True)
        if stopped.status_code != 200 or stopped.json().get("status") != "finalized":
            raise DemoFailed(f"Task {task_id} stop answered {stopped.status_code}: {stopped.text[:300]}")
        reward = word_char_share(answers)
        rewarded = self._publish_reward(task_id, 1.0 - reward if invert else reward)
        return {"round": r, "task": i, "rl_task_id": task_id, "policy": pinned, "answers": answers,
                "reward": reward, "samples": rewarded.get("sample_count", 0),
                "seconds": round(time.monotonic() - t, 3)}

    @staticmethod
    def _check_pin(task: dict[str, Any], lora: str | None, pins: set[str]) -> str | None:
        pinned = task.get("policy_lora_name")
        if (pinned or BASE_POLICY) not in pins:
            raise DemoFailed(f"Task {task['rl_task_id']} is pinned to {pinned}, expected "
                             f"{' or '.join(sorted(pins)) if len(pins) > 1 else lora or 'base'}")
        return pinned

    def _publish_reward(self, task_id: str, reward: float) -> dict[str, Any]:
        rewarded = self.signed("POST", f"/v1/rl/tasks/{task_id}/reward", json_body={"reward": reward}, agent=True)
        if rewarded.status_code != 200:
            raise DemoFailed(f"Task {task_id} reward answered {rewarded.status_code}: {rewarded.text[:300]}")
        return rewarded.json()

    def run_calculator_task(self, r: int, i: int, problem: calc.Problem, lora: str | None, evaluation: bool,
                            pins: set[str], invert: bool = False) -> dict[str, Any]:
        """One tool-using agent Task: question → calculator call (completion 1) → the agent runs the tool and sends
        the result → final answer (completion 2) → success and shaped reward from the text → signed reward."""
        a = self.args
        kind = "e" if evaluation else "t"
        session = f"demo-{kind}{r}-{i}-{secrets.token_hex(3)}"
        t = time.monotonic()
        body: dict[str, Any] = {"reward_mode": "terminal"}
        if evaluation:
            body["evaluation"] = True
        started = self.signed("POST", "/v1/rl/tasks/start", json_body=body, headers={"X-Agent-Session-Id": session},
                              agent=True)
        if started.status_code != 201:
            raise DemoFailed(f"Task start answered {started.status_code}: {started.text[:300]}")
        task = started.json()
        task_id = task["rl_task_id"]
        pinned = self._check_pin(task, lora, pins)
        messages = calc.first_messages(problem)
        answers: list[str] = []
        feedback = ""
        for turn in range(2):
            # No per-request `seed`: vLLM 0.32's CPU sampler fails ("CPU Generator does not use offset") when a
            # seeded request's prompt is prefilled in chunks, which these longer prompts trigger under load.
            out = self._agent.chat.completions.create(
                model=a.model_id, messages=messages, max_tokens=a.max_tokens, temperature=1.0,
                extra_headers={"X-Agent-Session-Id": session},
            )
            text = out.choices[0].message.content or ""
            answers.append(text)
            if turn == 0:
                _, feedback = calc.tool_call(text)  # the agent runs the tool
                messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
        stopped = self.signed("POST", f"/v1/rl/tasks/{task_id}/stop", agent=True)
        if stopped.status_code != 200 or stopped.json().get("status") != "finalized":
            raise DemoFailed(f"Task {task_id} stop answered {stopped.status_code}: {stopped.text[:300]}")
        scored = calc.score(problem, answers)
        rewarded = self._publish_reward(task_id, 1.0 - scored.reward if invert else scored.reward)
        return {"round": r, "task": i, "rl_task_id": task_id, "policy": pinned, "evaluation": evaluation,
                "question": problem.question, "answer": problem.answer, "split": problem.split,
                "answers": answers, "feedback": feedback, "success": scored.success, "reward": scored.reward,
                "reason": scored.reason, "samples": rewarded.get("sample_count", 0),
                "seconds": round(time.monotonic() - t, 3)}

    def train(self, r: int, parent: str | None, *, candidate_only: bool = False,
              title: str | None = None) -> dict[str, Any]:
        """Start a Training Run and watch it to its end. Under --bad-version (rollout.mode canary) its version is a
        candidate first: the demo promotes it as an operator would, unless `candidate_only` (the bad version)."""
        a = self.args
        bar = Bar(title or f"training run {r + 1}/{a.rounds}", total=3, unit="stages")
        t = time.monotonic()
        try:
            started = self.signed("POST", "/v1/rl/training/runs")
            if started.status_code != 201:
                raise DemoFailed(f"POST /v1/rl/training/runs answered {started.status_code}: {started.text[:300]}")
            run_id = started.json()["training_run_id"]
            reached = 0
            activating_at: float | None = None
            last_training_seen: float | None = None
            while True:
                got = self.signed("GET", f"/v1/rl/training/runs/{run_id}")
                if got.status_code != 200:
                    raise DemoFailed(f"GET run {run_id} answered {got.status_code}: {got.text[:300]}")
                run = got.json()
                status, stage = run["status"], run.get("stage")
                if stage == "training" and status not in TERMINAL_RUN:
                    last_training_seen = time.monotonic()
                elif activating_at is None and last_training_seen is not None:
                    # The activation request was sent after the last poll that still saw `training`: from there,
                    # the latency below is an upper bound (polls are 0.2 s apart).
                    activating_at = last_training_seen
                level = 3 if status == "succeeded" else {"training": 1, "activating": 2}.get(stage or "", 0)
                if level > reached:
                    bar.update(level - reached, status if status in TERMINAL_RUN else f"{stage or status}")
                    reached = level
                else:
                    bar.note(f"{stage or status} ({time.monotonic() - t:.0f} s)")
                if status in TERMINAL_RUN:
                    break
                if time.monotonic() - t > a.train_timeout:
                    raise DemoFailed(f"Training Run {run_id} not finished within {a.train_timeout:.0f} s "
                                     f"(status {status}, stage {stage})")
                self._check("gateway")
                time.sleep(0.2)
        finally:
            bar.close()
        succeeded_at = time.monotonic()
        seconds = round(succeeded_at - t, 2)
        if status != "succeeded":
            raise DemoFailed(f"Training Run {run_id} ended {status}: {run.get('failure_reason')}")
        if a.bad_version:
            self.wait_candidate(run["lora_name"])
            if candidate_only:
                record = {"training_run_id": run_id, "parent": parent or BASE_POLICY, "lora_name": run["lora_name"],
                          "sample_count": run["sample_count"], "seconds": seconds, "candidate": True,
                          "steps": run.get("metrics", {}).get("steps")}
                self.timings["training_runs"].append(record)
                print(f"  {run['lora_name']} trained on {run['sample_count']} samples in {seconds:.1f} s: now the "
                      "canary's candidate", flush=True)
                return record
            promoted = self.signed("POST", "/v1/rl/rollout/promote")
            if promoted.status_code != 200:
                raise DemoFailed(f"POST /v1/rl/rollout/promote answered {promoted.status_code}: "
                                 f"{promoted.text[:300]}")
        now_active = self.active_policy()
        if now_active != run["lora_name"]:
            raise DemoFailed(f"Training Run {run_id} succeeded with {run['lora_name']} but the gateway's active "
                             f"policy is {now_active}")
        steps = run.get("metrics", {}).get("step_metrics") or []
        first_served = self.first_served(run["lora_name"], activating_at)
        record = {"training_run_id": run_id, "parent": parent or BASE_POLICY, "lora_name": run["lora_name"],
                  "sample_count": run["sample_count"], "seconds": seconds,
                  "activation_s": None if activating_at is None else round(succeeded_at - activating_at, 2),
                  "first_served_s": first_served,
                  "steps": run.get("metrics", {}).get("steps"),
                  "step_metrics": steps}
        self.timings["training_runs"].append(record)
        print(f"  {run['lora_name']} trained on {run['sample_count']} samples and activated in {seconds:.1f} s",
              flush=True)
        return record

    def first_served(self, lora_name: str, activating_at: float | None) -> float | None:
        """Seconds from the last poll that saw the run still training (polls 0.2 s apart, so an upper bound of the
        time from the activation request) to the first completion vLLM serves with the new adapter (asked directly
        by its LoRA name); None when vLLM is given."""
        if self.vllm_port is None or activating_at is None:
            return None
        import httpx

        with httpx.Client(timeout=60, trust_env=False) as http:
            r = http.post(f"http://127.0.0.1:{self.vllm_port}/v1/completions",
                          json={"model": lora_name, "prompt": "1", "max_tokens": 1})
        if r.status_code != 200:
            raise DemoFailed(f"vLLM did not serve {lora_name} after activation: {r.status_code} {r.text[:200]}")
        return round(time.monotonic() - activating_at, 2)

    # ------------------------------------------------------------------------------------------ bad version

    def rollout_status(self) -> dict[str, Any]:
        r = self.signed("GET", "/v1/rl/rollout")
        if r.status_code != 200:
            raise DemoFailed(f"GET /v1/rl/rollout answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def pending_samples(self) -> int:
        r = self.signed("GET", "/v1/rl/trajectories/stats")
        if r.status_code != 200:
            raise DemoFailed(f"GET /v1/rl/trajectories/stats answered {r.status_code}: {r.text[:300]}")
        return int(r.json()["by_status"]["pending"])

    def wait_candidate(self, lora_name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The canary of `lora_name` once it is current (the gateway has loaded the candidate)."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = self.rollout_status()["current"]
            if current is not None and current.get("candidate", {}).get("lora_name") == lora_name:
                return current
            if time.monotonic() > deadline:
                raise DemoFailed(f"{lora_name} did not become the canary's candidate within {timeout_s:.0f} s "
                                 f"(current rollout: {current})")
            time.sleep(0.2)

    def bad_version_check(self) -> None:
        """One deliberately bad version and the canary that should roll it back: a training round whose published
        rewards are 1 - r, its Training Run (the candidate), then Tasks with their true rewards, half of them pinned
        to the candidate, until the decision loop decides. Not rolled back → the demo fails, saying so."""
        a = self.args
        active = self.active_policy()
        label = _policy_label(active)
        r = a.rounds + 1  # past the rounds' own indexes: fresh sampling seeds
        log = self.run_dir / "gateway" / "gateway.log"
        with self.stage("bad training round (inverted rewards)", log):
            pending = self.pending_samples()
            if pending:  # the bad run would claim them before the inverted ones
                raise DemoFailed(f"{pending} samples with true rewards are still pending before the inverted round")
            t = time.monotonic()
            problems = (calc.problems("train", a.tasks * (max(1, a.rounds) + 1), a.seed)[-a.tasks:]
                        if a.family == "calculator" else None)
            results = self.run_round(r, active, label, problems, invert=True,
                                     title=f"bad training round ({label}, rewards inverted)")
            true_mean = sum(x["reward"] for x in results) / len(results)
            print(f"  bad training round on {label}: true reward {true_mean:.3f}, published 1 - r = "
                  f"{1 - true_mean:.3f} over {len(results)} Tasks in {time.monotonic() - t:.1f} s", flush=True)
        with self.stage("bad training run", self.run_dir / "gateway" / "rl-service.log"):
            run = self.train(r, active, candidate_only=True, title="training run (inverted rewards)")
        with self.stage(f"canary of {run['lora_name']}", log):
            record, tasks = self.canary_window(active, run["lora_name"])
        self.rollout_check = self.rollout_section(active, run, record, tasks)
        self.write_reports(final=False)
        self.print_rollout_check()
        if self.rollout_check["outcome"] != "rolled_back":
            raise DemoFailed(f"the deliberately bad version {run['lora_name']} was not rolled back: "
                             f"{self.rollout_check['outcome']} ({self.rollout_check.get('reason')})")

    def canary_window(self, active: str | None, candidate: str) -> tuple[dict[str, Any] | None, list[dict]]:
        """Batches of Tasks with true rewards (calculator: the held-out problems, as evaluation Tasks) until the
        current canary ends; returns its record (None if undecided after CANARY_BATCHES batches) and the Tasks."""
        a = self.args
        held_out = calc.problems("held-out", a.eval_tasks, 0) if a.family == "calculator" else None
        tasks: list[dict[str, Any]] = []
        for batch in range(CANARY_BATCHES):
            title = f"canary batch {batch + 1} ({_policy_label(active)} vs {_policy_label(candidate)})"
            # Evaluation Tasks: they count in their arm but are never trained on.
            tasks += self.run_round(a.rounds + 2 + batch, active, _policy_label(active), held_out,
                                    evaluation=True, count=2 * a.canary_min_tasks, candidate=candidate, title=title)
            deadline = time.monotonic() + 5.0  # the loop evaluates every second
            while time.monotonic() < deadline:
                status = self.rollout_status()
                if status["current"] is None:
                    ended = [x for x in status["recent"] if x.get("candidate", {}).get("lora_name") == candidate]
                    return (ended[0] if ended else None), tasks
                time.sleep(0.5)
            evaluation = (status["current"] or {}).get("evaluation") or {}
            print(f"  canary after {len(tasks)} Tasks: {evaluation.get('reason', '?')} — "
                  f"{evaluation.get('detail', '')}", flush=True)
        return None, tasks

    def rollout_section(self, active: str | None, run: dict[str, Any], record: dict[str, Any] | None,
                        tasks: list[dict[str, Any]]) -> dict[str, Any]:
        candidate = run["lora_name"]
        arms = {}
        for arm, name in (("candidate", candidate), ("active", active or BASE_POLICY)):
            rewards = [x["reward"] for x in tasks if (x["policy"] or BASE_POLICY) == name]
            mean, (lo, hi) = rep.mean_ci95(rewards) if rewards else (None, (None, None))
            arms[arm] = {"lora_name": name, "tasks": len(rewards), "mean_reward": mean, "ci95": [lo, hi]}
        decision = (record or {}).get("decision") or {}
        return {
            "candidate": candidate, "active": active or BASE_POLICY, "training_run_id": run["training_run_id"],
            "rollout_id": (record or {}).get("rollout_id"),
            "outcome": (record or {}).get("status", "undecided"), "reason": decision.get("reason"),
            "detail": decision.get("detail"), "by": decision.get("by"),
            "reward_delta": decision.get("reward_delta"), "ci95": decision.get("ci95"),
            "service_arms": decision.get("arms"), "demo_arms": arms, "canary_tasks": len(tasks),
            "settings": canary_settings(self.args.canary_min_tasks),
        }

    def print_rollout_check(self) -> None:
        c = self.rollout_check
        print(f"\nbad version {c['candidate']} (trained on inverted rewards) vs active {c['active']}, "
              f"{c['canary_tasks']} canary Tasks:")
        for arm, a in c["demo_arms"].items():
            if a["tasks"]:
                print(f"  {arm:9s} {a['lora_name']:>12s}: {a['tasks']} Tasks, mean reward {a['mean_reward']:.3f} "
                      f"[{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}]")
        if c["ci95"]:
            print(f"  candidate - active: {c['reward_delta']:+.3f}, 95% CI [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]")
        print(f"  decision: {c['outcome']} ({c['reason']}, by {c['by']}): {c['detail']}", flush=True)

    # ------------------------------------------------------------------------------------------ output

    def build_report(self) -> dict[str, Any]:
        a = self.args
        total = round(time.monotonic() - self.t0, 2)
        report: dict[str, Any] = {
            "versions": self.versions,
            "settings": {
                "rounds": a.rounds, "tasks_per_round": a.tasks, "turns_per_task": a.turns,
                "max_tokens": a.max_tokens, "temperature": 1.0, "concurrency": a.concurrency, "seed": a.seed,
                "model_id": a.model_id, "model": str(self.model_dir), "hidden_size": a.hidden_size,
                "trainer": a.trainer, "vllm": "started" if a.instances is None else "given",
                "instances": a.instances or [], "family": a.family, "dtype": a.dtype,
                "task_family": "answer in plain words (task_family.py)" if a.family == "words" else
                "word problems with a calculator tool (calculator_family.py)",
                "reward": "share of word characters (ASCII letters, space) in the answers' text" if a.family == "words"
                else f"1 for the right final answer, {calc.TOOL_CREDIT} for a calculator call whose value is right, "
                     "else 0; success = the right final answer",
                "eval_tasks": a.eval_tasks if a.family == "calculator" or a.lineages > 1 else None,
                "lineages": a.lineages,
                "ppo": self.ppo_yaml, "advantage_estimator": "reinforce_plus_plus",
            },
            "timings": {**self.timings, "total_seconds": total, "preparation": self.preparation,
                        "demo_seconds": round(total - (self.preparation["model_conversion_s"] or 0.0), 2)},
            "status": self.status,
            "run_dir": str(self.run_dir),
            "processes": self.pids,
        }
        if self.lineage_run is not None:
            report["lineages"] = self.lineage_run.report()
            cross = getattr(self.lineage_run, "cross_report", lambda: None)()
            if cross is not None:
                report["lineages_cross"] = cross
        if len(self.versions) >= 2:
            base, last = self.versions[0]["task_rewards"], self.versions[-1]["task_rewards"]
            diff, (lo, hi) = rep.diff_ci95(base, last)
            report["margin"] = {"last_policy": self.versions[-1]["policy"], "last_minus_base": round(diff, 4),
                                "ci95": [round(lo, 4), round(hi, 4)]}
            if "task_success" in self.versions[0]:
                sd, (slo, shi) = rep.diff_ci95(self.versions[0]["task_success"], self.versions[-1]["task_success"])
                report["success_margin"] = {"last_policy": self.versions[-1]["policy"],
                                            "last_minus_base": round(sd, 4), "ci95": [round(slo, 4), round(shi, 4)]}
                report["success_gains"] = summary.success_gains(self.versions)
        if self.training_rounds:
            report["training_rounds"] = self.training_rounds
        if self.rollout_check is not None:
            report["rollout_check"] = self.rollout_check
        if self.status != "completed":
            report["failed_step"] = self.step
        return report

    def write_reports(self, final: bool) -> dict[str, Any]:
        report = self.build_report()
        rep.write_json(self.run_dir / "demo-report.json", report)
        if final:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            rep.write_json(self.out_dir / "demo-report.json", report)
        return report

    def finish(self) -> None:
        with self.stage("report", None):
            report = self.write_reports(final=True)
            if self.lineage_run is not None:
                print("\n" + self.lineage_run.text())
                print("\n" + summary.time_text(report["timings"]))
                print(f"report {self.out_dir / 'demo-report.json'}")
                return
            if self.args.family == "calculator":
                title = (f"openjiuwen-rl demo: SmolLM2-135M-Instruct + calculator tool, {self.args.eval_tasks} "
                         f"held-out Tasks per version, seed {self.args.seed}")
            else:
                title = (f"openjiuwen-rl demo: {self.args.tasks} Tasks x {self.args.turns} turns per round, "
                         f"seed {self.args.seed}")
            plotted = rep.plot(self.run_dir / "demo-reward.png", self.versions, title)
            if plotted:
                shutil.copyfile(self.run_dir / "demo-reward.png", self.out_dir / "demo-reward.png")
        print()
        print(rep.table(self.versions))
        if "success_gains" in report:
            print("\n" + summary.gains_text(report["success_gains"]))
        margin = report.get("margin")
        if margin:
            what = "shaped reward" if "success_gains" in report else "mean reward"
            print(f"\nlast version {margin['last_policy']} vs base, {what}: {margin['last_minus_base']:+.3f} "
                  f"(95% CI [{margin['ci95'][0]:+.3f}, {margin['ci95'][1]:+.3f}])")
        if "success_gains" in report:
            print("\n" + summary.side_by_side(self.versions[0], self.versions[-1], 4))
        print("\n" + summary.time_text(report["timings"]))
        print(f"report {self.out_dir / 'demo-report.json'}"
              + (f", plot {self.out_dir / 'demo-reward.png'}" if plotted else " (no matplotlib: no plot)"))

    # ------------------------------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        # A second Ctrl-C (or a SIGTERM) while stopping must not cut the clean-up short.
        def still_stopping(*_: Any) -> None:
            print("still stopping the demo's processes ...", file=sys.stderr, flush=True)

        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, still_stopping) for sig in signals}
        try:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            if self.status != "completed" and self.run_dir.is_dir():
                with contextlib.suppress(Exception):
                    self.write_reports(final=False)
            live = [p for p in self.procs.values() if p.alive()]
            if live:
                print(f"stopping {', '.join(p.name for p in live)} ...", flush=True)
            for name, grace in (("gateway", 15.0), ("vllm", 10.0), ("redis", 5.0)):
                proc = self.procs.get(name)
                if proc is not None:
                    proc.stop(grace)
            for client in (self._agent, self._http):
                with contextlib.suppress(Exception):
                    if client is not None:
                        client.close()
            # Anything still running that the demo (or the gateway for it) started: its command line names a
            # path inside the fresh run directory (never this process or its ancestors). Stopped by pid.
            left: list[int] = []
            if self._owns_run_dir:
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
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    return Demo(args).run()


if __name__ == "__main__":
    sys.exit(main())
