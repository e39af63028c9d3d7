"""Gateway-side faults with real processes (docs/reliability.md): the gateway SIGKILLed with a pinned Task in flight,
and a vLLM instance that disappears under captured traffic. Each ends with the invariant checker."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from redis.asyncio import Redis

from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.invariants import ClientRecord, check_invariants
from tests.support.service_process import process_gone

pytestmark = pytest.mark.system

SESSION = "X-Agent-Session-Id"


@pytest.fixture
def vllm() -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="vllm-b") as b:
        yield a, b


def chat(client: openai.OpenAI, session: str, content: str = "hi") -> None:
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                         max_tokens=4, extra_headers={SESSION: session})
    assert out.choices[0].message.content


def chat_bodies(vllms: tuple[FakeVLLM, ...], since: dict[str, int]) -> list[tuple[str, dict]]:
    return [(v.name, r.body) for v in vllms for r in v.requests[since.get(v.name, 0):] if r.path == CHAT_PATH]


def task(gw: GatewayProcess, session: str) -> dict:
    r = gw.start_task(session)
    assert r.status_code == 201, r.text
    return r.json()


def finish(gw: GatewayProcess, t: str, reward: float) -> int:
    assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
    r = gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": reward})
    assert r.status_code == 200, r.text
    return r.json()["sample_count"]


def run_to_end(gw: GatewayProcess) -> dict:
    r = gw.signed("POST", "/v1/rl/training/runs")
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 30
    while (run := gw.signed("GET", f"/v1/rl/training/runs/{r.json()['training_run_id']}").json())["status"] not in (
            "succeeded", "failed", "canceled"):
        assert time.monotonic() < deadline, run
        time.sleep(0.1)
    return run


def child_pid(gw: GatewayProcess) -> int:
    """The gateway's only child (the RL Service), from every thread's `children` list (no psutil here)."""
    assert gw.proc is not None
    kids = {int(pid) for thread in Path(f"/proc/{gw.proc.pid}/task").iterdir()
            for pid in (thread / "children").read_text().split()}
    assert len(kids) == 1, kids
    return kids.pop()


async def test_gateway_sigkill_with_a_pinned_task_in_flight(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        gw.start_service()
        trained = task(gw, "train")
        chat(client, "train")
        assert finish(gw, trained["rl_task_id"], 1.0) == 1
        run = run_to_end(gw)
        assert (run["status"], run["lora_name"]) == ("succeeded", "tiny:v1"), run
        pinned = task(gw, "agent")
        assert pinned["policy_model"] == "tiny:v1"
        chat(client, "agent", "before the crash")  # committed, never rewarded
        child = child_pid(gw)

        gw.sigkill()
        deadline = time.monotonic() + 5
        while not process_gone(child):
            assert time.monotonic() < deadline, "the RL child outlived its gateway by 5 s"
            time.sleep(0.05)

        gw.start()
        status = gw.signed("GET", "/v1/loras/tiny").json()
        assert (status["status"], status["active_lora"]["lora_name"]) == ("active", "tiny:v1")
        gw.start_service()  # recovery: the Task whose gateway died is aborted, loudly
        old = gw.signed("GET", f"/v1/rl/tasks/{pinned['rl_task_id']}").json()
        assert (old["status"], old["finish_reason"]) == ("aborted", "service_restarted")
        # Its session is no longer mapped: the next call is plain bypass traffic (not captured, never attributed to
        # the aborted Task), served as the model the client names.
        mark = {v.name: len(v.requests) for v in vllm}
        chat(client, "agent", "after the crash")
        sent = chat_bodies(vllm, mark)
        assert len(sent) == 1 and sent[0][1]["model"] == "tiny" and "return_token_ids" not in sent[0][1]
        # A new Task on the same session pins the restored version and routes only to instances holding it.
        again = task(gw, "agent")
        assert again["policy_model"] == "tiny:v1"
        mark = {v.name: len(v.requests) for v in vllm}
        for n in range(4):
            chat(client, "agent", f"turn {n}")
        sent = chat_bodies(vllm, mark)
        assert [body["model"] for _, body in sent] == ["tiny:v1"] * 4
        assert all(body["return_token_ids"] is True for _, body in sent)
        assert finish(gw, again["rl_task_id"], 0.5) == 4
        stats = gw.signed("GET", "/v1/rl/trajectories/stats").json()
        assert stats["by_status"] == {"pending": 4, "training": 0, "trained": 1, "failed": 0}
        gw.signed("POST", "/v1/rl/service/stop")
    report = await check_invariants(redis, model_id="tiny", strict_active_index=True)
    assert report.samples == 5


async def test_vllm_instance_gone_under_captured_traffic(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, GatewayProcess(tmp_path, redis_url, instances=[a]) as gw:
        gw.start_service()
        t = task(gw, "s-gone")["rl_task_id"]
        ok = httpx.post(gw.url + "/v1/chat/completions", headers={SESSION: "s-gone"}, timeout=30,
                        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert ok.status_code == 200
        a.stop()  # the instance dies: connection refused from now on
        for stream in (False, True):
            r = httpx.post(gw.url + "/v1/chat/completions", headers={SESSION: "s-gone"}, timeout=30,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "again"}],
                                 "max_tokens": 4, "stream": stream})
            assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_unavailable")
        # The failed captures were discarded, the Task goes on: stop finalizes it with the one good capture.
        assert finish(gw, t, 1.0) == 1
        gw.signed("POST", "/v1/rl/service/stop")
    report = await check_invariants(redis, model_id="tiny", strict_active_index=True)
    assert report.samples == 1 and report.captures == 1


def test_rl_child_killed_under_agent_traffic_through_the_gateway(redis, redis_url, tmp_path, vllm):
    """Agents keep running Tasks through the gateway while the RL child is SIGKILLed twice and restarted by the
    operator: every reward the gateway acknowledged is exactly its samples, nothing else was published, and every
    invariant holds (the gateway's hook-failure handling, mappings and leases included)."""
    signing = threading.Lock()  # signed calls share one strictly increasing timestamp (replay protection)

    def signed(method: str, path: str, **kw):
        with signing:
            return gw.signed(method, path, **kw)

    acknowledged: dict[str, int] = {}
    failures: list[str] = []
    stop = threading.Event()

    def agent(n: int) -> None:
        http = httpx.Client(base_url=gw.url, timeout=30)
        i = 0
        while not stop.is_set():
            i += 1
            session = f"a{n}-{i}"
            with signing:
                r = gw.start_task(session)
            if r.status_code != 201:  # the RL child is down: 503 rl_service_unavailable
                failures.append(f"start {r.status_code}")
                time.sleep(0.05)
                continue
            t = r.json()["rl_task_id"]
            for k in range(2):
                c = http.post("/v1/chat/completions", headers={SESSION: session}, json={
                    "model": "tiny", "messages": [{"role": "user", "content": f"q{k}"}], "max_tokens": 4})
                assert c.status_code in (200, 502, 504), c.text  # 502/504: a hook met the dying child
            s = signed("POST", f"/v1/rl/tasks/{t}/stop")
            if s.status_code != 200 or s.json()["status"] != "finalized":
                failures.append(f"stop {s.status_code}")
                continue
            w = signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0})
            if w.status_code == 200:
                acknowledged[t] = w.json()["sample_count"]
            else:
                failures.append(f"reward {w.status_code} {w.json()['error']['code']}")
        http.close()

    with GatewayProcess(tmp_path, redis_url, instances=list(vllm)) as gw:
        gw.start_service()
        agents = [threading.Thread(target=agent, args=(n,)) for n in range(3)]
        for a in agents:
            a.start()
        try:
            for _ in range(2):
                time.sleep(1.0)
                with signing:
                    child = child_pid(gw)
                os.kill(child, signal.SIGKILL)  # only the pid the gateway spawned
                deadline = time.monotonic() + 10
                while signed("GET", "/v1/rl/service").json()["status"] != "failed":
                    assert time.monotonic() < deadline, "the gateway did not notice its child's death"
                    time.sleep(0.05)
                r = signed("POST", "/v1/rl/service/start")
                assert r.status_code == 200, r.text
            time.sleep(1.0)
        finally:
            stop.set()
            for a in agents:
                a.join(60)
        assert len(acknowledged) >= 3 and failures, (acknowledged, failures)
        stats = signed("GET", "/v1/rl/trajectories/stats").json()
        assert stats["total"] == sum(acknowledged.values()), (stats, acknowledged)
        assert signed("POST", "/v1/rl/service/stop").status_code == 200
    record = ClientRecord()
    for t, count in acknowledged.items():
        record.task_started(t)
        record.task_finalized(t)
        record.reward_acknowledged(t, 1.0, count)
    asyncio.run(check_in_fresh_loop(redis_url, record))


async def check_in_fresh_loop(redis_url: str, record: ClientRecord) -> None:
    client = Redis.from_url(redis_url)
    try:
        await check_invariants(client, model_id="tiny", sent=record, strict_active_index=True)
    finally:
        await client.aclose()
