"""The gateway's capture path with real processes (CONTRACT §3.2–§3.7, §9 "Gateway (system, real processes)").

Each test starts the reference gateway, its RL Service child and a fake vLLM (and a fake Judge where the reward mode
is delayed feedback), drives it as an agent would (official `openai` / `anthropic` SDKs, or raw httpx where the exact
bytes matter), and checks what the client got, what the upstream received, and the Task and samples as read back
through the signed control API.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import anthropic
import httpx
import openai
import orjson
import pytest
from redis import Redis as SyncRedis

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import sign_request
from tests.support.fake_judge import FakeJudge, Hold, Status
from tests.support.fake_vllm import FakeVLLM, Reply, ToolCall, completion_tokens, prompt_token_ids
from tests.support.gateway_process import API_KEY, INS_KEY, GatewayProcess

pytestmark = pytest.mark.system

T = TypeVar("T")

CHAT = "/v1/chat/completions"
SESSION = "X-Agent-Session-Id"
TURN = "X-Agent-Turn-Id"
WAIT_S = 10.0
CLIENT_TIMEOUT_S = 30.0
WEATHER_TOOL_OPENAI = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather of a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}
WEATHER_TOOL_ANTHROPIC = {
    "name": "get_weather", "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PRIVATE_OPENAI = {"prompt_token_ids", "prompt_logprobs", "prompt_text", "rl_lora", "token_ids", "logprobs"}
PRIVATE_ANTHROPIC = PRIVATE_OPENAI | {"total_tokens"}


# ------------------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as v:
        yield v


@contextmanager
def running_gateway(tmp_path: Any, redis_url: str, vllm: FakeVLLM, **kwargs: Any) -> Iterator[GatewayProcess]:
    """A gateway over `vllm` with its RL Service child started."""
    with GatewayProcess(tmp_path, redis_url, instances=[vllm], **kwargs) as gw:
        gw.start_service()
        yield gw


def openai_client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def anthropic_client(gw: GatewayProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def error_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def eventually(check: Callable[[], T], what: str, timeout_s: float = WAIT_S) -> T:
    """Re-check `check` until it returns something truthy (for effects the gateway applies in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def assert_nothing_in_flight(gw: GatewayProcess) -> None:
    """Every answer ended, a broken or abandoned stream included: no instance still counts a request."""
    eventually(lambda: all(i["inflight"] == 0 for i in gw.signed("GET", "/aigw/v1/instances").json()["items"]),
               "no request in flight")


def start_task(gw: GatewayProcess, session: str, mode: str = "terminal") -> str:
    r = gw.start_task(session, mode)
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "active" and r.json()["reward_mode"] == mode
    return r.json()["rl_task_id"]


def task_record(gw: GatewayProcess, t: str) -> dict[str, Any]:
    r = gw.signed("GET", f"/v1/rl/tasks/{t}")
    assert r.status_code == 200, r.text
    return r.json()


def ended(gw: GatewayProcess, t: str) -> tuple[str, str | None]:
    """(status, finish_reason) once the Task is terminal (an abort may still be on its way from the gateway)."""
    record = eventually(lambda: (rec := task_record(gw, t))["status"] != "active" and rec, f"task {t} terminal")
    return record["status"], record["finish_reason"]


def capture_sets(redis_url: str, t: str) -> dict[str, int]:
    """Sizes of the Task's capture sets in Redis (CONTRACT §5.2): every capture, the open ones, the committed ones."""
    prefix = f"rl:v1:task:{t}:captures"
    with SyncRedis.from_url(redis_url) as sync:
        return {name: sync.scard(key) for name, key in
                (("all", prefix), ("open", prefix + ":open"), ("committed", prefix + ":committed"))}


def stats(gw: GatewayProcess) -> dict[str, Any]:
    r = gw.signed("GET", "/v1/rl/trajectories/stats")
    assert r.status_code == 200, r.text
    return r.json()


def samples(gw: GatewayProcess) -> list[dict[str, Any]]:
    """Every sample's detail view, found through the list route."""
    listing = gw.signed("GET", "/v1/rl/trajectories", params={"limit": 100})
    assert listing.status_code == 200, listing.text
    assert listing.json()["next_cursor"] is None
    out = []
    for item in listing.json()["items"]:
        r = gw.signed("GET", f"/v1/rl/trajectories/{item['trajectory_id']}")
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


def keys_in(obj: Any) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in keys_in(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in keys_in(v)}
    return set()


def chat_bodies(vllm: FakeVLLM) -> list[dict[str, Any]]:
    return [r.body for r in vllm.requests if r.path == CHAT]


def assert_bypassed(gw: GatewayProcess, vllm: FakeVLLM, session: str) -> None:
    """A call with `session` goes straight to vLLM: 200, and the upstream saw the client's request unchanged."""
    before = len(chat_bodies(vllm))
    r = gw.http.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "bypass?"}],
                                 "max_tokens": 4}, headers={SESSION: session})
    assert r.status_code == 200, r.text
    bodies = chat_bodies(vllm)
    assert len(bodies) == before + 1
    assert bodies[-1] == {"model": "tiny", "messages": [{"role": "user", "content": "bypass?"}], "max_tokens": 4}


def stream_openai(client: openai.OpenAI, messages: list[dict[str, Any]], headers: dict[str, str]) -> dict[str, Any]:
    """One streamed completion reassembled as an agent would: text, tool calls by index, finish reason."""
    stream = client.chat.completions.create(model="agent-model", messages=messages, tools=[WEATHER_TOOL_OPENAI],
                                            max_tokens=64, stream=True, extra_headers=headers)
    text, calls, finish, seen = "", {}, None, set()
    for chunk in stream:
        seen |= keys_in(chunk.model_dump(exclude_unset=True))
        assert chunk.model == "agent-model"
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                parts = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                parts["id"] = call.id or parts["id"]
                if call.function is not None:
                    parts["name"] = call.function.name or parts["name"]
                    parts["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert seen.isdisjoint(PRIVATE_OPENAI), seen & PRIVATE_OPENAI
    assert "usage" not in seen  # the usage chunk goes to the client only when it asked for it
    return {"text": text, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def feedback_judge(tag: str) -> dict[str, Any]:
    """The `judge` field the default FakeJudge verdict (overall 8) gives a sample."""
    return {"score": 0.8, "source": "judge", "tag": tag, "votes": [8.0], "judge_model": "judge",
            "prompt_version": "judge-v1"}


def feedback_in(prompt: str) -> str:
    return prompt.split("<user_feedback>\n", 1)[1].split("\n</user_feedback>", 1)[0]


# ------------------------------------------------------------------------------------------------------ 1. HMAC


def test_hmac_refuses_unsigned_forged_stale_and_replayed_control_calls(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        http = gw.http

        def now() -> int:
            return int(time.time() * 1000)

        def v2(key: bytes, method: str, target: str, body: bytes = b"", at: int | None = None) -> dict[str, str]:
            return sign_request(key, method, target, body, now_ms=now() if at is None else at)

        def refused(r: httpx.Response) -> None:
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_signature"

        refused(http.get("/v1/rl/service"))  # unsigned
        refused(http.get("/v1/rl/service", headers={"X-Timestamp": str(now())}))  # no signature
        refused(http.get("/v1/rl/service", headers={"X-Timestamp": str(now()), "X-Signature": "ab" * 32}))  # forged
        refused(http.get("/v1/rl/service", headers=v2(b"w" * 32, "GET", "/v1/rl/service")))  # wrong key
        refused(http.get("/v1/rl/service", headers=v2(INS_KEY, "GET", "/v1/rl/service")))  # ins key off its route
        for skew_ms in (-301_000, 301_000):  # outside the ±300 s window
            refused(http.get("/v1/rl/service", headers=v2(API_KEY, "GET", "/v1/rl/service", at=now() + skew_ms)))
        # The body is signed: a signature over another body is refused, and nothing happens.
        signed_body = orjson.dumps({"reward_mode": "terminal"})
        refused(http.post("/v1/rl/service/start", content=b"{}",
                          headers={**v2(API_KEY, "POST", "/v1/rl/service/start", signed_body),
                                   "content-type": "application/json"}))
        refused(http.post("/v1/rl/service/start", headers=v2(INS_KEY, "POST", "/v1/rl/service/start")))
        assert gw.signed("GET", "/v1/rl/service").json() == {"status": "stopped", "failure_reason": None}

        # A valid pair is accepted once; the same (timestamp, signature) again is a replay, on any path. (An
        # offset no other call of this test used, so the first use is surely the first.)
        headers = v2(API_KEY, "GET", "/v1/rl/service", at=now() - 12_345)
        assert http.get("/v1/rl/service", headers=headers).status_code == 200
        refused(http.get("/v1/rl/service", headers=headers))
        refused(http.get("/v1/rl/trajectories/stats", headers=headers))
        # Inside the window is fine.
        inside = v2(API_KEY, "GET", "/v1/rl/service", at=now() - 290_000)
        assert http.get("/v1/rl/service", headers=inside).status_code == 200

        # register-instance accepts the ins key (and the api key), nothing else.
        registration = orjson.dumps(vllm.registration())
        for key in (INS_KEY, API_KEY):
            r = http.post("/aigw/v1/register-instance", content=registration,
                          headers={**v2(key, "POST", "/aigw/v1/register-instance", registration),
                                   "content-type": "application/json"})
            assert (r.status_code, r.json()) == (200, {"status": "registered", "name": "vllm-a", "serving": True}), r.text
        refused(http.post("/aigw/v1/register-instance", content=registration,
                          headers={**v2(b"w" * 32, "POST", "/aigw/v1/register-instance", registration),
                                   "content-type": "application/json"}))

        # Health and inference need no signature.
        assert http.get("/aigw/v1/health").json() == {"status": "ok", "rl_service": "stopped"}
        r = http.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["type"] == "message"


# ------------------------------------------------------------------------------------------------- 2. Anthropic


def test_anthropic_sdk_json_and_stream_are_captured_without_private_fields(redis, redis_url, tmp_path, vllm):
    reply = Reply(content="Let me check.", tool_calls=[ToolCall("get_weather", {"city": "Paris"})])
    vllm.enqueue(reply, reply)
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        t = start_task(gw, "s-anthropic")
        client = anthropic_client(gw)
        ask = dict(model="claude-agent", max_tokens=64, system="Answer briefly.", tools=[WEATHER_TOOL_ANTHROPIC],
                   messages=[{"role": "user", "content": "Weather in Paris?"}],
                   extra_headers={SESSION: "s-anthropic"})

        message = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            streamed_keys = set().union(*(keys_in(e.model_dump(exclude_unset=True)) for e in stream))
            final = stream.get_final_message()
        assert streamed_keys.isdisjoint(PRIVATE_ANTHROPIC), streamed_keys & PRIVATE_ANTHROPIC

        for got in (message, final):
            assert got.model == "claude-agent" and got.stop_reason == "tool_use"
            assert [b.type for b in got.content] == ["text", "tool_use"]
            assert got.content[0].text == "Let me check."
            assert (got.content[1].name, got.content[1].input) == ("get_weather", {"city": "Paris"})
            assert got.content[1].id.startswith("chatcmpl-tool-")
            dumped = got.model_dump(exclude_unset=True)
            assert keys_in(dumped).isdisjoint(PRIVATE_ANTHROPIC), dumped
            assert set(dumped["usage"]) == {"input_tokens", "output_tokens"}
        assert message.usage.output_tokens == final.usage.output_tokens > 0

        # vLLM got the converted request on the pinned model, with the injected flags.
        bodies = chat_bodies(vllm)
        assert len(bodies) == 2
        for body in bodies:
            assert body["model"] == "tiny" and body["return_token_ids"] is True and body["logprobs"] is True
            assert body["messages"] == [{"role": "system", "content": "Answer briefly."},
                                        {"role": "user", "content": "Weather in Paris?"}]
            assert body["tools"] == [{"type": "function", "function": {
                "name": "get_weather", "description": "Current weather of a city",
                "parameters": WEATHER_TOOL_ANTHROPIC["input_schema"]}}]
        assert [b.get("stream", False) for b in bodies] == [False, True]

        assert task_record(gw, t)["status"] == "active"
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 0.5}).json() == {"sample_count": 2}
        found = samples(gw)
        assert len(found) == 2
        expected_prompt = prompt_token_ids(bodies[0]["messages"])
        for sample in found:
            assert sample["rl_task_id"] == t and sample["session_id"] == "s-anthropic"
            assert sample["judge"] == {"score": 0.5, "source": "terminal"}
            trajectory = sample["trajectory"]
            assert trajectory["prompt_ids"] == expected_prompt
            assert sample["response"]["prompt_token_ids"] == expected_prompt
            assert len(trajectory["response_ids"]) == len(trajectory["response_logprobs"]) == final.usage.output_tokens
            assert sample["response"]["choices"][0]["token_ids"] == trajectory["response_ids"]
            assert [c["function"] for c in trajectory["tool_calls"]] == [
                {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
        assert sorted(s["request"].get("stream", False) for s in found) == [False, True]


# -------------------------------------------------------------------------------------------- 3. delayed feedback


def test_delayed_feedback_over_openai_sse_with_tool_calls(redis, redis_url, tmp_path, vllm):
    vllm.enqueue(
        Reply(content="Checking.", tool_calls=[ToolCall("get_weather", {"city": "Paris"})]),
        Reply(content="It is sunny in Paris."),
        Reply(content="Rome is cloudy."),
    )
    with FakeJudge() as judge, running_gateway(tmp_path, redis_url, vllm, judge_url=judge.url) as gw:
        t = start_task(gw, "s-df", "delayed_feedback")
        client = openai_client(gw)
        u1 = {SESSION: "s-df", TURN: "u1"}
        history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]

        first = stream_openai(client, history, u1)
        assert first["text"] == "Checking." and first["finish_reason"] == "tool_calls"
        [call] = first["tool_calls"]
        assert (call["name"], orjson.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
        history += [
            {"role": "assistant", "content": first["text"], "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                    "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 24 C"},
        ]
        second = stream_openai(client, history, u1)
        assert (second["text"], second["tool_calls"], second["finish_reason"]) == ("It is sunny in Paris.", [], "stop")
        assert judge.requests == [] and stats(gw)["total"] == 0  # nothing published within the turn

        # Turn 2's first completion publishes turn 1, the new user message being its feedback.
        history += [{"role": "assistant", "content": second["text"]},
                    {"role": "user", "content": "Thanks! And in Rome?"}]
        third = stream_openai(client, history, {SESSION: "s-df", TURN: "u2"})
        assert third["text"] == "Rome is cloudy."
        assert [feedback_in(r.prompt) for r in judge.requests] == ["Thanks! And in Rome?"] * 2
        assert stats(gw)["by_status"]["pending"] == 2

        stopped = gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()
        assert (stopped["status"], stopped["finish_reason"]) == ("finalized", "user_stopped")
        assert [feedback_in(r.prompt) for r in judge.requests] == ["Thanks! And in Rome?"] * 2 + ["(no feedback)"]
        found = sorted(samples(gw), key=lambda s: len(s["request"]["messages"]))
        assert [(s["agent_turn_id"], s["judge"]) for s in found] == [
            ("u1", feedback_judge("feedback")), ("u1", feedback_judge("feedback")),
            ("u2", feedback_judge("session_done"))]
        assert [c["function"]["name"] for c in found[0]["trajectory"]["tool_calls"]] == ["get_weather"]
        for sample, body in zip(found, chat_bodies(vllm)):
            assert sample["trajectory"]["prompt_ids"] == prompt_token_ids(body["messages"])
            assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"] is True
        # The tool call went through the judge prompt, token ids never did.
        assert "get_weather" in judge.requests[0].prompt
        assert all("token_ids" not in r.prompt and "logprob" not in r.prompt for r in judge.requests)


def test_delayed_feedback_over_anthropic_stream(redis, redis_url, tmp_path, vllm):
    vllm.enqueue(Reply(content="Let me look.", tool_calls=[ToolCall("get_weather", {"city": "Oslo"})]),
                 Reply(content="Oslo is cold."))
    with FakeJudge() as judge, running_gateway(tmp_path, redis_url, vllm, judge_url=judge.url) as gw:
        t = start_task(gw, "s-df-anthropic", "delayed_feedback")
        client = anthropic_client(gw)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
        with client.messages.stream(model="claude-agent", max_tokens=64, tools=[WEATHER_TOOL_ANTHROPIC],
                                    messages=messages, extra_headers={SESSION: "s-df-anthropic", TURN: "u1"}) as s:
            first = s.get_final_message()
        tool_use = first.content[-1]
        assert (tool_use.type, tool_use.input) == ("tool_use", {"city": "Oslo"})

        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_unset=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "-5 C"},
                                         {"type": "text", "text": "Thanks! And tomorrow?"}]},
        ]
        with client.messages.stream(model="claude-agent", max_tokens=64, tools=[WEATHER_TOOL_ANTHROPIC],
                                    messages=messages, extra_headers={SESSION: "s-df-anthropic", TURN: "u2"}) as s:
            second = s.get_final_message()
        assert [b.type for b in second.content] == ["text"] and second.content[0].text == "Oslo is cold."
        assert [feedback_in(r.prompt) for r in judge.requests] == ["Thanks! And tomorrow?"]
        # The tool result reached vLLM as a tool message answering the tool call.
        assert chat_bodies(vllm)[1]["messages"][2] == {"role": "tool", "tool_call_id": tool_use.id, "content": "-5 C"}

        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert feedback_in(judge.requests[-1].prompt) == "(no feedback)"
        found = sorted(samples(gw), key=lambda s: s["agent_turn_id"])
        assert [(s["agent_turn_id"], s["judge"]["tag"]) for s in found] == [("u1", "feedback"), ("u2", "session_done")]
        for sample, message in zip(found, (first, second)):
            assert len(sample["trajectory"]["response_ids"]) == message.usage.output_tokens
            assert sample["trajectory"]["prompt_ids"]


# ------------------------------------------------------------------------------- 4. the §3.5 failure table


def test_before_409_late_turn_passes_through_and_aborts(redis, redis_url, tmp_path, vllm):
    with FakeJudge() as judge, running_gateway(tmp_path, redis_url, vllm, judge_url=judge.url) as gw:
        t = start_task(gw, "s-late", "delayed_feedback")

        def call(turn: str, text: str) -> httpx.Response:
            return gw.http.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": text}],
                                            "max_tokens": 8}, headers={SESSION: "s-late", TURN: turn})

        assert call("u1", "first").status_code == 200
        assert call("u2", "second").status_code == 200  # publishes u1
        late = call("u1", "late again")
        assert error_of(late) == (409, "completion_conflict")  # the RL envelope, passed through
        assert task_record(gw, t)["status"] == "aborted"
        assert ended(gw, t) == ("aborted", "capture_failed")
        assert len(chat_bodies(vllm)) == 2  # the late call never reached vLLM
        assert len(judge.requests) == 1
        # Published turn 1 stays, staged turn 2 is dropped.
        assert [(s["agent_turn_id"], s["status"]) for s in samples(gw)] == [("u1", "pending")]
        assert_bypassed(gw, vllm, "s-late")  # unmapped


def test_before_5xx_judge_failure_is_502_and_aborts(redis, redis_url, tmp_path, vllm):
    with FakeJudge(default=Status(500)) as judge, running_gateway(tmp_path, redis_url, vllm,
                                                                  judge_url=judge.url) as gw:
        t = start_task(gw, "s-judge-down", "delayed_feedback")
        client = openai_client(gw)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one"}],
                                             max_tokens=8, extra_headers={SESSION: "s-judge-down", TURN: "u1"})
        assert out.choices[0].message.content
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "two"}],
                                           max_tokens=8, extra_headers={SESSION: "s-judge-down", TURN: "u2"})
        assert error_of(failed.value.response) == (502, "rl_hook_failed")
        assert ended(gw, t) == ("aborted", "capture_failed")
        assert len(judge.requests) == 1 and len(chat_bodies(vllm)) == 1
        assert stats(gw)["total"] == 0  # nothing published
        assert_bypassed(gw, vllm, "s-judge-down")


def test_before_timeout_is_504_and_aborts(redis, redis_url, tmp_path, vllm):
    with FakeJudge() as judge, running_gateway(
        tmp_path, redis_url, vllm, judge_url=judge.url, online_overrides={"hookTimeout": "1s", "hookRetries": 0}
    ) as gw:
        gate = judge.gate()
        try:
            t = start_task(gw, "s-slow", "delayed_feedback")
            headers = {SESSION: "s-slow"}
            body = {"model": "tiny", "messages": [{"role": "user", "content": "one"}], "max_tokens": 8}
            assert gw.http.post(CHAT, json=body, headers={**headers, TURN: "u1"}).status_code == 200
            judge.enqueue(Hold(gate))  # turn 2's :before waits on the publication of turn 1
            started = time.monotonic()
            r = gw.http.post(CHAT, json=body, headers={**headers, TURN: "u2"})
            assert error_of(r) == (504, "rl_hook_timeout")
            assert 0.9 < time.monotonic() - started < 4.0
            assert ended(gw, t) == ("aborted", "capture_failed")
            assert len(chat_bodies(vllm)) == 1
            assert_bypassed(gw, vllm, "s-slow")
            assert stats(gw)["total"] == 0
        finally:
            gate.open()
        # The held publication ends once the Judge answers: rolled back (the Task is gone), nothing published.
        with SyncRedis.from_url(redis_url) as sync:
            eventually(lambda: sync.get(f"rl:v1:task:{t}:turn:u1:publish") == b"failed", "publication rolled back")
        assert len(judge.requests) == 1 and stats(gw)["total"] == 0


def test_before_404_is_409_and_unmaps(redis, redis_url, tmp_path, vllm):
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        t = start_task(gw, "s-forgotten")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert gw.http.post(CHAT, json=body, headers={SESSION: "s-forgotten"}).status_code == 200
        with SyncRedis.from_url(redis_url) as sync:
            assert sync.delete(f"rl:v1:task:{t}") == 1  # the RL Service no longer knows the Task
        r = gw.http.post(CHAT, json=body, headers={SESSION: "s-forgotten"})
        assert (r.status_code, r.json()) == (409, {"error": {"code": "completion_conflict",
                                                             "message": "the RL Task is no longer active"}})
        assert len(chat_bodies(vllm)) == 1
        assert_bypassed(gw, vllm, "s-forgotten")


def test_before_other_4xx_passes_through_and_keeps_the_task(redis, redis_url, tmp_path, vllm):
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        t = start_task(gw, "s-n2")
        client = openai_client(gw)
        with pytest.raises(openai.BadRequestError) as refused:  # a `top_logprobs` the RL Service cannot read
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                           max_tokens=4, extra_body={"top_logprobs": "2"},
                                           extra_headers={SESSION: "s-n2"})
        assert error_of(refused.value.response) == (400, "invalid_completion")
        assert chat_bodies(vllm) == []
        assert task_record(gw, t)["status"] == "active"
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, extra_headers={SESSION: "s-n2"})
        assert out.choices[0].message.content
        assert chat_bodies(vllm)[-1]["return_token_ids"] is True  # still captured
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1}).json() == {"sample_count": 1}


def test_after_rejected_still_answers_200_and_aborts(redis, redis_url, tmp_path, vllm):
    # A vLLM that ignores the injected flags: a well-formed completion without token ids, which `:after` refuses.
    completion = {
        "id": "chatcmpl-no-ids", "object": "chat.completion", "created": 1, "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "no token ids here"},
                     "logprobs": None, "finish_reason": "stop", "token_ids": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        "prompt_token_ids": None,
    }
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        t = start_task(gw, "s-after")
        vllm.fail_next(CHAT, 200, body=completion)
        out = openai_client(gw).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={SESSION: "s-after"})
        assert (out.id, out.choices[0].message.content) == ("chatcmpl-no-ids", "no token ids here")
        assert chat_bodies(vllm)[-1]["return_token_ids"] is True  # it was captured
        assert ended(gw, t) == ("aborted", "capture_failed")
        assert capture_sets(redis_url, t) == {"all": 0, "open": 0, "committed": 0}  # never committed, then aborted
        assert stats(gw)["total"] == 0
        assert_bypassed(gw, vllm, "s-after")


def test_discard_failing_after_retries_unmaps_and_aborts(redis_server, redis, redis_url, tmp_path, vllm):
    upstream_error = {"error": {"message": "overloaded", "type": "ServiceUnavailableError", "param": None,
                                "code": 503}}
    with running_gateway(tmp_path, redis_url, vllm, online_overrides={"hookTimeout": "1s", "hookRetries": 0}) as gw:
        t = start_task(gw, "s-discard")
        vllm.delay_next(CHAT, 1.0)
        vllm.fail_next(CHAT, 503, body=upstream_error)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, gw.url + CHAT, timeout=CLIENT_TIMEOUT_S, headers={SESSION: "s-discard"},
                                  json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            vllm.wait_until(lambda v: v.count(CHAT) == 1, timeout_s=WAIT_S)  # `:before` is done
            redis_server.pause()  # the RL Service cannot answer `:discard` now
            try:
                r = pending.result(timeout=WAIT_S)
                assert (r.status_code, r.content) == (503, orjson.dumps(upstream_error))  # unchanged
                # Past the hook timeout the gateway gives up on `:discard`: the session is unmapped, so the next
                # call bypasses the (still unreachable) RL Service.
                time.sleep(2.0)
                assert_bypassed(gw, vllm, "s-discard")
            finally:
                redis_server.resume()
        assert ended(gw, t) == ("aborted", "capture_failed")  # the gateway's `:abort` lands once Redis is back


# ------------------------------------------------------------------------------------- 5. client disconnect


def test_client_disconnect_discards_and_stop_finalizes_without_trajectory(redis, redis_url, tmp_path, vllm):
    vllm.reply = Reply(content="one two three four five six")
    vllm.stream_chunk_delay_s = 0.2
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        t = start_task(gw, "s-gone")
        with httpx.Client(base_url=gw.url, timeout=CLIENT_TIMEOUT_S) as client:
            with client.stream("POST", CHAT, headers={SESSION: "s-gone"}, json={
                "model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 32,
                "stream": True,
            }) as r:
                assert r.status_code == 200
                first = next(r.iter_lines())
                assert first.startswith("data: {")
        # Leaving the blocks closed the connection mid-stream: the gateway discards the open capture.
        eventually(lambda: capture_sets(redis_url, t)["all"] == 0, "capture discarded")
        # A stream the upstream breaks is discarded too; the client's stream ends without `[DONE]`.
        vllm.stream_chunk_delay_s = 0.0
        vllm.break_stream_after(3)
        with gw.http.stream("POST", CHAT, headers={SESSION: "s-gone"}, json={
            "model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 32, "stream": True,
        }) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and "data: [DONE]" not in lines
        deltas = [orjson.loads(line.removeprefix("data: "))["choices"][0]["delta"] for line in lines]
        assert [d.get("content") for d in deltas] == ["", "one", " two"]  # the three chunks sent before the break
        assert chat_bodies(vllm)[-1]["return_token_ids"] is True
        stopped = gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()
        assert (stopped["status"], stopped["finish_reason"]) == ("finalized", "user_stopped")
        r = gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0})
        assert error_of(r) == (409, "reward_conflict") and "at least one capture" in r.json()["error"]["message"]
        assert stats(gw)["total"] == 0
        assert_nothing_in_flight(gw)


# ----------------------------------------------------------------------------------------- 6. drain timeout


def test_stop_drain_timeout_is_504_and_aborts_while_the_completion_finishes(redis, redis_url, tmp_path, vllm):
    vllm.reply = Reply(content="slow but complete")
    with running_gateway(tmp_path, redis_url, vllm, online_overrides={"drainTimeout": "1s"}) as gw:
        t = start_task(gw, "s-drain")
        client = openai_client(gw)
        vllm.delay_next(CHAT, 3.0)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.chat.completions.create, model="tiny", max_tokens=8,
                                  messages=[{"role": "user", "content": "take your time"}],
                                  extra_headers={SESSION: "s-drain"})
            vllm.wait_until(lambda v: v.count(CHAT) == 1, timeout_s=WAIT_S)
            r = gw.signed("POST", f"/v1/rl/tasks/{t}/stop")
            assert error_of(r) == (504, "task_drain_timeout")
            record = task_record(gw, t)
            assert (record["status"], record["finish_reason"]) == ("aborted", "timeout")
            out = pending.result(timeout=WAIT_S)
        assert out.choices[0].message.content == "slow but complete"
        record = task_record(gw, t)  # its refused `:after` does not change the sticky terminal state
        assert (record["status"], record["finish_reason"]) == ("aborted", "timeout")
        assert stats(gw)["total"] == 0
        assert_bypassed(gw, vllm, "s-drain")


def test_unconvertible_anthropic_answer_is_502_after_the_capture_hook_ran(redis, redis_url, tmp_path, vllm):
    # The client's view is built before `:after` (so the parsed answer can be dropped early); `:after` must still
    # run for an answer the client cannot get: here it refuses the choice-less completion and the Task aborts.
    completion = {"id": "chatcmpl-empty", "object": "chat.completion", "created": 1, "model": "tiny",
                  "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}}
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        t = start_task(gw, "s-conv")
        vllm.fail_next(CHAT, 200, body=completion)
        r = gw.http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "hi"}]},
                         headers={SESSION: "s-conv"})
        assert error_of(r) == (502, "upstream_invalid") and "cannot be converted" in r.json()["error"]["message"]
        assert chat_bodies(vllm)[-1]["return_token_ids"] is True  # it was captured
        assert ended(gw, t) == ("aborted", "capture_failed")
        assert capture_sets(redis_url, t) == {"all": 0, "open": 0, "committed": 0}


# ----------------------------------------------------------------------------------- 7. vLLM errors pass through


@pytest.mark.parametrize("status", [400, 429, 500])
def test_vllm_errors_pass_through_for_bypassed_and_captured_calls(redis, redis_url, tmp_path, vllm, status):
    error = {"error": {"message": f"scripted {status}", "type": "SomeError", "param": None, "code": status}}
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        t = start_task(gw, "s-err")
        for headers, stream in (({}, False), ({SESSION: "s-err"}, False), ({SESSION: "s-err"}, True)):
            vllm.fail_next(CHAT, status, body=error)
            r = gw.http.post(CHAT, json={**request, "stream": stream}, headers=headers)
            assert (r.status_code, r.content) == (status, orjson.dumps(error))
        assert [b.get("return_token_ids", False) for b in chat_bodies(vllm)] == [False, True, True]
        # Stop drains the background discards; with an open capture left the RL Service would answer 409.
        stopped = gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()
        assert stopped["status"] == "finalized"
        assert capture_sets(redis_url, t) == {"all": 0, "open": 0, "committed": 0}
        r = gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0})
        assert error_of(r) == (409, "reward_conflict") and "at least one capture" in r.json()["error"]["message"]
        assert stats(gw)["total"] == 0
        assert_nothing_in_flight(gw)


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"stream": 1}, "stream must be a boolean"), ({"stream": "true"}, "stream must be a boolean"),
     ({"stream": True, "stream_options": []}, "stream_options must be an object")],
)
def test_non_boolean_stream_is_400_before_any_upstream_call(redis, redis_url, tmp_path, vllm, fields, message):
    # vLLM would stream for `"stream": 1` while the gateway reads only `true` as a stream: relayed, the SSE answer
    # would fail as a 502 `upstream_invalid` (seen by the schema fuzzer).
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        start_task(gw, "s-stream")
        for headers in ({}, {SESSION: "s-stream"}):
            r = gw.http.post(CHAT, json=request, headers=headers)
            assert error_of(r) == (400, "invalid_request") and r.json()["error"]["message"] == message
        assert chat_bodies(vllm) == []
        r = gw.http.post(CHAT, json={**request, "stream": False, "stream_options": None}, headers={SESSION: "s-stream"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


# ----------------------------------------------------------------------------------------- 8. Redis paused


def test_task_start_with_redis_paused_is_500_then_201(redis_server, redis, redis_url, tmp_path, vllm):
    # A short socket timeout, so the RL Service's Redis call fails instead of waiting for the resume.
    with running_gateway(tmp_path, redis_url, vllm, rl_overrides={"redis_url": redis_url + "?socket_timeout=1"}) as gw:
        redis_server.pause()
        try:
            r = gw.start_task("s-redis")
        finally:
            redis_server.resume()
        assert (r.status_code, r.json()) == (500, {"error": {"code": "internal_error",
                                                             "message": "internal service error"}})
        r = gw.start_task("s-redis")
        assert r.status_code == 201, r.text
        assert r.json()["status"] == "active"



def test_the_gateway_sends_the_packed_after_its_child_advertises_for_json_and_streams(redis, redis_url, tmp_path,
                                                                                      vllm):
    """The child's `/health` lists `packed-v1`, so both a JSON and a streamed completion reach `:after` packed (the
    capture record's response fingerprint says which body committed it), and the samples read back whole: the
    token ids and logprobs the fake vLLM answered with."""
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        client = openai_client(gw)
        headers = {SESSION: "sess-packed"}
        t = start_task(gw, "sess-packed")
        client.chat.completions.create(model="agent-model", messages=[{"role": "user", "content": "json"}],
                                       max_tokens=64, extra_headers=headers)
        stream_openai(client, [{"role": "user", "content": "stream"}], headers)
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        with SyncRedis.from_url(redis_url) as sync:
            committed = [c.decode() for c in sync.smembers(f"rl:v1:task:{t}:captures:committed")]
            records = [orjson.loads(sync.get(f"rl:v1:task:{t}:capture:{c}")) for c in committed]
        assert len(records) == 2 and all(r["response_fingerprint"].startswith("packed:") for r in records), records
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0}).status_code == 200
        got = samples(gw)
        assert len(got) == 2
        tokens = completion_tokens(vllm.reply)
        by_prompt = {tuple(prompt_token_ids(body["messages"])) for body in chat_bodies(vllm)}
        for sample in got:
            trajectory = sample["trajectory"]
            assert tuple(trajectory["prompt_ids"]) in by_prompt
            assert trajectory["response_ids"] == [token.id for token in tokens]
            assert trajectory["response_logprobs"] == pytest.approx([token.logprob for token in tokens], abs=1e-6)


def test_a_client_asking_for_top_logprobs_inside_a_task_gets_them_json_and_stream(redis, redis_url, tmp_path, vllm):
    """Issue 29 item 4: the injected request keeps the client's `top_logprobs` when it asked for logprobs (vLLM then
    lists the sampled token first and the top alternatives, k entries in all: the recorded shape of
    chat_response_sampling.json); a client that did not ask gets no logprobs and vLLM computes no alternatives."""
    with running_gateway(tmp_path, redis_url, vllm) as gw:
        client = openai_client(gw)
        headers = {SESSION: "sess-top"}
        t = start_task(gw, "sess-top")
        out = client.chat.completions.create(model="agent-model", messages=[{"role": "user", "content": "json"}],
                                             max_tokens=64, logprobs=True, top_logprobs=3, extra_headers=headers)
        entries = out.choices[0].logprobs.content
        assert entries and all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in entries)
        assert chat_bodies(vllm)[-1]["top_logprobs"] == 3
        streamed = []
        for chunk in client.chat.completions.create(model="agent-model", messages=[{"role": "user", "content": "s"}],
                                                    max_tokens=64, logprobs=True, top_logprobs=2, stream=True,
                                                    extra_headers=headers):
            for choice in chunk.choices:
                streamed.extend((choice.logprobs.content or []) if choice.logprobs else [])
        assert streamed and all(len(e.top_logprobs) == 2 for e in streamed)
        plain = client.chat.completions.create(model="agent-model", messages=[{"role": "user", "content": "p"}],
                                               max_tokens=64, extra_headers=headers)
        assert plain.choices[0].logprobs is None and chat_bodies(vllm)[-1]["top_logprobs"] == 0
        # `top_logprobs` without `logprobs`: vLLM refuses it outside a Task, so inside one it is refused too (issue
        # 35), where the injected `logprobs` would otherwise have served it.
        for model, inside in (("agent-model", headers), ("tiny", {})):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": "p"}],
                                               max_tokens=64, top_logprobs=5, extra_headers=inside)
            assert refused.value.status_code == 400 and "top_logprobs" in str(refused.value)
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0}).json() == {"sample_count": 3}
        tokens = completion_tokens(vllm.reply)
        for sample in samples(gw):  # the samples keep the sampled tokens' logprobs, whatever the client asked
            assert sample["trajectory"]["response_logprobs"] == pytest.approx([tk.logprob for tk in tokens], abs=1e-6)
