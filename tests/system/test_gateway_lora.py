"""The LoRA lifecycle and the RL child's supervision with real processes: gateway + RL Service child (scripted
trainer) + private Redis + fake vLLM instances, agents through the official `openai` SDK (CONTRACT §3.3 supervision,
§3.4 pinning and leases, §3.8 activation, §3.9 registration and degraded state; §9 "Gateway (system, real processes)").
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.support.fake_vllm import CHAT_PATH, LOAD_PATH, UNLOAD_PATH, FakeVLLM
from tests.support.gateway_process import INS_KEY, LOOPBACK_REGISTRATION, GatewayProcess
from tests.support.service_process import process_gone

pytestmark = pytest.mark.system

RUN_TIMEOUT_S = 30.0
CHILD_GONE_S = 5.0
TERMINAL_RUN = {"succeeded", "failed", "canceled"}


@pytest.fixture
def vllm() -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="vllm-b") as b:
        yield a, b


# ---------------------------------------------------------------------------------------------------- helpers


def agent(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, session: str | None, content: str = "hi") -> str:
    headers = {"X-Agent-Session-Id": session} if session else None
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                         max_tokens=4, extra_headers=headers)
    assert out.choices[0].message.content
    return out.model


def marks(vllms: Sequence[FakeVLLM]) -> dict[str, int]:
    return {v.name: len(v.requests) for v in vllms}


def chats_since(vllms: Sequence[FakeVLLM], mark: dict[str, int]) -> list[tuple[str, dict[str, Any]]]:
    """(instance name, body) of every chat request an instance received after `mark`."""
    return [(v.name, r.body) for v in vllms for r in v.requests[mark.get(v.name, 0):] if r.path == CHAT_PATH]


def start_task(gw: GatewayProcess, session: str) -> dict[str, Any]:
    r = gw.start_task(session)
    assert r.status_code == 201, r.text
    return r.json()


def stop_task(gw: GatewayProcess, rl_task_id: str) -> dict[str, Any]:
    r = gw.signed("POST", f"/v1/rl/tasks/{rl_task_id}/stop")
    assert r.status_code == 200 and r.json()["status"] == "finalized", r.text
    return r.json()


def lora_status(gw: GatewayProcess) -> dict[str, Any]:
    r = gw.signed("GET", "/v1/loras/tiny")
    assert r.status_code == 200, r.text
    return r.json()


def wait_run(gw: GatewayProcess, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        r = gw.signed("GET", f"/v1/rl/training/runs/{run_id}")
        assert r.status_code == 200, r.text
        record = r.json()
        if record["status"] in TERMINAL_RUN:
            return record
        assert time.monotonic() < deadline, f"run not terminal within {RUN_TIMEOUT_S} s: {record}"
        time.sleep(0.1)


def rewarded_sample(gw: GatewayProcess, client: openai.OpenAI, session: str) -> None:
    """One captured completion on a fresh Task, stopped and rewarded: one pending sample."""
    task = start_task(gw, session)
    chat(client, session)
    stop_task(gw, task["rl_task_id"])
    r = gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/reward", json={"reward": 1.0})
    assert r.json() == {"sample_count": 1}, r.text


def train(gw: GatewayProcess, client: openai.OpenAI, session: str) -> dict[str, Any]:
    """Capture + reward one sample, then one Training Run to its end; returns the run record."""
    rewarded_sample(gw, client, session)
    r = gw.signed("POST", "/v1/rl/training/runs")
    assert r.status_code == 201, r.text
    return wait_run(gw, r.json()["training_run_id"])


def activate_v1(gw: GatewayProcess, client: openai.OpenAI) -> str:
    run = train(gw, client, "train-v1")
    assert run["status"] == "succeeded", run
    assert run["lora_name"] == "tiny:v1"
    return run["lora_path"]


def loads(v: FakeVLLM, lora_name: str) -> list[dict[str, Any]]:
    return [r.body for r in v.requests if r.path == LOAD_PATH and r.body.get("lora_name") == lora_name]


def unloads(v: FakeVLLM, lora_name: str) -> int:
    return sum(1 for r in v.requests if r.path == UNLOAD_PATH and r.body.get("lora_name") == lora_name)


def children(pid: int) -> list[int]:
    """The child pids of `pid`, from every thread's `children` list (no psutil here)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended while we listed
            continue
    return sorted(set(found))


def rl_child_pid(gw: GatewayProcess) -> int:
    assert gw.proc is not None
    kids = children(gw.proc.pid)
    assert len(kids) == 1, f"expected exactly the RL child under the gateway, got {kids}"
    return kids[0]


def wait_gone(pid: int, timeout_s: float) -> float:
    """Seconds until `pid` is gone; fails after `timeout_s`."""
    start = time.monotonic()
    while not process_gone(pid):
        assert time.monotonic() - start < timeout_s, f"pid {pid} still runs after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def wait_service(gw: GatewayProcess, status: str, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        body = gw.signed("GET", "/v1/rl/service").json()
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, f"service not {status} within {timeout_s} s: {body}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------- tests


def test_training_run_activates_on_every_instance_and_pins_new_tasks(redis, redis_url, tmp_path, vllm):
    a, b = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a, b]) as gw:
        client = agent(gw)
        gw.start_service()
        assert lora_status(gw) == {"status": "base", "active_lora": None, "instances": {"ready": 2, "failed": 0}}
        older = start_task(gw, "older")
        assert (older["policy_lora_name"], older["policy_model"]) == ("base", "tiny")

        path = activate_v1(gw, client)

        assert path == str(gw.lora_root / "tiny" / "v1")
        for v in vllm:
            assert v.loaded_paths == {"tiny:v1": path}
            assert loads(v, "tiny:v1") == [{"lora_name": "tiny:v1", "lora_path": path}]
        assert lora_status(gw) == {"status": "active", "active_lora": {"lora_name": "tiny:v1", "lora_path": path},
                                   "instances": {"ready": 2, "failed": 0}}
        newer = start_task(gw, "newer")
        assert (newer["policy_lora_name"], newer["policy_model"]) == ("tiny:v1", "tiny:v1")
        record = gw.signed("GET", f"/v1/rl/tasks/{newer['rl_task_id']}").json()
        assert (record["policy_lora_name"], record["policy_model"]) == ("tiny:v1", "tiny:v1")

        mark = marks(vllm)
        chat(client, "newer")
        chat(client, "newer")
        sent = chats_since(vllm, mark)
        assert [body["model"] for _, body in sent] == ["tiny:v1", "tiny:v1"]
        assert all(body["return_token_ids"] is True for _, body in sent)  # captured, not bypassed

        mark = marks(vllm)
        chat(client, "older")
        assert [body["model"] for _, body in chats_since(vllm, mark)] == ["tiny"]
        older_record = gw.signed("GET", f"/v1/rl/tasks/{older['rl_task_id']}").json()
        assert (older_record["policy_lora_name"], older_record["policy_model"]) == ("base", "tiny")


def test_delete_moves_new_tasks_to_base_and_unloads_after_the_last_pinned_task(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm)) as gw:
        client = agent(gw)
        gw.start_service()
        path = activate_v1(gw, client)
        pinned = [start_task(gw, "pinned-1"), start_task(gw, "pinned-2")]
        assert {t["policy_model"] for t in pinned} == {"tiny:v1"}

        r = gw.signed("DELETE", "/v1/loras/tiny")
        assert (r.status_code, r.content) == (204, b"")
        assert lora_status(gw) == {"status": "base", "active_lora": None, "instances": {"ready": 2, "failed": 0}}
        fresh = start_task(gw, "fresh")
        assert (fresh["policy_lora_name"], fresh["policy_model"]) == ("base", "tiny")

        mark = marks(vllm)
        chat(client, "pinned-1")
        assert [body["model"] for _, body in chats_since(vllm, mark)] == ["tiny:v1"]
        mark = marks(vllm)
        chat(client, "fresh")
        assert [body["model"] for _, body in chats_since(vllm, mark)] == ["tiny"]
        for v in vllm:
            assert v.loaded_paths == {"tiny:v1": path}
            assert unloads(v, "tiny:v1") == 0

        stop_task(gw, pinned[0]["rl_task_id"])  # one lease left
        mark = marks(vllm)
        chat(client, "pinned-2")
        assert [body["model"] for _, body in chats_since(vllm, mark)] == ["tiny:v1"]
        for v in vllm:
            assert v.loaded == {"tiny:v1"} and unloads(v, "tiny:v1") == 0

        stop_task(gw, pinned[1]["rl_task_id"])  # the last lease: unloaded everywhere before the stop answers
        for v in vllm:
            assert v.loaded == set()
            assert unloads(v, "tiny:v1") == 1
        assert lora_status(gw)["status"] == "base"


def test_partial_activation_failure_rolls_back_and_keeps_the_previous_version(redis, redis_url, tmp_path, vllm):
    a, b = vllm
    # One attempt: the client would otherwise retry the 502 and succeed on the next try.
    with GatewayProcess(tmp_path, redis_url, instances=[a, b], rl_overrides={"lora_activation_attempts": 1}) as gw:
        client = agent(gw)
        gw.start_service()
        v1_path = activate_v1(gw, client)
        b.fail_next(LOAD_PATH, 500)

        run = train(gw, client, "train-v2")

        assert run["status"] == "failed", run
        assert run["lora_name"] == "tiny:v2"  # the artifact is kept
        prefix, _, body = run["failure_reason"].partition(": ")
        assert prefix == "activation status 502", run["failure_reason"]
        error = orjson.loads(body)["error"]
        assert error["code"] == "lora_activation_failed"
        assert error["message"].startswith("vllm-b: status 500: "), error
        assert Path(run["lora_path"], "metadata.json").is_file()
        # a loaded it and got it unloaded again (rollback); b answered 500 and holds nothing new.
        assert len(loads(a, "tiny:v2")) == 1 and unloads(a, "tiny:v2") == 1
        assert len(loads(b, "tiny:v2")) == 1 and unloads(b, "tiny:v2") == 0
        for v in vllm:
            assert v.loaded_paths == {"tiny:v1": v1_path}
            assert unloads(v, "tiny:v1") == 0
        assert lora_status(gw) == {"status": "active", "active_lora": {"lora_name": "tiny:v1", "lora_path": v1_path},
                                   "instances": {"ready": 2, "failed": 0}}
        task = start_task(gw, "after-failure")
        assert task["policy_model"] == "tiny:v1"


def test_rl_child_sigkill_fails_the_service_while_inference_continues(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm)) as gw:
        client = agent(gw)
        gw.start_service()
        activate_v1(gw, client)
        task = start_task(gw, "victim")
        assert task["policy_model"] == "tiny:v1"
        chat(client, "victim")
        assert gw.signed("DELETE", "/v1/loras/tiny").status_code == 204
        assert [v.loaded for v in vllm] == [{"tiny:v1"}] * 2  # still leased by the victim
        child = rl_child_pid(gw)

        os.kill(child, signal.SIGKILL)  # only the pid the gateway spawned

        wait_gone(child, CHILD_GONE_S)
        failed = wait_service(gw, "failed")
        assert failed["failure_reason"] and "SIGKILL" in failed["failure_reason"], failed
        # The failure released the victim's lease: the deleted version leaves every instance.
        for v in vllm:
            v.wait_until(lambda f: f.loaded == set())
            assert unloads(v, "tiny:v1") == 1
        # Inference keeps working: the old session's mapping was released, so it bypasses the RL Service.
        mark = marks(vllm)
        assert chat(client, "victim") == "tiny"
        assert chat(client, None) == "tiny"
        sent = chats_since(vllm, mark)
        assert len(sent) == 2 and all("return_token_ids" not in body for _, body in sent)
        assert lora_status(gw)["status"] == "base"
        r = gw.start_task("during-failure")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "rl_service_unavailable")

        r = gw.signed("POST", "/v1/rl/service/start")
        assert r.status_code == 200 and r.json() == {"status": "running", "failure_reason": None}, r.text
        assert rl_child_pid(gw) != child
        old = gw.signed("GET", f"/v1/rl/tasks/{task['rl_task_id']}").json()
        assert (old["status"], old["finish_reason"]) == ("aborted", "service_restarted")
        again = start_task(gw, "victim")
        assert again["rl_task_id"] != task["rl_task_id"]


def test_gateway_sigkill_takes_the_child_and_restart_restores_active_or_degraded(redis, redis_url, tmp_path, vllm):
    a, b = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a, b]) as gw:
        client = agent(gw)
        gw.start_service()
        path = activate_v1(gw, client)
        active = {"status": "active", "active_lora": {"lora_name": "tiny:v1", "lora_path": path},
                  "instances": {"ready": 2, "failed": 0}}
        child = rl_child_pid(gw)

        gw.sigkill()

        wait_gone(child, CHILD_GONE_S)
        # Restart with vLLMs that kept the adapter: restored from what they list.
        gw.start()
        assert lora_status(gw) == active
        assert [v.loaded_paths for v in vllm] == [{"tiny:v1": path}] * 2
        assert gw.signed("GET", "/v1/rl/service").json() == {"status": "stopped", "failure_reason": None}

        # Restart after both vLLMs restarted too, one of them refusing loads: explicit `degraded`.
        gw.sigkill()
        a.drop_loras()
        b.drop_loras()
        b.fail_loads = True
        loads_before = [len(loads(v, "tiny:v1")) for v in vllm]
        gw.start()
        assert [len(loads(v, "tiny:v1")) for v in vllm] == [loads_before[0] + 1, loads_before[1] + 1]
        assert a.loaded_paths == {"tiny:v1": path} and b.loaded == set()
        degraded = lora_status(gw)  # retries b first, which still refuses
        assert degraded == {**active, "status": "degraded", "instances": {"ready": 1, "failed": 1}}
        gw.start_service()
        task = start_task(gw, "pinned")
        assert task["policy_model"] == "tiny:v1"  # degraded still pins the active version
        mark = marks(vllm)
        for n in range(4):
            chat(client, "pinned", f"turn {n}")
        assert [(name, body["model"]) for name, body in chats_since(vllm, mark)] == [("vllm-a", "tiny:v1")] * 4

        b.fail_loads = False
        assert lora_status(gw) == active
        assert b.loaded_paths == {"tiny:v1": path}

        # Restart with the artifact gone and both vLLMs restarted: degraded everywhere, and pinned traffic is
        # refused rather than sent where the adapter is missing.
        gw.sigkill()
        a.drop_loras()
        b.drop_loras()
        Path(path).rename(Path(path).with_name("v1-moved"))
        gw.start()
        assert lora_status(gw) == {**active, "status": "degraded", "instances": {"ready": 0, "failed": 2}}
        gw.start_service()
        assert start_task(gw, "orphan")["policy_model"] == "tiny:v1"
        mark = marks(vllm)
        with pytest.raises(openai.APIStatusError) as refused:
            chat(client, "orphan")
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "lora_unavailable", refused.value.body
        assert chats_since(vllm, mark) == []


def test_registered_instances_get_the_active_adapter_or_degrade_until_repaired(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm), extra_config=LOOPBACK_REGISTRATION) as gw, \
            FakeVLLM(served_model="tiny", name="vllm-c") as c, FakeVLLM(served_model="tiny", name="vllm-d") as d:
        client = agent(gw)
        gw.start_service()
        path = activate_v1(gw, client)

        r = gw.signed("POST", "/aigw/v1/register-instance", json=c.registration(), key=INS_KEY)

        assert r.status_code == 200, r.text
        assert c.loaded_paths == {"tiny:v1": path}
        assert lora_status(gw)["instances"] == {"ready": 3, "failed": 0}
        assert lora_status(gw)["status"] == "active"
        # Idempotent by name: a repeat loads nothing; a restarted vLLM (nothing loaded) re-registering gets it back.
        assert gw.signed("POST", "/aigw/v1/register-instance", json=c.registration(), key=INS_KEY).status_code == 200
        assert len(loads(c, "tiny:v1")) == 1
        c.drop_loras()
        assert gw.signed("POST", "/aigw/v1/register-instance", json=c.registration(), key=INS_KEY).status_code == 200
        assert len(loads(c, "tiny:v1")) == 2 and c.loaded_paths == {"tiny:v1": path}

        d.fail_loads = True
        r = gw.signed("POST", "/aigw/v1/register-instance", json=d.registration(), key=INS_KEY)
        assert r.status_code == 200, r.text
        assert d.loaded == set() and len(loads(d, "tiny:v1")) == 1
        status = lora_status(gw)
        assert (status["status"], status["instances"]) == ("degraded", {"ready": 3, "failed": 1})
        task = start_task(gw, "pinned")
        mark = marks([*vllm, c, d])
        for n in range(6):
            chat(client, "pinned", f"turn {n}")
        sent = chats_since([*vllm, c, d], mark)
        assert len(sent) == 6 and {body["model"] for _, body in sent} == {"tiny:v1"}
        assert "vllm-d" not in {name for name, _ in sent}
        stop_task(gw, task["rl_task_id"])

        d.fail_loads = False
        assert lora_status(gw) == {"status": "active", "active_lora": {"lora_name": "tiny:v1", "lora_path": path},
                                   "instances": {"ready": 4, "failed": 0}}
        assert d.loaded_paths == {"tiny:v1": path}
        # Unsigned registration is refused; the api key is accepted as well as the ins key.
        assert gw.http.post("/aigw/v1/register-instance", json=d.registration()).status_code == 401
        assert gw.signed("POST", "/aigw/v1/register-instance", json=d.registration()).status_code == 200


def test_new_version_keeps_the_leased_previous_version_loaded_until_its_task_stops(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm)) as gw:
        client = agent(gw)
        gw.start_service()
        v1_path = activate_v1(gw, client)
        old = start_task(gw, "on-v1")

        run = train(gw, client, "train-v2")

        assert (run["status"], run["lora_name"]) == ("succeeded", "tiny:v2"), run
        v2_path = run["lora_path"]
        for v in vllm:
            assert v.loaded_paths == {"tiny:v1": v1_path, "tiny:v2": v2_path}
            assert unloads(v, "tiny:v1") == 0
        assert lora_status(gw)["active_lora"] == {"lora_name": "tiny:v2", "lora_path": v2_path}
        new = start_task(gw, "on-v2")
        assert new["policy_model"] == "tiny:v2"
        for session, model in (("on-v1", "tiny:v1"), ("on-v2", "tiny:v2")):
            mark = marks(vllm)
            chat(client, session)
            assert [body["model"] for _, body in chats_since(vllm, mark)] == [model]

        stop_task(gw, old["rl_task_id"])

        for v in vllm:
            assert v.loaded_paths == {"tiny:v2": v2_path}
            assert unloads(v, "tiny:v1") == 1
