"""Chaos harness: a seeded workload against the RL Service as a real process, under one injected fault, then the
invariant checker and the end-to-end accounting.

    outcome = await run_scenario("crash:reward.inserted", seed=3, workdir=tmp_path)
    assert outcome.ok, outcome.describe()

Each run owns everything it uses: a private redis-server (AOF on), a fake gateway (policy reads and activations), a
fake Judge, the scripted trainer and the service process (`tests/support/service_process.py`), all on loopback, all
stopped at the end. The workload plays `rounds` rounds; in each, terminal Tasks (start, 1-3 captures, stop, reward)
and delayed-feedback Tasks (turns, stop) run concurrently, then a Training Run is started and awaited. Its client
is a careful agent: when an answer is lost (transport error, 5xx) it reads the Task back and resumes — retries an
idempotent step, rewards a Task it finds finalized, or starts a fresh Task when it finds it aborted — and records
only what the service acknowledged (`ClientRecord`).

Faults (`SCENARIOS`):
- `crash:<point>`: the service `os._exit`s at a named point (`online/faults.py`, n-th hit chosen by the seed) and is
  restarted without the fault;
- `recrash:<point>`: as `crash:`, then the restarted process crashes at the same point again during its startup
  recovery (which reaches it: finishing an interrupted projection, re-activating); the third process recovers;
- `kill:random`: 3 SIGKILLs at seeded random moments during traffic (rounds continue until all landed), restart
  each time;
- `redis:pause`: SIGSTOP Redis for `redis_pause_s` (2.5 s) twice (once during captures, once during a run claim)
  with a 1 s Redis socket timeout in the service: requests fail with the contract's codes within a bound, then
  everything recovers;
- `redis:restart`: Redis stopped (SIGTERM, AOF flushed) and started again on the same port mid-traffic;
- `redis:kill`: Redis SIGKILLed mid-traffic and started again (AOF, `appendfsync everysec` as `deploy/` ships it:
  Redis writes the AOF before it answers, so a crash of the process alone loses nothing acknowledged);
- `judge:flaky`: a quarter of the Judge's answers fail (500, garbage, not JSON, too slow): the delayed Tasks they
  hit are aborted with nothing of the turn published, and redone.

Single workers of a worker group (`workers: 3`, CONTRACT §2.11) — the service keeps serving, nothing is aborted by
a restart, and what a dead worker held is taken over:
- `wcrash:<point>`: every first-generation worker exits at the point's seeded n-th hit in that worker; the group
  restarts it without the fault;
- `kill:worker`: 4 SIGKILLs of seeded random workers (leader or follower) at seeded moments during traffic;
- `kill:leader`: 2 SIGKILLs of whichever worker holds the leader lease, the second one during a Training Run.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.online.faults import CRASH_AT_ENV as CRASH_ENV, POINTS
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.workers.lease import Holder
from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway
from tests.support.fake_judge import Content, Delay, FakeJudge, Raw, Status, Verdict
from tests.support.invariants import ClientRecord, check_invariants
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess, worker_pids

MODEL_ID = "tiny"
TERMINAL_RUN = {"succeeded", "failed", "canceled"}
# Points that startup recovery reaches again: `recrash:` crashes there a second time, during the recovery itself.
RECOVERY_POINTS = ("reward.inserted", "run.activated")
# The rollout points need a canary the chaos workload never starts: test_training_crash.py crashes there.
SCENARIOS = (*(f"crash:{p}" for p in POINTS if not p.startswith("rollout.")),
             *(f"recrash:{p}" for p in RECOVERY_POINTS), "kill:random",
             "redis:pause", "redis:restart", "redis:kill", "judge:flaky",
             *(f"wcrash:{p}" for p in POINTS if not p.startswith("rollout.")), "kill:worker", "kill:leader")
WORKERS = 3  # the group size of the single-worker scenarios
WORKER_KINDS = ("wcrash:", "kill:worker", "kill:leader")  # scenario prefixes run against a worker group
# Crash points reached by several operations of one round get a seeded hit count; the others crash at the first hit.
_CRASH_MAX_HIT = {"capture.committed": 6, "task.finalized": 3, "reward.claimed": 3, "reward.inserted": 3,
                  "turn.inserted": 2, "turn.published": 2, "run.claimed": 2}
REQUEST_TIMEOUT_S = 20.0
# 5xx answers a fault may legitimately cause (CONTRACT §2.1, §2.3, §2.6); any other is a finding.
_EXPECTED_5XX = {(500, "internal_error"), (503, "service_not_ready"), (502, "gateway_unavailable")}
ROUND_TIMEOUT_S = 90.0


@dataclass
class Workload:
    rounds: int = 2
    terminal_tasks: int = 3  # per round
    max_captures: int = 3  # per terminal Task: 1..max
    delayed_tasks: int = 1  # per round
    turns: int = 3
    min_samples: int = 3
    max_samples: int = 8
    train_delay_s: float = 0.3  # scripted training time, so that kills can land inside it
    redis_pause_s: float = 2.5  # each SIGSTOP of `redis:pause` (the service's Redis socket timeout is 1 s)


@dataclass
class ChaosOutcome:
    scenario: str
    seed: int
    ok: bool = False
    kills: int = 0  # crashes and SIGKILLs that happened
    restarts: int = 0
    redis_faults: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # what the client saw go wrong, by kind
    max_error_latency_s: float = 0.0  # slowest failed request (bounded errors)
    tasks_started: int = 0
    tasks_abandoned: int = 0  # aborted under the client by a restart or a fault; redone with fresh ids
    runs_succeeded: int = 0
    samples: int = 0
    samples_checked: int = 0  # client-acknowledged samples verified one by one
    violations: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def describe(self) -> str:
        head = (f"{self.scenario} seed={self.seed} ok={self.ok} kills={self.kills} restarts={self.restarts} "
                f"errors={dict(self.errors)} samples={self.samples} checked={self.samples_checked}")
        return "\n  ".join([head, *self.violations[:40]])

    def as_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "seed": self.seed, "ok": self.ok, "kills": self.kills,
            "restarts": self.restarts, "redis_faults": self.redis_faults, "errors": dict(self.errors),
            "max_error_latency_s": round(self.max_error_latency_s, 3), "tasks_started": self.tasks_started,
            "tasks_abandoned": self.tasks_abandoned, "runs_succeeded": self.runs_succeeded, "samples": self.samples,
            "samples_checked": self.samples_checked, "violations": self.violations,
            "duration_s": round(self.duration_s, 2),
        }


class Interrupted(Exception):
    """The answer to a request was lost (transport error or 5xx): its outcome is unknown to the client."""


class Gone(Exception):
    """The Task was aborted under the client (restart recovery, a fault); the client starts a fresh one."""


class _Client:
    """HTTP to the service, with the harness's view of faults: a dead service is restarted once (whoever notices
    first), and every lost answer becomes `Interrupted`."""

    def __init__(self, harness: "_Harness") -> None:
        self.h = harness
        self.http = httpx.AsyncClient(base_url=harness.svc.url, timeout=REQUEST_TIMEOUT_S)

    async def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        began, generation = time.monotonic(), self.h.generation
        try:
            r = await self.http.request(method, path, **kw)
        except httpx.TransportError as exc:
            self.h.note_error(f"transport:{type(exc).__name__}", time.monotonic() - began)
            await self.h.ensure_service(seen_generation=generation)
            if self.h.workers > 1:  # every worker may be restarting at once: a moment before the next try
                await asyncio.sleep(0.1)
            raise Interrupted(path) from exc
        if r.status_code >= 500:
            code = _code(r)
            self.h.note_error(f"{r.status_code}:{code}", time.monotonic() - began)
            if (r.status_code, code) not in _EXPECTED_5XX:
                self.h.unexpected(f"{method} {path} -> {r.status_code} {r.text[:200]}")
            await asyncio.sleep(0.2)  # Redis paused or down: give it a moment
            await self.h.ensure_service()
            raise Interrupted(path)
        return r

    async def task_status(self, t: str) -> str:
        """The Task's status, insisting until the service answers."""
        for _ in range(200):
            with contextlib.suppress(Interrupted):
                r = await self.call("GET", f"/v1/rl/tasks/{t}")
                if r.status_code == 200:
                    return r.json()["status"]
                self.h.unexpected(f"GET task {t} -> {r.status_code} {r.text[:200]}")
                return "missing"
        raise AssertionError(f"task {t} could not be read back")


def _code(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


class _Harness:
    def __init__(self, scenario: str, seed: int, workdir: Path, workload: Workload) -> None:
        self.scenario = scenario
        self.seed = seed
        self.rng = random.Random(f"{scenario}/{seed}")
        self.workdir = workdir
        # More delayed Tasks when the Judge is the fault: more publications for it to fail.
        self.w = replace(workload, delayed_tasks=max(3, workload.delayed_tasks)) if scenario == "judge:flaky" \
            else workload
        self.outcome = ChaosOutcome(scenario, seed)
        self.workers = WORKERS if scenario.startswith(WORKER_KINDS) else 1
        self.record = ClientRecord()
        self.request = load_fixture("chat_request.json")
        self.response = load_fixture("chat_response.json")
        self.redis_server = RedisServer(workdir / "redis", appendonly=True)  # AOF everysec, as deploy/ ships it
        self.plan = workdir / "plan.json"
        self.plan.write_bytes(orjson.dumps({"outcome": "succeed", "delay_seconds": workload.train_delay_s}))
        self._restart_lock = asyncio.Lock()
        self.generation = 0  # service processes started so far, minus one
        self._ids = 0
        self._unexpected: list[str] = []
        self.svc: ServiceProcess  # set in run()
        self.run_ids: list[str] = []
        self.claiming = asyncio.Event()  # set when the client asks for a Training Run

    # -------------------------------------------------------------------------------------------- bookkeeping

    def note_error(self, kind: str, latency_s: float) -> None:
        self.outcome.errors[kind] += 1
        self.outcome.max_error_latency_s = max(self.outcome.max_error_latency_s, latency_s)

    def unexpected(self, what: str) -> None:
        self._unexpected.append(what)

    def fresh(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}"

    async def ensure_service(self, *, seen_generation: int | None = None) -> None:
        """Restart the service if it died (a crash point, a SIGKILL). After a transport error on the process the
        caller talked to (`seen_generation`), that process may still be on its way out: wait for it briefly."""
        async with self._restart_lock:
            assert self.svc.proc is not None
            if seen_generation is not None and seen_generation != self.generation:
                return  # someone already restarted it
            # A worker group outlives its workers' deaths: only the group's own exit is a restart of the service.
            wait_s = 2.0 if seen_generation is not None and self.workers == 1 else 0.0
            deadline = time.monotonic() + wait_s
            while self.svc.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if self.svc.proc.poll() is None:
                return
            self.outcome.kills += 1
            await self._restart()

    async def _restart(self) -> None:
        if self.scenario.startswith("recrash:") and self.outcome.kills == 1:
            self.svc.env[CRASH_ENV] = self.scenario.partition(":")[2]  # once more, at its first hit
        else:
            self.svc.env.pop(CRASH_ENV, None)  # the restarted process runs without the fault
        try:
            await asyncio.to_thread(self.svc.start)
        except AssertionError:  # it died again before it was ready: only a second crash may do that
            if not self.scenario.startswith("recrash:") or CRASH_ENV not in self.svc.env:
                raise
            self.outcome.kills += 1
            self.svc.env.pop(CRASH_ENV, None)
            await asyncio.to_thread(self.svc.start)
        self.generation += 1
        self.outcome.restarts += 1

    # ------------------------------------------------------------------------------------------------ workload

    async def terminal_task(self, c: _Client, r: int) -> None:
        for _ in range(12):
            t = self.fresh(f"r{r}t")
            try:
                if await self._terminal_attempt(c, t):
                    return
            except Gone:
                self.outcome.tasks_abandoned += 1
        self.unexpected("a terminal Task never completed in 12 attempts")

    async def _terminal_attempt(self, c: _Client, t: str) -> bool:
        session = f"s-{t}"
        await self._start(c, t, session, "terminal")
        n = self.rng.randint(1, self.w.max_captures)
        for i in range(n):
            await self._capture(c, t, f"{t}-c{i}", None, f"q{i}")
        await self._stop(c, t)
        reward = self.rng.choice((0.0, 0.5, 1.0))
        for _ in range(50):
            try:
                res = await c.call("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": reward})
            except Interrupted:
                continue
            if res.status_code != 200:
                self.unexpected(f"reward {t} -> {res.status_code} {res.text[:200]}")
                return True
            self.record.reward_acknowledged(t, reward, res.json()["sample_count"])
            return True
        self.unexpected(f"reward of {t} never acknowledged")
        return True

    async def delayed_task(self, c: _Client, r: int) -> None:
        for _ in range(12):
            t = self.fresh(f"r{r}d")
            try:
                await self._start(c, t, f"s-{t}", "delayed_feedback")
                for u in range(1, self.w.turns + 1):
                    await self._capture(c, t, f"{t}-u{u}", f"u{u}", f"turn {u}")
                    if u > 1:  # the 2xx `:before` of turn u published turn u-1
                        self.record.turn_published(t, f"u{u - 1}")
                await self._stop(c, t)
                self.record.turn_published(t, f"u{self.w.turns}")
                return
            except Gone:
                self.outcome.tasks_abandoned += 1
        self.unexpected("a delayed Task never completed in 12 attempts")

    async def _start(self, c: _Client, t: str, session: str, mode: str) -> None:
        headers = {"X-Agent-Session-Id": session, "X-AIGW-RL-Task-Id": t, "X-AIGW-RL-Policy-Name": "base",
                   "X-AIGW-RL-Policy-Model": MODEL_ID}
        for _ in range(50):
            try:
                res = await c.call("POST", "/v1/rl/tasks/start", json={"reward_mode": mode}, headers=headers)
            except Interrupted:
                continue  # same id and spec: the repeat answers 200 with the same Task
            if res.status_code in (200, 201) and res.json()["rl_task_id"] == t:
                if res.json()["status"] != "active":
                    raise Gone(t)  # created, then aborted by a restart before the client heard of it
                self.record.task_started(t, mode)
                self.outcome.tasks_started += 1
                return
            self.unexpected(f"start {t} -> {res.status_code} {res.text[:200]}")
            raise Gone(t)
        raise Gone(t)

    async def _resume(self, c: _Client, t: str) -> str:
        status = await c.task_status(t)
        if status == "aborted" or status == "missing":
            raise Gone(t)
        return status

    async def _capture(self, c: _Client, t: str, cap: str, turn: str | None, text: str) -> None:
        request = copy.deepcopy(self.request)
        request["messages"] = list(request["messages"]) + [{"role": "user", "content": text}]
        hook = {"rl_task_id": t, "capture_id": cap, "agent_turn_id": turn}
        for _ in range(50):
            try:
                before = await c.call("POST", "/internal/v1/completions:before", json={**hook, "request": request})
                if before.status_code != 200:
                    self._hook_refused(t, "before", before)
                    await self._resume(c, t)
                    continue
                after = await c.call("POST", "/internal/v1/completions:after",
                                     json={**hook, "request": before.json()["request"], "response": self.response})
                if after.status_code != 204:
                    self._hook_refused(t, "after", after)
                    await self._resume(c, t)
                    continue
                self.record.capture_committed(t, cap, turn)
                return
            except Interrupted:
                if await self._resume(c, t) != "active":
                    self.unexpected(f"task {t} left active under an open capture")
                    raise Gone(t)
        raise Gone(t)

    def _hook_refused(self, t: str, hook: str, r: httpx.Response) -> None:
        # Under a fault a hook may legitimately meet an aborted Task (409); anything else is a finding.
        self.outcome.errors[f"{r.status_code}:{_code(r)}"] += 1
        if r.status_code != 409 or _code(r) != "completion_conflict":
            self.unexpected(f":{hook} of {t} -> {r.status_code} {r.text[:200]}")

    async def _stop(self, c: _Client, t: str) -> None:
        for _ in range(50):
            try:
                res = await c.call("POST", f"/v1/rl/tasks/{t}/stop")
            except Interrupted:
                if await self._resume(c, t) == "finalized":
                    break
                continue
            if res.status_code == 200 and res.json()["status"] == "finalized":
                break
            if res.status_code == 200 and res.json()["status"] == "aborted":
                raise Gone(t)
            self.unexpected(f"stop {t} -> {res.status_code} {res.text[:200]}")
            raise Gone(t)
        else:
            raise Gone(t)
        self.record.task_finalized(t)

    async def train(self, c: _Client) -> None:
        """Start a run and await it; a run failed by a restart is followed by a fresh one (its batch is back)."""
        for _ in range(6):
            self.claiming.set()
            try:
                res = await c.call("POST", "/v1/rl/training/runs")
            except Interrupted:
                continue
            if res.status_code == 409 and _code(res) == "insufficient_samples":
                return
            if res.status_code not in (200, 201):
                self.unexpected(f"run start -> {res.status_code} {res.text[:200]}")
                return
            run_id = res.json()["training_run_id"]
            if run_id not in self.run_ids:
                self.run_ids.append(run_id)
            status = await self._await_run(c, run_id)
            if status == "succeeded":
                self.outcome.runs_succeeded += 1
                return
        self.unexpected("no Training Run succeeded in 6 attempts")

    async def _await_run(self, c: _Client, run_id: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Interrupted):
                r = await c.call("GET", f"/v1/rl/training/runs/{run_id}")
                if r.status_code != 200:
                    self.unexpected(f"GET run {run_id} -> {r.status_code}")
                    return "missing"
                if r.json()["status"] in TERMINAL_RUN:
                    return r.json()["status"]
            await asyncio.sleep(0.05)
        self.unexpected(f"run {run_id} not terminal within {timeout_s} s")
        return "timeout"

    async def round(self, c: _Client, r: int) -> None:
        jobs = [self.terminal_task(c, r) for _ in range(self.w.terminal_tasks)]
        jobs += [self.delayed_task(c, r) for _ in range(self.w.delayed_tasks)]
        await asyncio.gather(*jobs)
        await self.train(c)

    # ---------------------------------------------------------------------------------------------- faults

    async def _random_kills(self, count: int) -> None:
        """SIGKILL at seeded moments; the killer restarts the service itself, so each kill lands on a live one."""
        for _ in range(count):
            await asyncio.sleep(self.rng.uniform(0.05, 0.6))
            async with self._restart_lock:
                assert self.svc.proc is not None
                if self.svc.proc.poll() is not None:
                    continue
                self.svc.sigkill()
                await asyncio.to_thread(self.svc.wait, 10)
                self.outcome.kills += 1
                await self._restart()

    async def _worker_kills(self, count: int, *, leader_only: bool) -> None:
        """SIGKILL single workers of the group at seeded moments (the group restarts each); with `leader_only`, the
        lease holder, the last time while a Training Run is being claimed or trained."""
        for n in range(count):
            if leader_only and n == count - 1:
                await self.claiming.wait()
                await asyncio.sleep(self.rng.uniform(0.0, 0.3))
            else:
                await asyncio.sleep(self.rng.uniform(0.2, 0.8))
            victim = await self._victim(leader_only)
            if victim is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
                self.outcome.kills += 1
            await self._until(lambda v=victim: self._worker_back(v), timeout_s=20.0)

    async def _victim(self, leader_only: bool) -> int | None:
        assert self.svc.pid is not None
        if not leader_only:
            workers = sorted(worker_pids(self.svc.pid))
            return self.rng.choice(workers) if workers else None
        async with Redis.from_url(self.redis_server.url) as redis:
            for _ in range(200):  # a failover in progress: wait until a live worker holds the lease
                holder = Holder.parse(await redis.get(keys.LEADER))
                if holder is not None and holder.pid in worker_pids(self.svc.pid):
                    return holder.pid
                await asyncio.sleep(0.05)
        return None

    async def _worker_back(self, victim: int) -> bool:
        assert self.svc.pid is not None
        pids = worker_pids(self.svc.pid)
        return victim not in pids and len(pids) == self.workers

    async def _pause_redis(self, when: Callable[[], Awaitable[None]], seconds: float) -> None:
        await when()
        self.redis_server.pause()
        self.outcome.redis_faults += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.redis_server.resume()

    async def _restart_redis(self, after_s: float, *, crash: bool) -> None:
        await asyncio.sleep(after_s)
        await asyncio.to_thread(self.redis_server.kill if crash else self.redis_server.stop)
        self.outcome.redis_faults += 1
        try:
            await asyncio.sleep(0.5)
        finally:  # never leave the run without its Redis
            await asyncio.to_thread(self.redis_server.start)

    def _judge(self) -> Any:
        """The Judge's behaviour: always a verdict, or under `judge:flaky` a seeded mix of failures."""
        if self.scenario != "judge:flaky":
            return Verdict(8)
        rng, lock = random.Random(f"judge/{self.seed}"), threading.Lock()
        failures = (Status(500), Content("I cannot rate this."), Raw(), Delay(1.5, Verdict(9)))

        def choose(_: Any) -> Any:
            with lock:  # the fake Judge answers from its own thread
                return rng.choice(failures) if rng.random() < 0.25 else Verdict(rng.randint(0, 10))

        return choose

    async def _until(self, probe: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not await probe():
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------------------------------------- run

    async def run(self) -> ChaosOutcome:
        began = time.monotonic()
        kind, _, arg = self.scenario.partition(":")
        env = {"ONLINE_RL_SCRIPTED_PLAN": str(self.plan)}
        if kind in ("crash", "recrash", "wcrash"):
            env[CRASH_ENV] = f"{arg}@{self.rng.randint(1, _CRASH_MAX_HIT.get(arg, 1))}"
        redis_url = self.redis_server.url
        if kind == "redis":
            redis_url += "?socket_timeout=1&socket_connect_timeout=1"
        with self.redis_server:
            redis = Redis.from_url(self.redis_server.url)
            try:
                async with FakeGateway(model_id=MODEL_ID) as gateway, FakeJudge(default=self._judge()) as judge:
                    self.svc = ServiceProcess(
                        self.workdir, redis_url, env=env, aigw_endpoint=gateway.url, trainer_backend="scripted",
                        min_samples_for_training=self.w.min_samples, max_samples_per_run=self.w.max_samples,
                        judge_endpoint=judge.url, judge_model="judge", judge_retries=0, judge_timeout=1.0,
                        lora_activation_timeout=10.0, training_tmp_root=str(self.workdir / "train-tmp"),
                        turn_publish_timeout_seconds=3.0, workers=self.workers,
                    )
                    with self.svc.start():
                        c = _Client(self)
                        try:
                            await self._drive(c, redis)
                            await self._settle(c)
                        finally:
                            await c.http.aclose()
                        await self._verify(redis, gateway)
                        if self.workers > 1:
                            self._count_worker_restarts()
                        self.svc.sigterm()
                        if self.svc.wait(60 if self.workers > 1 else 15) != 0:
                            self.unexpected(f"graceful stop exited {self.svc.proc.returncode}")
            finally:
                await redis.aclose()
        self.outcome.violations.extend(f"workload: {u}" for u in self._unexpected)
        self.outcome.ok = not self.outcome.violations
        self.outcome.duration_s = time.monotonic() - began
        return self.outcome

    async def _drive(self, c: _Client, redis: Redis) -> None:
        faults: list[asyncio.Task[None]] = []
        if self.scenario == "kill:random":
            faults.append(asyncio.create_task(self._random_kills(3)))
        elif self.scenario in ("kill:worker", "kill:leader"):
            leader = self.scenario == "kill:leader"
            faults.append(asyncio.create_task(self._worker_kills(2 if leader else 4, leader_only=leader)))
        elif self.scenario == "redis:pause":
            async def mid_captures() -> None:
                await self._until(lambda: _count_keys(redis, "rl:v1:task:*:captures:committed", 3))

            async def at_claim() -> None:
                await self.claiming.wait()
                await asyncio.sleep(self.rng.uniform(0.0, 0.03))  # lands in the claim's few round trips

            faults.append(asyncio.create_task(self._pause_redis(mid_captures, self.w.redis_pause_s)))
            faults.append(asyncio.create_task(self._pause_redis(at_claim, self.w.redis_pause_s)))
        elif self.scenario in ("redis:restart", "redis:kill"):
            after_s = self.rng.uniform(0.3, 1.0)
            faults.append(asyncio.create_task(self._restart_redis(after_s, crash=self.scenario == "redis:kill")))
        try:
            r = 0
            # Random kills land during traffic: rounds go on (up to 10) until the last kill has happened.
            killing = self.scenario in ("kill:random", "kill:worker", "kill:leader")
            while r < self.w.rounds or (killing and not faults[0].done() and r < 10):
                async with asyncio.timeout(ROUND_TIMEOUT_S):
                    await self.round(c, r)
                r += 1
            for f in faults:  # a fault still waiting for its moment is not a failure of the service
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(f), 5.0)
        finally:
            for f in faults:
                f.cancel()
            await asyncio.gather(*faults, return_exceptions=True)
        await self.ensure_service()

    def _count_worker_restarts(self) -> None:
        """A worker group: the deaths and restarts its own log reports (an injected crash kills only a worker)."""
        log = self.svc.log()
        died = log.count("; restarting it in")
        if self.scenario.startswith("wcrash:"):
            self.outcome.kills = died
        self.outcome.restarts = died
        if died < self.outcome.kills:
            self.outcome.violations.append(f"{self.outcome.kills} workers killed but {died} restarts reported")

    async def _settle(self, c: _Client) -> None:
        """No Task left active, no run left running: the state the invariants are checked in."""
        for run_id in self.run_ids:
            await self._await_run(c, run_id)

    async def _verify(self, redis: Redis, gateway: FakeGateway) -> None:
        health = await asyncio.to_thread(httpx.get, self.svc.url + "/health", timeout=5)
        if health.status_code != 200:
            self.outcome.violations.append(f"/health after the workload: {health.status_code} {health.text[:300]}")
        report = await check_invariants(
            redis, model_id=MODEL_ID, sent=self.record, strict_active_index=True, raise_on_violation=False
        )
        self.outcome.violations.extend(report.violations)
        self.outcome.samples = report.samples
        self.outcome.samples_checked = report.client_samples_checked
        # End-to-end accounting beyond the invariants: each succeeded run trained exactly its batch, and the
        # gateway serves the newest succeeded version.
        runs = [orjson.loads(raw) for raw in await redis.mget([keys.training_run(r) for r in self.run_ids]) if raw]
        succeeded = [r for r in runs if r["status"] == "succeeded"]
        for run in succeeded:
            statuses = [await redis.hget(keys.traj(s), "status") for s in run["sample_ids"]]
            if any(s != b"trained" for s in statuses):
                self.outcome.violations.append(f"run {run['training_run_id']} succeeded but its batch is {statuses}")
        trained = await redis.zcard(keys.traj_index(MODEL_ID, "trained"))
        if trained != sum(r["sample_count"] for r in succeeded):
            self.outcome.violations.append(
                f"{trained} trained samples, but succeeded runs trained {sum(r['sample_count'] for r in succeeded)}")
        if succeeded:
            newest = max(succeeded, key=lambda r: int(r["lora_name"].rsplit(":v", 1)[1]))
            if gateway.active != (newest["lora_name"], newest["lora_path"]):
                self.outcome.violations.append(f"gateway serves {gateway.active}, newest run is {newest['lora_name']}")
        if await redis.scard(keys.ACTIVE_TASKS):
            self.outcome.violations.append("Tasks left active after the workload")


async def _count_keys(redis: Redis, pattern: str, at_least: int) -> bool:
    n = 0
    async for key in redis.scan_iter(match=pattern, count=1000):
        n += await redis.scard(key)
    return n >= at_least


async def run_scenario(scenario: str, seed: int, workdir: Path, workload: Workload | None = None) -> ChaosOutcome:
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    workdir.mkdir(parents=True, exist_ok=True)
    return await _Harness(scenario, seed, workdir, workload or Workload()).run()
