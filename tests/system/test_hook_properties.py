"""Property-based hook payloads (CONTRACT §2.8, §4.2, §4.5): hypothesis builds complete `:before`/`:after` bodies —
any prompt and completion token ids in the stored range, float32 logprobs ≤ 0, any text, tool calls, extra keys —
and one mutation of the response (an id or a logprob out of range, lengths or usage inconsistent). A consistent
capture is committed (204) and, once rewarded, reads back with exactly the ids and logprobs sent; an inconsistent
one is 400 `invalid_completion` (the Task aborted `capture_failed`); nothing is ever a 5xx. RL Service as a real
process; Redis restored from a snapshot before each example.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis as SyncRedis

from tests.conftest import load_fixture
from tests.support.fuzzing import RedisSnapshot
from tests.support.service_app import start_headers
from tests.support.service_process import ServiceProcess

pytestmark = pytest.mark.system

SETTINGS = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])
REQUEST = load_fixture("chat_request.json")
MAX_ID = 2**32 - 1

token_ids = st.lists(st.integers(0, MAX_ID), min_size=1, max_size=40)
float32_logprobs = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32)
texts = st.text(max_size=60)


@st.composite
def completions(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(token_ids)
    ids = draw(token_ids)
    logprobs = draw(st.lists(float32_logprobs, min_size=len(ids), max_size=len(ids)))
    message: dict[str, Any] = {"role": "assistant", "content": draw(st.none() | texts)}
    if draw(st.booleans()):
        message["tool_calls"] = [{"id": draw(texts), "type": "function",
                                  "function": {"name": draw(texts), "arguments": draw(texts)}}]
    choice = {
        "index": 0, "message": message, "finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"])),
        "token_ids": ids,
        "logprobs": {"content": [{"token": draw(texts), "logprob": lp} for lp in logprobs]},
    }
    return {
        "id": "chatcmpl-x", "object": "chat.completion", "model": "tiny", "prompt_token_ids": prompt,
        "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)},
        draw(st.sampled_from(["system_fingerprint", "service_tier", "x-extra"])): draw(st.none() | texts),
    }


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    for step in path[:-1]:
        doc = doc[step]
    doc[path[-1]] = value


MUTATIONS = {
    "prompt id too large": (("prompt_token_ids", 0), st.integers(MAX_ID + 1, 2**70)),
    "completion id too large": (("choices", 0, "token_ids", 0), st.integers(MAX_ID + 1, 2**70)),
    "negative id": (("choices", 0, "token_ids", 0), st.integers(max_value=-1)),
    "bool id": (("prompt_token_ids", 0), st.booleans()),
    "float id": (("prompt_token_ids", 0), st.floats(allow_nan=False)),
    "positive logprob": (("choices", 0, "logprobs", "content", 0, "logprob"), st.floats(min_value=1e-6)),
    "non-number logprob": (("choices", 0, "logprobs", "content", 0, "logprob"), st.none() | st.text() | st.booleans()),
    "usage off": (("usage", "completion_tokens"), st.integers(1_000, 2_000)),
    "empty ids": (("choices", 0, "token_ids"), st.just([])),
    "no finish_reason": (("choices", 0, "finish_reason"), st.none() | st.just("")),
    "other model": (("model",), st.text(min_size=1).filter(lambda m: m != "tiny")),
}


class Service:
    def __init__(self, svc: ServiceProcess, snapshot: RedisSnapshot) -> None:
        self.svc, self.snapshot = svc, snapshot
        self.http = httpx.Client(base_url=svc.url, timeout=30)


@pytest.fixture(scope="module")
def service(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    redis = SyncRedis.from_url(redis_url)
    snapshot = RedisSnapshot(redis)
    snapshot.clear()
    with ServiceProcess(tmp_path_factory.mktemp("hook-properties"), redis_url) as svc:
        service = Service(svc, snapshot)
        r = service.http.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                              headers=start_headers("s1", "t1"))
        assert r.status_code == 201, r.text
        snapshot.take()
        yield service
        service.http.close()
        assert "unhandled error" not in svc.log(), svc.log()[-3000:]
    snapshot.clear()
    redis.close()


def _capture(service: Service, response: dict[str, Any], extra_request: dict[str, Any]) -> httpx.Response:
    body = {"rl_task_id": "t1", "capture_id": "c1", "agent_turn_id": None, "request": {**REQUEST, **extra_request}}
    before = service.http.post("/internal/v1/completions:before", json=body)
    assert before.status_code == 200, before.text
    # The stdlib encoder writes integers of any size, which orjson (httpx's `json=` too) would refuse.
    after = dict(body, request=before.json()["request"], response=response)
    return service.http.post("/internal/v1/completions:after", content=json.dumps(after),
                             headers={"content-type": "application/json"})


# Sampling fields take values a capture honours (anything else is refused at `:before`, tests/unit/test_sampling.py);
# the others any JSON scalar.
extra_requests = st.fixed_dictionaries({}, optional={
    "temperature": st.none() | st.floats(0.01, 2.0) | st.sampled_from([1, 2]),
    "top_p": st.none() | st.floats(0.0, 1.0, exclude_min=True),
    "top_k": st.none() | st.integers(-1, 100),
    "seed": st.none() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    "user": st.none() | texts,
    "metadata": st.none() | st.integers() | texts,
})


@SETTINGS
@given(response=completions(), extra=extra_requests, reward=st.floats(0, 1))
def test_consistent_captures_round_trip_exactly(service: Service, response: dict[str, Any], extra: dict[str, Any],
                                                reward: float) -> None:
    service.snapshot.restore()
    r = _capture(service, response, extra)
    assert r.status_code == 204, r.text
    assert service.http.post("/v1/rl/tasks/t1/stop").json()["status"] == "finalized"
    assert service.http.post("/v1/rl/tasks/t1/reward", json={"reward": reward}).json() == {"sample_count": 1}
    detail = service.http.get("/v1/rl/trajectories/c1")
    assert detail.status_code == 200, detail.text
    trajectory = detail.json()["trajectory"]
    choice = response["choices"][0]
    assert trajectory["prompt_ids"] == response["prompt_token_ids"]
    assert trajectory["response_ids"] == choice["token_ids"]
    # float32 storage: the values sent were float32 already, so they come back bit for bit.
    sent = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert struct.pack(f"<{len(sent)}f", *trajectory["response_logprobs"]) == struct.pack(f"<{len(sent)}f", *sent)
    # The sampling record: what was sent, the neutral value for what was not.
    neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert {k: detail.json()["sampling"][k] for k in neutral} == {
        k: neutral[k] if extra.get(k) is None else extra[k] for k in neutral}


@SETTINGS
@given(response=completions(), mutation=st.sampled_from(sorted(MUTATIONS)), data=st.data())
def test_inconsistent_captures_are_400_and_abort(service: Service, response: dict[str, Any], mutation: str,
                                                 data: st.DataObject) -> None:
    service.snapshot.restore()
    path, values = MUTATIONS[mutation]
    bad = copy.deepcopy(response)
    _set(bad, path, data.draw(values, label=mutation))
    r = _capture(service, bad, {})
    expected = (409, "completion_conflict") if mutation == "other model" else (400, "invalid_completion")
    assert (r.status_code, orjson.loads(r.content)["error"]["code"]) == expected, (mutation, r.text)
    task = service.http.get("/v1/rl/tasks/t1").json()
    assert (task["status"], task["finish_reason"]) == ("aborted", "capture_failed")
    assert service.http.get("/v1/rl/trajectories/stats").json()["total"] == 0
