"""The RL Service as a worker group of real processes (`workers: 3`, CONTRACT §2.11): one port, restarts, leader
failover under SIGKILL, relayed leader-only routes, aggregated metrics, a clean SIGTERM.

Every test starts `python -m …online.service` with `workers: 3` against the session's private Redis and a fake
gateway (policy reads, activations) and checks the stored state with the invariant checker.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.workers.lease import Holder
from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import ClientRecord, check_invariants
from tests.support.service_app import start_headers
from tests.support.service_process import ServiceProcess, process_gone, worker_pids
from tests.support.waiting import wait_for

pytestmark = pytest.mark.system

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")
WORKERS = 3


def health(url: str) -> dict:
    with httpx.Client(timeout=5) as c:  # a new connection each time: any worker may answer
        r = c.get(url + "/health")
    assert r.status_code == 200, r.text
    return r.json()


def live_workers(svc: ServiceProcess) -> bool:
    if len(worker_pids(svc.pid)) != WORKERS:
        return False
    try:
        return health(svc.url)["workers"]["live"] == WORKERS
    except httpx.TransportError:
        # The kernel may hand the connection to a replacement that has bound the shared port but is not accepting
        # yet (seconds on busy cores): not serving yet, so poll again.
        return False


def leader(svc: ServiceProcess, redis_url: str) -> Holder | None:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        return Holder.parse(r.get(keys.LEADER))
    finally:
        r.close()


def observed_now(redis_url: str) -> bytes | None:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        return r.get(keys.POLICY_OBSERVED)
    finally:
        r.close()


def follower_port(svc: ServiceProcess) -> int:
    """A follower's private port, as its /health tells (connections spread over the workers)."""
    for _ in range(200):
        w = health(svc.url)["workers"]
        if not w["leader"]:
            return w["port"]
    raise AssertionError("no follower answered /health in 200 tries")


class Agent:
    """Tasks with captures the way the gateway sends them: a hook whose answer is lost is sent again (the hooks
    are idempotent per capture id), and only acknowledged outcomes are recorded."""

    def __init__(self, url: str, record: ClientRecord) -> None:
        self.url, self.record = url, record
        self.retries = 0

    def _post(self, path: str, **kw) -> httpx.Response:
        for _ in range(40):
            try:
                with httpx.Client(base_url=self.url, timeout=20) as c:
                    r = c.post(path, **kw)
                if r.status_code < 500:
                    return r
            except httpx.TransportError:
                pass
            self.retries += 1
            time.sleep(0.1)
        raise AssertionError(f"{path} never answered")

    def task(self, t: str, captures: int, reward: float = 1.0) -> None:
        r = self._post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=start_headers(f"s-{t}", t))
        assert r.status_code in (200, 201) and r.json()["status"] == "active", r.text
        self.record.task_started(t, "terminal")
        for i in range(captures):
            hook = {"rl_task_id": t, "capture_id": f"{t}-c{i}", "agent_turn_id": None}
            before = self._post("/internal/v1/completions:before", json={**hook, "request": REQUEST})
            assert before.status_code == 200, before.text
            after = self._post("/internal/v1/completions:after",
                               json={**hook, "request": before.json()["request"], "response": RESPONSE})
            assert after.status_code == 204, after.text
            self.record.capture_committed(t, f"{t}-c{i}", None)
        assert self._post(f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        self.record.task_finalized(t)
        r = self._post(f"/v1/rl/tasks/{t}/reward", json={"reward": reward})
        assert r.status_code == 200, r.text
        self.record.reward_acknowledged(t, reward, r.json()["sample_count"])


@pytest.fixture
async def gateway():
    async with FakeGateway(model_id="tiny") as gw:
        yield gw


def group(tmp_path: Path, redis_url: str, gateway: FakeGateway, plan: Path, **overrides) -> ServiceProcess:
    return ServiceProcess(
        tmp_path, redis_url, env={"ONLINE_RL_SCRIPTED_PLAN": str(plan)}, aigw_endpoint=gateway.url,
        trainer_backend="scripted", min_samples_for_training=2, max_samples_per_run=64, workers=WORKERS,
        training_tmp_root=str(tmp_path / "train-tmp"), **overrides,
    )


def plan(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "plan.json"
    path.write_bytes(orjson.dumps({"outcome": "succeed", **fields}))
    return path


async def test_workers_share_the_port_relay_leader_routes_and_sum_their_metrics(redis, redis_url, tmp_path, gateway):
    with group(tmp_path, redis_url, gateway, plan(tmp_path)).start() as svc:
        wait_for(lambda: live_workers(svc), timeout_s=15.0, what="3 live workers")
        answered = {health(svc.url)["workers"]["worker"] for _ in range(60)}
        assert len(answered) >= 2, answered  # the kernel spreads connections over the workers
        record = ClientRecord()
        agent = Agent(svc.url, record)
        for n in range(3):
            agent.task(f"t{n}", captures=2)
        # A Training Run started on a follower's own port runs on the leader.
        port = follower_port(svc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/rl/training/runs", timeout=30)
        assert r.status_code == 201, r.text
        run_id = r.json()["training_run_id"]
        wait_for(lambda: httpx.get(f"{svc.url}/v1/rl/training/runs/{run_id}").json()["status"] == "succeeded",
                 what="the run to succeed")
        assert [a["lora_name"] for a in gateway.activations] == ["tiny:v1"]
        again = httpx.post(f"http://127.0.0.1:{port}/v1/rl/training/runs", timeout=30)
        assert (again.status_code, again.json()["error"]["code"]) == (409, "insufficient_samples")
        # Every worker's counts are in one scrape, whichever worker answers it.
        for _ in range(5):
            text = httpx.get(svc.url + "/metrics").text
            assert 'rl_captures_total{model_id="tiny",result="committed"} 6.0' in text
            assert 'rl_tasks_total{model_id="tiny",reward_mode="terminal"} 3.0' in text
        report = await check_invariants(redis, model_id="tiny", sent=record, raise_on_violation=False)
        assert report.ok, report.violations


async def test_a_killed_follower_is_restarted_and_every_capture_lands_once(redis, redis_url, tmp_path, gateway):
    with group(tmp_path, redis_url, gateway, plan(tmp_path)).start() as svc:
        wait_for(lambda: live_workers(svc), timeout_s=15.0, what="3 live workers")
        record = ClientRecord()
        agent = Agent(svc.url, record)
        agent.task("t-before", captures=2)
        holder = leader(svc, redis_url)
        assert holder is not None
        victims = sorted(worker_pids(svc.pid) - {holder.pid})
        for n, victim in enumerate(victims):
            os.kill(victim, signal.SIGKILL)
            agent.task(f"t-after-{n}", captures=3)  # served by the others while the group restarts the victim
            wait_for(lambda v=victim: v not in worker_pids(svc.pid) and live_workers(svc), timeout_s=15.0, what="the restart")
        assert leader(svc, redis_url) == holder  # the leader never changed
        report = await check_invariants(redis, model_id="tiny", sent=record, raise_on_violation=False)
        assert report.ok, report.violations
        assert record.expected_samples == 8 == report.samples
        assert "worker" in svc.log() and "killed by signal SIGKILL; restarting it" in svc.log()


async def test_a_killed_leader_hands_its_duties_over_and_its_run_is_settled(redis, redis_url, tmp_path, gateway):
    path = plan(tmp_path, outcome="block")
    with group(tmp_path, redis_url, gateway, path).start() as svc:
        wait_for(lambda: live_workers(svc), timeout_s=15.0, what="3 live workers")
        record = ClientRecord()
        agent = Agent(svc.url, record)
        for n in range(2):
            agent.task(f"t{n}", captures=2)
        run_id = httpx.post(svc.url + "/v1/rl/training/runs", timeout=30).json()["training_run_id"]
        wait_for(lambda: httpx.get(f"{svc.url}/v1/rl/training/runs/{run_id}").json()["stage"] == "training",
                 what="stage training")
        old = leader(svc, redis_url)
        assert old is not None
        os.kill(old.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        run = wait_for(lambda: (r := httpx.get(f"{svc.url}/v1/rl/training/runs/{run_id}").json())["status"] != "running"
                       and r, what="the run to be settled", timeout_s=20)
        assert (run["status"], run["failure_reason"]) == ("failed", "service_restarted")
        new = leader(svc, redis_url)
        assert new is not None and new.pid != old.pid
        assert time.monotonic() - killed_at < 10  # a lease TTL (5 s) plus a start, not a timeout
        stats = httpx.get(svc.url + "/v1/rl/trajectories/stats").json()["by_status"]
        assert stats["pending"] == 4 and stats["training"] == 0
        # Captures went on meanwhile; the next run (relayed to the new leader wherever it lands) trains everything.
        agent.task("t-late", captures=1)
        path.write_bytes(orjson.dumps({"outcome": "succeed"}))
        nxt = wait_for(lambda: (r := httpx.post(svc.url + "/v1/rl/training/runs", timeout=30)).status_code == 201
                       and r, what="a new run")
        nid = nxt.json()["training_run_id"]
        done = wait_for(lambda: (r := httpx.get(f"{svc.url}/v1/rl/training/runs/{nid}").json())["status"]
                        == "succeeded" and r, what="the new run")
        assert done["sample_count"] == 5
        epoch = int(await redis.get(keys.LEADER_EPOCH))
        assert epoch >= 2
        report = await check_invariants(redis, model_id="tiny", sent=record, raise_on_violation=False)
        assert report.ok, report.violations


async def test_sigterm_stops_every_worker_and_finishes_the_active_tasks(redis, redis_url, tmp_path, gateway):
    svc = group(tmp_path, redis_url, gateway, plan(tmp_path)).start()
    with svc:
        wait_for(lambda: live_workers(svc), timeout_s=15.0, what="3 live workers")
        workers = worker_pids(svc.pid)
        with httpx.Client(base_url=svc.url, timeout=10) as c:
            for n in range(4):
                r = c.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                           headers=start_headers(f"s{n}", f"t{n}"))
                assert r.status_code == 201
        svc.sigterm()
        assert svc.wait(60) == 0
        assert all(process_gone(pid) for pid in workers)
        for n in range(4):
            record = orjson.loads(await redis.get(keys.task(f"t{n}")))
            assert (record["status"], record["finish_reason"]) == ("finalized", "service_stopped")
        assert await redis.zcard(keys.WORKERS) == 0 and await redis.get(keys.LEADER) is None
        assert "RL Service worker group stopped (clean)" in svc.log()


async def test_a_group_whose_workers_cannot_start_fails_like_a_lone_service(redis, redis_url, tmp_path, gateway):
    await redis.set(keys.OWNER, "another-model")
    svc = group(tmp_path, redis_url, gateway, plan(tmp_path))
    with svc.start(wait_ready=False):
        assert svc.wait(60) == 1
        assert "belongs to another model id" in svc.log() + svc.stderr()
        assert "before the group was ready; stopping the RL Service" in svc.log()


async def test_a_group_that_was_ready_outlives_every_worker_dying_twice(redis, redis_url, tmp_path, gateway):
    """All workers SIGKILLed at once, then their replacements killed again while still starting: once the group
    served, no death is a failed start; it restarts them until they serve (the chaos sweep found a group that took
    the death of a replacement, after all ready workers had died, for a failed start and exited)."""
    with group(tmp_path, redis_url, gateway, plan(tmp_path)).start() as svc:
        wait_for(lambda: live_workers(svc), timeout_s=15.0, what="3 live workers")
        first = worker_pids(svc.pid)
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        second = wait_for(lambda: (p := worker_pids(svc.pid)) and not p & first and len(p) == WORKERS and p,
                          timeout_s=15.0, what="the replacements")
        for pid in second:
            os.kill(pid, signal.SIGKILL)  # before they are ready: a worker takes a second or more to start
        wait_for(lambda: live_workers(svc) and not worker_pids(svc.pid) & (first | second), timeout_s=30.0,
                 what="a third generation serving")
        assert svc.proc is not None and svc.proc.poll() is None
        assert "before the group was ready" not in svc.log()


async def test_a_leader_stopped_past_its_ttl_lands_no_duty_write_after_the_takeover(redis, redis_url, tmp_path,
                                                                                     gateway):
    """Issue 28 item 11. The leader stops itself (SIGSTOP, `stop:run.activated`) right after the gateway switched to
    the run's version, with the run's next writes (the observed policy, the outcome) already on their way. Its lease
    lapses; a worker of the next generation takes over and settles the run. Then SIGCONT: the old leader goes on
    from that line, and Redis refuses each of its writes (fencing token), so nothing it writes lands.

    The followers are SIGKILLed while the leader is stopped so that the successor is a replacement, which runs
    without the fault (group.py): a first-generation successor would stop at the same point of its own recovery."""
    path = plan(tmp_path)
    svc = group(tmp_path, redis_url, gateway, path)
    svc.env["ONLINE_RL_CRASH_AT"] = "stop:run.activated"
    with svc.start() as svc:
        wait_for(lambda: live_workers(svc), timeout_s=15.0, what="3 live workers")
        record = ClientRecord()
        agent = Agent(svc.url, record)
        for n in range(2):
            agent.task(f"t{n}", captures=2)
        old = leader(svc, redis_url)
        assert old is not None
        run_id = httpx.post(svc.url + "/v1/rl/training/runs", timeout=30).json()["training_run_id"]
        wait_for(lambda: "fault injection: stopping at run.activated" in svc.log(), what="the leader to stop")
        try:
            first = worker_pids(svc.pid)
            for pid in first - {old.pid}:
                os.kill(pid, signal.SIGKILL)
            # Redis only from here: a connection the kernel hands the stopped worker would never be answered.

            async def run_record() -> dict:
                return orjson.loads(await redis.get(keys.training_run(run_id)))

            for _ in range(400):  # the TTL (5 s), the replacements' start, their recovery of the run
                new = leader(svc, redis_url)
                if new is not None and new.pid not in first and (await run_record())["status"] == "succeeded":
                    break
                time.sleep(0.05)
            assert new is not None and new.pid not in first, new
            run = await run_record()
            assert run["status"] == "succeeded", run
            # What the new leader wrote, and what the old one would overwrite: the observed policy (a plain SET, its
            # time changes with every write), the run record and its timeline.
            observed = await redis.get(keys.POLICY_OBSERVED)
            assert observed is not None
            events = await redis.xlen(keys.training_run_events(run_id))
            os.kill(old.pid, signal.SIGCONT)
            stopped = f"training run {run_id}: execution stopped"
            wait_for(lambda: stopped in svc.log() or observed_now(redis_url) != observed, timeout_s=15.0,
                     what="the old leader's write, refused or landed")
            time.sleep(1.0)  # anything else it had queued
            assert await redis.get(keys.POLICY_OBSERVED) == observed
            # Refused: by Redis ("the lease holds term N") or, when the overdue fence timer ran first, locally; which
            # one is a race of the resumed loop (the integration test of the frozen loop pins Redis's refusal).
            assert stopped in svc.log()
            assert await run_record() == run
            assert await redis.xlen(keys.training_run_events(run_id)) == events
            assert leader(svc, redis_url) == new  # and it never got the lease back
            assert [a["lora_name"] for a in gateway.activations] == ["tiny:v1", "tiny:v1"]  # the retried activation
        finally:
            with suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGCONT)  # never leave a stopped worker behind a failed assertion
        report = await check_invariants(redis, model_id="tiny", sent=record, raise_on_violation=False)
        assert report.ok, report.violations
