"""Issue 37, through the real gateway process: a lineage's adapter is its own, paging cannot be starved, loads
spread and avoid a failing instance, the instance key cannot rewrite another instance's capacity, and label slots
are ranked only by traffic its Task admits. Against strict fake vLLM instances (a load past `max_loras` is refused)
and the fake RL child (tests/support/fake_rl_child.py), which answers Task starts and capture hooks and hands the
test its bearer token, so that versions are activated through the internal route as the RL Service does."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import HmacAuth
from openjiuwen.agent_evolving.agent_rl.common.signing_keys import SigningKey
from tests.support.fake_vllm import CHAT_PATH, LOAD_PATH, FakeVLLM
from tests.support.gateway_process import API_KEY, INS_KEY, LOOPBACK_REGISTRATION, GatewayProcess, write_key_file
from tests.support.waiting import wait_for

pytestmark = pytest.mark.system

CHILD = Path(__file__).resolve().parents[1] / "support" / "fake_rl_child.py"


def gateway(tmp_path: Path, redis_url: str, instances: list[FakeVLLM], *, lora: dict[str, Any] | None = None,
            extra: dict[str, Any] | None = None, limits: dict[str, list[str]] | None = None) -> GatewayProcess:
    """A gateway whose RL child is the fake; `limits`: agent key id → its `lineages`."""
    gw = GatewayProcess(tmp_path, redis_url, instances=instances, lora_overrides=lora, extra_config=extra,
                        online_overrides={"command": [sys.executable, str(CHILD)]})
    gw.env.update(FAKE_CHILD_PORT=str(gw.rl_port), FAKE_CHILD_OUT=str(tmp_path / "calls.jsonl"),
                  FAKE_CHILD_TOKEN=str(tmp_path / "token"))
    limits = limits or {}
    write_key_file(gw.key_file, {
        "apiHmacKey": API_KEY.decode(), "insHmacKey": INS_KEY.decode(),
        "agentHmacKeys": [{"id": key_id, "key": key.hex(), **({"lineages": limits[key_id]} if key_id in limits
                                                               else {})}
                          for key_id, key in gw.agent_keys.items()]})
    return gw


def activate(gw: GatewayProcess, tmp_path: Path, lineage: str, version: int = 1) -> str:
    """The lineage's version activated through the internal route, as the RL Service's runs do."""
    default = lineage == "default"
    path = gw.lora_root / "tiny" / (f"v{version}" if default else f"lineages/{lineage}/v{version}")
    path.mkdir(parents=True, exist_ok=True)
    line = "tiny" if default else f"tiny:{lineage}"
    token = (tmp_path / "token").read_text()
    r = gw.http.post("/internal/v1/rl/loras/activate", headers={"Authorization": f"Bearer {token}"}, json={
        "base_model": "/models/tiny", "lora_name": f"{line}:v{version}", "lora_path": str(path),
        "expected_lora_name": "base" if version == 1 else f"{line}:v{version - 1}"})
    assert r.status_code == 200, r.text
    return f"{line}:v{version}"


def body(model: str, *, stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": f"hello {model}"}]}


def start_task(gw: GatewayProcess, lineage: str, session: str) -> str:
    return started(gw, lineage, session)["policy_lora_name"]


def started(gw: GatewayProcess, lineage: str, session: str) -> dict[str, Any]:
    r = gw.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": "terminal", "lineage": lineage},
                  headers={"X-Agent-Session-Id": session})
    assert r.status_code == 201, r.text
    return r.json()


def task_chat(gw: GatewayProcess, session: str) -> httpx.Response:
    return gw.http.post(CHAT_PATH, json=body("tiny"), headers={"X-Agent-Session-Id": session})


def error_of(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def chat_models(*vllms: FakeVLLM) -> list[str]:
    return [r.body["model"] for v in vllms for r in v.requests if r.path == CHAT_PATH]


# ---------------------------------------------------------------------------------------------------- item 1


def test_a_lineages_versions_are_served_outside_a_task_only_to_callers_it_allows(tmp_path, redis_url) -> None:
    """Before the fix `tiny:alpha:v1` answered 200 to anyone, and `tiny:nosuch:v1` 404: line names and version
    numbers could be probed. Now a caller who may not use alpha gets exactly the unknown model's answer."""
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, \
            gateway(tmp_path, redis_url, [vllm], lora={"openLineages": ["faq"]},
                    limits={"agent-a": ["alpha"], "agent-b": ["beta"]}) as gw:
        gw.start_service()
        alpha, faq, default_v1 = (activate(gw, tmp_path, x) for x in ("alpha", "faq", "default"))
        mark = len(vllm.requests)

        def refusal(r: httpx.Response, model: str) -> tuple[int, str, str, str]:
            error = r.json()["error"]
            return r.status_code, r.headers["content-type"], error["code"], error["message"].replace(model, "M")

        expected = refusal(gw.http.post(CHAT_PATH, json=body("tiny:nosuch:v1")), "tiny:nosuch:v1")
        assert expected[:3] == (404, "application/json", "model_not_found")
        probes = [  # every way of naming alpha's versions without being allowed: the unknown model's answer
            ("anyone", alpha, {}),
            ("anyone, another version", "tiny:alpha:v2", {}),
            ("another lineage's key", alpha, {"agent": "agent-b"}),
            ("the instance key", alpha, {"key": INS_KEY}),
            ("a signature by no key of the gateway", alpha, {"key": b"f" * 32}),
            ("a signed unknown lineage", "tiny:nosuch:v1", {"agent": "agent-b"}),
        ]
        for who, model, signing in probes:
            r = gw.signed("POST", CHAT_PATH, json=body(model), **signing) if signing else \
                gw.http.post(CHAT_PATH, json=body(model))
            assert refusal(r, model) == expected, (who, r.text)
        assert vllm.requests[mark:] == []  # refused in the gateway: nothing reached vLLM (no load, no chat)

        # Allowed: alpha's own agent key (the OpenAI SDK signing each request), the operator; anyone for an
        # open lineage, the default line's active version and the base model (the AIGW behaviour).
        signed_sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, http_client=httpx.Client(
            auth=HmacAuth(SigningKey(gw.agent_keys["agent-a"], "agent-a"))))
        out = signed_sdk.chat.completions.create(model=alpha, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
        assert out.choices[0].message.content
        assert gw.signed("POST", CHAT_PATH, json=body(alpha)).status_code == 200
        for model in (faq, default_v1, "tiny"):
            assert gw.http.post(CHAT_PATH, json=body(model)).status_code == 200, model
        assert chat_models(vllm)[-5:] == [alpha, alpha, faq, default_v1, "tiny"]
        # An allowed caller still gets the active version only.
        assert refusal(gw.signed("POST", CHAT_PATH, json=body("tiny:alpha:v2"), agent="agent-a"),
                       "tiny:alpha:v2") == expected


# ---------------------------------------------------------------------------------------------------- item 2


def test_requests_outside_tasks_cannot_hold_every_slot_a_task_needs(tmp_path, redis_url) -> None:
    """Two slow streams outside a Task, on alpha and beta, held both slots of the one paging instance and a gamma
    Task got 503 `lora_capacity_exhausted` after the page timeout. Now they keep at most capacity − 1 slots."""
    with FakeVLLM(served_model="tiny", name="vllm-a", max_loras=2) as vllm, \
            gateway(tmp_path, redis_url, [vllm], lora={"maxLorasPerInstance": 2, "pageTimeout": "2s",
                                                       "openLineages": ["alpha", "beta"]}) as gw:
        gw.start_service()
        alpha, beta, gamma = (activate(gw, tmp_path, x) for x in ("alpha", "beta", "gamma"))
        vllm.stream_chunk_delay_s = 0.5  # every stream: about 6 s for 12 tokens, far past the page timeout
        with ThreadPoolExecutor(max_workers=2) as pool:
            slow_alpha = pool.submit(gw.http.post, CHAT_PATH, json=body(alpha, stream=True, max_tokens=12))
            wait_for(lambda: alpha in chat_models(vllm), timeout_s=10)
            slow_beta = pool.submit(gw.http.post, CHAT_PATH, json=body(beta, stream=True, max_tokens=12))
            assert start_task(gw, "gamma", "s-gamma") == gamma
            started = time.monotonic()
            served = task_chat(gw, "s-gamma")
            assert served.status_code == 200, served.text
            assert time.monotonic() - started < 2.0  # no wait for a slot: one is the Tasks'
            assert chat_models(vllm)[-1] == gamma
            # beta's stream waited for the slot alpha's stream keeps, then gave up, as a full instance answers.
            assert error_of(slow_beta.result()) == (503, "lora_capacity_exhausted")
            assert slow_alpha.result().status_code == 200
        assert vllm.peak_loaded == 2


# ---------------------------------------------------------------------------------------------------- item 3


def test_first_loads_of_two_lineages_spread_over_two_one_slot_instances(tmp_path, redis_url) -> None:
    """Both Tasks' first requests went to the same instance (the request counted only after its page-in, the
    round-robin turn kept per version), and the second waited there for the first's slot: 503."""
    with FakeVLLM(served_model="tiny", name="vllm-a", max_loras=1) as a, \
            FakeVLLM(served_model="tiny", name="vllm-b", max_loras=1) as b, \
            gateway(tmp_path, redis_url, [a, b], lora={"maxLorasPerInstance": 1, "pageTimeout": "2s"}) as gw:
        gw.start_service()
        alpha, beta, gamma = (activate(gw, tmp_path, x) for x in ("alpha", "beta", "gamma"))
        assert a.loaded == b.loaded == {gamma}  # alpha and beta are paged out everywhere
        assert [start_task(gw, x, f"s-{x}") for x in ("alpha", "beta")] == [alpha, beta]
        for v in (a, b):
            v.delay_next(LOAD_PATH, 0.5)  # the first page-in is still loading when the second request is routed
            v.delay_next(CHAT_PATH, 3.0)  # and each request keeps its slot past the page timeout
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(task_chat, gw, "s-alpha")
            wait_for(lambda: a.count(LOAD_PATH) + b.count(LOAD_PATH) > 3, timeout_s=10)  # alpha's load is out
            second = pool.submit(task_chat, gw, "s-beta")
            answers = [first.result(), second.result()]
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        assert {tuple(chat_models(v)) for v in (a, b)} == {(alpha,), (beta,)}  # one on each instance


# ---------------------------------------------------------------------------------------------------- item 4


def test_an_instance_whose_loads_fail_does_not_attract_the_page_ins(tmp_path, redis_url) -> None:
    """A registered instance answering every load with 500 had nothing in flight, so it stayed the least busy and
    every on-demand load went there: 502 `lora_load_failed`. Now a failed page-in is tried once on another instance
    and the failing one is left last for a backoff."""
    with FakeVLLM(served_model="tiny", name="vllm-a", max_loras=2) as a, \
            FakeVLLM(served_model="tiny", name="rogue") as rogue, \
            gateway(tmp_path, redis_url, [a], lora={"maxLorasPerInstance": 2}, extra=LOOPBACK_REGISTRATION) as gw:
        gw.start_service()
        rogue.fail_loads = True
        r = gw.signed("POST", "/aigw/v1/register-instance", json={**rogue.registration(), "maxLoras": 2},
                      key=INS_KEY)
        assert r.json()["serving"] is True, r.text
        names = [activate(gw, tmp_path, f"l{n}") for n in range(4)]  # a holds l2, l3; l0, l1 paged out
        assert a.loaded == set(names[2:]) and rogue.loaded == set()
        assert [start_task(gw, f"l{n}", f"s{n}") for n in range(3)] == names[:3]
        a.stream_chunk_delay_s = 0.3
        with ThreadPoolExecutor(max_workers=1) as pool:  # l0's slow stream keeps one request in flight on a
            busy = pool.submit(gw.http.post, CHAT_PATH, json={**body("tiny", stream=True, max_tokens=8)},
                               headers={"X-Agent-Session-Id": "s0"})
            wait_for(lambda: names[0] in chat_models(a), timeout_s=10)
            answers = [task_chat(gw, "s1"), task_chat(gw, "s2")]  # the rogue is the least busy for both
            assert busy.result().status_code == 200
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        assert chat_models(a)[-2:] == names[1:3] and chat_models(rogue) == []
        assert rogue.count(LOAD_PATH) == 1 + 4  # one failed page-in (then a backoff), and the four activations


# ---------------------------------------------------------------------------------------------------- item 5


def test_the_instance_key_cannot_rewrite_another_instances_capacity(tmp_path, redis_url) -> None:
    """A re-registration of r1 at another address was refused (409) but set r1's `maxLoras` anyway (from 8 to 1,
    then 0: paging off). Now the capacity is stored only when a new name is admitted."""
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="r1") as r1, \
            FakeVLLM(served_model="tiny", name="rogue") as rogue, \
            gateway(tmp_path, redis_url, [a], extra=LOOPBACK_REGISTRATION) as gw:
        gw.start_service()

        def register(fake: FakeVLLM, max_loras: int) -> httpx.Response:
            return gw.signed("POST", "/aigw/v1/register-instance", key=INS_KEY,
                             json={**fake.registration(), "name": "r1", "maxLoras": max_loras})

        assert register(r1, 2).status_code == 200
        assert error_of(register(rogue, 1)) == (409, "instance_conflict")
        assert register(r1, 1).status_code == 200  # a repeat keeps the capacity its name was admitted with
        names = [activate(gw, tmp_path, x) for x in ("alpha", "beta")]
        assert r1.loaded == set(names)  # two adapters: its capacity is still 2 (1 would have paged alpha out)
        assert a.loaded == set(names)


# ---------------------------------------------------------------------------------------------------- item 7


def test_requests_its_capture_secret_refuses_never_rank_a_lineage_for_a_label(tmp_path, redis_url) -> None:
    """The lineage label ranked captured requests before the capture-secret check: anyone who knew a session id
    could make its lineage take a label slot with requests the Task refused."""
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, \
            gateway(tmp_path, redis_url, [vllm], extra={"metrics": {"lineageLabelTopK": 1}}) as gw:
        gw.start_service()
        r = gw.signed("POST", "/v1/rl/tasks/start", headers={"X-Agent-Session-Id": "s1"},
                      json={"reward_mode": "terminal", "lineage": "junk", "capture_secret": True})
        assert r.status_code == 201, r.text
        for _ in range(12):
            assert error_of(task_chat(gw, "s1")) == (403, "capture_secret_required")
        assert 'lineage="junk"' not in gw.http.get("/metrics").text
        secret = r.json()["capture_secret"]
        for _ in range(10):  # the Task's own traffic ranks it
            r = gw.http.post(CHAT_PATH, json=body("tiny"),
                             headers={"X-Agent-Session-Id": "s1", "X-Agent-Capture-Secret": secret})
            assert r.status_code == 200, r.text
        assert 'gw_lineage_requests_total{captured="true",lineage="junk"} 1.0' in gw.http.get("/metrics").text


# ---------------------------------------------------------------------------------------------------- leases


def test_tasks_pinned_past_the_lease_cap_are_stopped_and_their_versions_unloaded(tmp_path, redis_url) -> None:
    """Suspected in issue 37, proven: a static instance keeps every leased version loaded, and Tasks never expire,
    so one key holding a Task per version kept every version of a line on every instance (enough of them fill
    vLLM's slots and fail other lines' activations). Now a line's Tasks keep at most `maxLeasedVersionsPerLine`
    versions besides what the line serves; the Tasks pinned to older ones are stopped."""
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm, \
            gateway(tmp_path, redis_url, [vllm], lora={"maxLeasedVersionsPerLine": 1}) as gw:
        gw.start_service()
        tasks = []
        for version in (1, 2, 3):
            activate(gw, tmp_path, "alpha", version)
            tasks.append(started(gw, "alpha", f"s{version}"))
        assert [t["policy_lora_name"] for t in tasks] == ["tiny:alpha:v1", "tiny:alpha:v2", "tiny:alpha:v3"]
        # v1 and v2 are leased only; the cap keeps one of them: v1's Task is stopped, v1 unloaded.
        wait_for(lambda: "tiny:alpha:v1" not in vllm.loaded, timeout_s=10, what="v1 unloaded")
        assert vllm.loaded == {"tiny:alpha:v2", "tiny:alpha:v3"}
        stops = [c["path"] for c in child_calls(tmp_path) if c["path"].endswith("/stop")]
        assert stops == [f"/v1/rl/tasks/{tasks[0]['rl_task_id']}/stop"]
        token = (tmp_path / "token").read_text()
        leases = gw.http.get("/internal/v1/rl/canary/tiny:alpha", headers={"Authorization": f"Bearer {token}"})
        leases = leases.json()["leases"]
        assert leases == {"tiny:alpha:v2": 1, "tiny:alpha:v3": 1}
        # The stopped Task's session is no longer captured; the others still are.
        assert task_chat(gw, "s2").status_code == 200 and chat_models(vllm)[-1] == "tiny:alpha:v2"


def child_calls(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
