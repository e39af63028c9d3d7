"""`make demo` / `openjiuwen-rl demo`: the whole online-RL loop on one machine, shown as versions of rising success.

The default (`make demo`) is the calculator family below with two Training Runs, about ten minutes on two cores;
`--family words` (`make demo-tiny`) is the tiny random model's fast demo described first.

This module is the driver: the options (`parse_args`), the steps in order, which step is running (named with its log
when it fails), and the signals. The work is done by one object per job:

- `stack.py` (`Stack`): the model, a private `redis-server`, vLLM, the gateway and its RL Service child (configs from
  `stack_config.py`), their health waits, the signed control client and the agents' client, and stopping every
  process the demo started.
- `rounds.py` (`Rounds`): the rounds of Tasks → rewards → Training Run → LoRA activation, per family.
- `rollout_check.py` (`RolloutCheck`): `--bad-version`, a deliberately bad version and the canary that rolls it back.
- `run_report.py` (`RunReport`): `demo-report.json`, the plot and the final printout.
- `calls.py` (`ServiceCalls`): the signed reads (active version, rollout, pending samples) and reward publishing
  they share.

Family "words" (`--family words`): a tiny random model (`make_tiny_model`) answers in plain words
(`task_family.py`); each round is also the evaluation of the policy that served it, so the table shows base, v1,
v2, … with the mean reward and its 95 % CI.

Outputs: progress bars, the final table, `demo-report.json` and `demo-reward.png` (in `--out-dir` and the run
directory). Ctrl-C or a failure stops every process the demo started and names the step that failed and its log.

`--family calculator` (the default; `make demo-real` with three rounds): SmolLM2-135M-Instruct (provisioned by
`model_makers/smollm2.py`) on the
tool-using family of `calculator_family.py`. Each version, base first, is evaluated on the same held-out problems as
evaluation Tasks (never trained on); training Tasks use fresh train problems; the report carries success and the
shaped reward separately, the activation latency of each new adapter and every answer (docs/learning.md).

`--family words --lineages 2` (`make demo-tiny DEMO_ARGS="--lineages 2"`): two lineages with opposite objectives
learn at once on the same gateway and vLLM, one table per lineage (`lineages.py`); their Training Runs are started
by the RL Service's automatic training (`training_policy.auto`), never by the driver. `--family calculator
--lineages 2`: two task families as two lineages, then the cross table (`family_lineages.py`).

For tests, `--instances URL...` uses running OpenAI-compatible servers (e.g. fake vLLMs) instead of starting vLLM,
and `--trainer scripted` the deterministic trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .calls import ServiceCalls
from .failures import DemoFailed
from .rollout_check import RolloutCheck
from .rounds import Rounds
from .run_report import RunReport
from .stack import Stack

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


class Interrupted(BaseException):
    """SIGINT/SIGTERM/SIGHUP reached the driver."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    apply_family_defaults(args)
    validate(p, args)
    return args


def build_parser() -> argparse.ArgumentParser:
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
                        "calculator family) and `sentiment` (is a review positive or negative?), then the cross "
                        "table (each lineage's last version on both families). 1 (default) is the single default "
                        "lineage")
    p.add_argument("--canary-min-tasks", type=int, default=None,
                   help="--bad-version: rewarded Tasks per arm before the canary decides (words 48, calculator 32)")
    p.add_argument("--preparation-started", type=float, default=None, metavar="UNIX_TIME",
                   help="when the caller began preparing what the demo needs (environments, redis-server, the "
                        "model); the time from then to the driver's start is reported as preparation, apart from "
                        "the demo's own time (`make demo` passes it)")
    p.add_argument("--vllm-timeout", type=float, default=300.0, help="seconds to wait for vLLM's /health")
    p.add_argument("--train-timeout", type=float, default=600.0, help="seconds to wait for one Training Run")
    return p


def apply_family_defaults(args: argparse.Namespace) -> None:
    """The options left unset take their family's value (FAMILY_DEFAULTS); `auto` dtype follows the CPU."""
    for name, value in FAMILY_DEFAULTS[args.family].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.family == "calculator":
        args.turns = 2
    if args.dtype == "auto":
        args.dtype = "bfloat16" if native_bf16() else "float32"


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with the parser's usage error (status 2) on a value the demo cannot run with."""
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




def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 instructions. Without them vLLM's CPU build emulates bf16: on a 2-core AVX2 machine
    SmolLM2 generated 3-8 tokens/s in bf16 against about ten times that in float32."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path(cpuinfo).read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


class Demo:
    """The driver: the steps in order, the step running now (for a failure's message and the report), and the
    clean-up whatever happened. The parts get its `stage` to name their steps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.run_dir = (args.run_dir or Path("demo-run") / stamp).resolve()
        self.step = "start"
        self.step_log: Path | None = None
        t0 = time.monotonic()
        self.stack = Stack(args, self.run_dir, self.stage, t0)
        self.calls = ServiceCalls(self.stack.signed, args.model_id)
        self.report = RunReport(args, self.stack, self.run_dir, args.out_dir.resolve(), t0, lambda: self.step)
        self.rounds = Rounds(args, self.stack, self.calls, self.report, self.stage, self.run_dir)
        self.rollout = RolloutCheck(args, self.calls, self.rounds, self.report, self.stage, self.run_dir)

    def run(self) -> int:
        try:
            if self.run_dir.exists() and any(self.run_dir.iterdir()):
                raise DemoFailed(f"run directory {self.run_dir} exists and is not empty; pass a new --run-dir")
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.stack.owns_run_dir = True
            print(f"openjiuwen-rl demo: run directory {self.run_dir}", flush=True)
            self.stack.setup()
            self.play_rounds()
            if self.args.bad_version:
                self.rollout.bad_version_check()
            self.report.status = "completed"
            with self.stage("report", None):
                self.report.finish()
            return 0
        except (KeyboardInterrupt, Interrupted) as exc:
            self.report.status = "interrupted"
            name = exc.signame if isinstance(exc, Interrupted) else "SIGINT"
            print(f"\ninterrupted ({name}) during step '{self.step}'; stopping every process the demo started",
                  file=sys.stderr, flush=True)
            self._say_log()
            return 130
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its step and log
            self.report.status = "failed"
            print(f"\nerror: step '{self.step}' failed: {exc}", file=sys.stderr, flush=True)
            self._say_log()
            return 1
        finally:
            self.shutdown()

    def play_rounds(self) -> None:
        """The default lineage's rounds, or under --lineages 2 both lineages' (they use this driver's parts)."""
        self.stack.open_agent()
        if self.args.lineages > 1:
            # Here: both modules import the demo's parts.
            from .family_lineages import FamilyLineages
            from .lineages import TwoLineages

            lineage_run = FamilyLineages(self) if self.args.family == "calculator" else TwoLineages(self)
            self.report.lineage_run = lineage_run
            lineage_run.run()
            return
        self.rounds.run()

    def _say_log(self) -> None:
        if self.step_log is not None:
            print(f"  its log: {self.step_log}", file=sys.stderr, flush=True)
        print(f"  all logs: {self.run_dir}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def stage(self, name: str, log: Path | None) -> Iterator[None]:
        self.step, self.step_log = name, log
        yield

    def shutdown(self) -> None:
        # A second Ctrl-C (or a SIGTERM) while stopping must not cut the clean-up short.
        def still_stopping(*_: Any) -> None:
            print("still stopping the demo's processes ...", file=sys.stderr, flush=True)

        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, still_stopping) for sig in signals}
        try:
            if self.rounds.executor is not None:
                self.rounds.executor.shutdown(wait=False, cancel_futures=True)
            if self.report.status != "completed" and self.run_dir.is_dir():
                with contextlib.suppress(Exception):
                    self.report.write(final=False)
            self.stack.stop()
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
