"""Deeply nested JSON is a client mistake on every JSON route of both processes (issue 28 item 8).

orjson reads up to 1024 levels but writes at most 254. A body nested a little less than that was read and then
failed where it was written again one level deeper (the gateway's hook body, the RL Service's stored request) as a
500 with a traceback in the log: a chat request on a Task's session at 254 levels, a bypass one at 255, a `:before`
at 250. Now every body deeper than 128 levels is 400 `invalid_request` naming the nesting, wherever the depth sits
(a message's content, metadata, a proxied control body), and nothing is logged as an unhandled error. Both processes
run as real processes; a body exactly 128 levels deep is still served.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import load_fixture
from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import RequestSigner
from tests.support.fake_judge import FakeJudge
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.service_app import start_headers
from tests.support.service_process import ServiceProcess

pytestmark = pytest.mark.system

CHAT = "/v1/chat/completions"
SESSION = "X-Agent-Session-Id"
HOLE = "@@deep@@"
REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")
# 250: read by orjson, failed when written one level deeper (the window the old code answered 500 in); 260: past
# orjson's writer; 1100: past orjson's reader.
DEPTHS = (250, 260, 1100)
TOO_DEEP = re.compile(r"JSON nested deeper than 12[89] levels")  # 129 for a hook body: its request is one level down


def with_deep(body: Any, depth: int) -> bytes:
    """`body` as JSON with its HOLE string replaced by `depth` nested lists (built as bytes: no encoder writes them)."""
    return json.dumps(body).replace(f'"{HOLE}"', "[" * depth + '"x"' + "]" * depth).encode()


def assert_too_deep(r: httpx.Response, what: str) -> None:
    assert r.status_code == 400, (what, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and TOO_DEEP.search(error["message"]), (what, error)


def signed_raw(gw: GatewayProcess, path: str, body: bytes, **headers: str) -> httpx.Response:
    request = gw.http.build_request("POST", path, content=body,
                                    headers={"content-type": "application/json", **headers})
    return gw.http.send(RequestSigner(gw.api_key).sign_httpx(request))


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "z": HOLE}]}], **extra}


def anthropic_body() -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "use the tool"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": HOLE}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
    ]}


# ------------------------------------------------------------------------------------------------ the gateway


@pytest.fixture(scope="module")
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny") as v:
        yield v


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_url: str, vllm: FakeVLLM) -> Iterator[GatewayProcess]:
    with GatewayProcess(tmp_path_factory.mktemp("nesting-gw"), redis_url, instances=[vllm]) as gw:
        gw.start_service()
        yield gw


def test_the_gateway_refuses_deep_bodies_with_and_without_a_task(gateway: GatewayProcess, redis) -> None:
    gw = gateway
    assert gw.start_task("s-deep").status_code == 201
    post = gw.http.post
    json_type = {"content-type": "application/json"}
    for depth in DEPTHS:
        for session in ({}, {SESSION: "s-deep"}):
            where = f"depth {depth}, {'captured' if session else 'bypass'}"
            for stream in (False, True):
                r = post(CHAT, content=with_deep(chat_body(stream=stream), depth), headers={**json_type, **session})
                assert_too_deep(r, f"chat stream={stream}, {where}")
            r = post("/v1/messages", content=with_deep(anthropic_body(), depth), headers={**json_type, **session})
            assert_too_deep(r, f"messages, {where}")
        # Signed routes the gateway reads itself, and one it proxies to the RL Service.
        body = {"reward_mode": "terminal", "capture_secret": True, "x": HOLE}
        r = signed_raw(gw, "/v1/rl/tasks/start", with_deep(body, depth), **{SESSION: "s-other"})
        assert_too_deep(r, f"task start with a capture secret, depth {depth}")
        body = {"name": "deep", "model": "tiny", "instanceIp": "127.0.0.1", "port": 1, "role": HOLE}
        assert_too_deep(signed_raw(gw, "/aigw/v1/register-instance", with_deep(body, depth)), "registration")
        r = signed_raw(gw, "/v1/rl/trajectories/rewards", with_deep({"rewards": HOLE}, depth))
        assert_too_deep(r, f"proxied reward batch, depth {depth}")
    # 128 levels are served, captured and committed: 5 levels of body, content and part, then 123 lists.
    r = post(CHAT, content=with_deep(chat_body(), 123), headers={**json_type, SESSION: "s-deep"})
    assert r.status_code == 200, r.text[:300]
    r = post(CHAT, content=with_deep(chat_body(), 124), headers={**json_type, SESSION: "s-deep"})
    assert_too_deep(r, "129 levels")
    t = gw.signed("GET", "/v1/rl/tasks?status=active").json()["items"][0]["rl_task_id"]
    stopped = gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()
    assert stopped["status"] == "finalized", stopped
    assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0}).json() == {"sample_count": 1}
    assert "unhandled error" not in gw.stderr() and "Traceback" not in gw.stderr(), gw.stderr()[-3000:]
    assert "unhandled error" not in gw.rl_log(), gw.rl_log()[-3000:]


def test_a_vllm_answer_too_deep_to_relay_is_a_502_not_a_500(gateway: GatewayProcess, vllm: FakeVLLM, redis) -> None:
    """A rogue instance's answer nested 300 levels: orjson reads it, but the client's view cannot be written."""
    gw = gateway
    answer = json.loads(json.dumps(RESPONSE))
    answer["choices"][0]["message"]["tool_calls"] = [
        {"id": HOLE, "type": "function", "function": {"name": "f", "arguments": "{}"}}]  # survives both views
    deep_answer = with_deep(answer, 300)
    for path, body in ((CHAT, {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/messages", {"model": "tiny", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hi"}]})):
        vllm.fail_next(CHAT, 200, body=deep_answer, content_type="application/json")
        r = gw.http.post(path, json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_invalid"), (path, r.text[:300])
    # In a stream the chunk is refused when read: the stream ends without its end marker, as any broken stream.
    chunk = with_deep({"id": "c", "object": "chat.completion.chunk", "model": "tiny", "system_fingerprint": HOLE,
                       "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}, 300)
    vllm.fail_next(CHAT, 200, body=b"data: " + chunk + b"\n\ndata: [DONE]\n\n", content_type="text/event-stream")
    r = gw.http.post(CHAT, json={"model": "tiny", "max_tokens": 4, "stream": True,
                                 "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "[DONE]" not in r.text, r.text[:300]
    assert "unhandled error" not in gw.stderr() and "Traceback" not in gw.stderr(), gw.stderr()[-3000:]


# ------------------------------------------------------------------------------------------- the RL Service


@pytest.fixture(scope="module")
def service(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with FakeJudge() as judge, ServiceProcess(
        tmp_path_factory.mktemp("nesting-rl"), redis_url, judge_endpoint=judge.url, judge_model="judge",
        judge_retries=0,
    ) as svc:
        yield svc


def rl_bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every JSON route of the RL Service, each body valid but for one deep value."""
    sample = {"messages": [{"role": "user", "content": "q"}], "prompt_ids": [1, 2], "response_tokens": [3],
              "logprobs": [-0.5], "response": {"content": "a", "finish_reason": "stop"}, "step_index": 0}
    hook = {"rl_task_id": "t1", "capture_id": "c1", "agent_turn_id": None}
    deep_request = dict(REQUEST, messages=[*REQUEST["messages"], {"role": "user", "content": HOLE}])
    return {
        "task start": ("/v1/rl/tasks/start", {"reward_mode": "terminal", "x": HOLE}),
        "before, message content": ("/internal/v1/completions:before", {**hook, "request": deep_request}),
        "before, request metadata": ("/internal/v1/completions:before",
                                     {**hook, "request": dict(REQUEST, metadata={"m": HOLE})}),
        "after, response": ("/internal/v1/completions:after",
                            {**hook, "request": REQUEST, "response": dict(RESPONSE, system_fingerprint=HOLE)}),
        "discard": ("/internal/v1/completions:discard", {**hook, "x": HOLE}),
        "terminal reward": ("/v1/rl/tasks/t1/reward", {"reward": HOLE}),
        "finish": ("/internal/v1/rl/tasks/t1:finish", {"reason": HOLE}),
        "abort": ("/internal/v1/rl/tasks/t1:abort", {"reason": HOLE}),
        "training run": ("/v1/rl/training/runs", {"x": HOLE}),
        "sample reward": ("/v1/rl/trajectories/x/rewards", {"source": "a", "score": HOLE}),
        "sample rewards": ("/v1/rl/trajectories/rewards", {"rewards": HOLE}),
        "rollout promote": ("/v1/rl/rollout/promote", {"x": HOLE}),
        "activation": ("/v1/rl/loras/activate", {"lora_name": HOLE}),
        "rail, trajectory meta": ("/v1/gateway/upload/batch", {
            "protocol_version": "rail-v1", "session_id": "rs1", "trajectory_id": "rt1", "samples": [sample],
            "session_done": True, "trajectory_meta": {"x": HOLE}}),
        "rail, message content": ("/v1/gateway/upload/batch", {
            "protocol_version": "rail-v1", "session_id": "rs1", "trajectory_id": "rt1", "session_done": True,
            "samples": [dict(sample, messages=[{"role": "user", "content": [{"type": "text", "text": HOLE}]}])]}),
    }


def test_the_rl_service_refuses_deep_bodies_on_every_json_route(service: ServiceProcess, redis) -> None:
    with httpx.Client(base_url=service.url, timeout=30, headers={"content-type": "application/json"}) as c:
        assert c.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                      headers=start_headers("s1", "t1")).status_code == 201
        for depth in DEPTHS:
            for name, (path, body) in rl_bodies().items():
                headers = start_headers("s2", "t2") if path == "/v1/rl/tasks/start" else {}
                assert_too_deep(c.post(path, content=with_deep(body, depth), headers=headers), f"{name}, {depth}")
        # A hook carries the request one level down: a request of 129 levels is refused, one of 128 (the most a
        # gateway forwards) is captured and committed, and the Task was untouched by all the refusals.
        hook = {"rl_task_id": "t1", "capture_id": "c9", "agent_turn_id": None}
        r = c.post("/internal/v1/completions:before", content=with_deep(
            {**hook, "request": dict(REQUEST, metadata=HOLE)}, 128))
        assert_too_deep(r, "a request of 129 levels")
        before = c.post("/internal/v1/completions:before", content=with_deep(
            {**hook, "request": dict(REQUEST, metadata=HOLE)}, 127))
        assert before.status_code == 200, before.text[:300]
        after = c.post("/internal/v1/completions:after", content=with_deep(
            {**hook, "response": RESPONSE, "request": dict(before.json()["request"], metadata=HOLE)}, 127))
        assert after.status_code == 204, after.text[:300]
        assert c.post("/v1/rl/tasks/t1/stop").json()["status"] == "finalized"
    assert "unhandled error" not in service.log(), service.log()[-3000:]
