"""Terminal-mode capture and reward over the HTTP contract, fed the real vLLM 0.32 fixtures (CONTRACT §2.8, §4.2,
§4.4, §4.5)."""

from __future__ import annotations

import copy
import math

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.codec import decode_meta
from tests.conftest import load_fixture
from tests.support.service_app import capture, make_config, running_app, start_task


@pytest.fixture
async def client(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (_, c):
        yield c


def code(resp) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


async def task_status(client, t="t1") -> tuple[str, str | None]:
    body = (await client.get(f"/v1/rl/tasks/{t}")).json()
    return body["status"], body["finish_reason"]


async def test_before_injects_flags_and_is_idempotent(client, redis):
    await start_task(client, "s1", "t1")
    request = load_fixture("chat_stream_request.json")
    request = {k: v for k, v in request.items() if k not in ("logprobs", "top_logprobs", "return_token_ids")}
    request["stream_options"] = {"continuous_usage_stats": False}
    body = {"rl_task_id": "t1", "capture_id": "c1", "request": request}
    r = await client.post("/internal/v1/completions:before", json=body)
    assert r.status_code == 200
    injected = r.json()["request"]
    assert (injected["logprobs"], injected["top_logprobs"], injected["return_token_ids"]) == (True, 0, True)
    assert injected["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert injected["messages"] == request["messages"]
    assert (await client.post("/internal/v1/completions:before", json=body)).json() == r.json()
    # Same capture id with different input: conflict, Task stays active.
    other = dict(body, request=dict(request, max_tokens=99))
    assert code(await client.post("/internal/v1/completions:before", json=other)) == (409, "completion_conflict")
    assert await task_status(client) == ("active", None)
    meta = orjson.loads(await redis.get(keys.capture("t1", "c1")))
    assert meta["status"] == "open" and meta["response_fingerprint"] is None


async def test_a_recorded_answer_to_the_injected_request_commits_its_sampled_logprobs(client, redis):
    """vLLM's real answer to the request `:before` injects (`top_logprobs=0`, recorded): no alternatives per token,
    and every sampled logprob lands in the sample."""
    await start_task(client, "s1", "t1")
    request, response = load_fixture("chat_request_top0.json"), load_fixture("chat_response_top0.json")
    before, after = await capture(client, "t1", "c1", request, response)
    assert before.json()["request"]["top_logprobs"] == 0
    assert after.status_code == 204
    assert (await client.post("/v1/rl/tasks/t1/stop")).status_code == 200
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1.0})).json() == {"sample_count": 1}
    sample = (await client.get("/v1/rl/trajectories/c1")).json()
    expected = [e["logprob"] for e in response["choices"][0]["logprobs"]["content"]]
    assert sample["trajectory"]["response_logprobs"] == pytest.approx(expected, rel=1e-6)
    assert sample["trajectory"]["response_ids"] == response["choices"][0]["token_ids"]


async def test_a_recorded_answer_at_the_clients_sampling_commits_it_with_its_record(client):
    """vLLM's real answer (processed logprobs) to a request at temperature 0.7, top_p 0.9 with `top_logprobs` 2: the
    injected request is the recorded one unchanged (every sampling field already named), the sample keeps the
    sampled tokens' logprobs and records the sampling."""
    await start_task(client, "s1", "t1")
    request, response = load_fixture("chat_request_sampling.json"), load_fixture("chat_response_sampling.json")
    before, after = await capture(client, "t1", "c1", request, response)
    assert before.json()["request"] == request and after.status_code == 204
    assert (await client.post("/v1/rl/tasks/t1/stop")).status_code == 200
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1.0})).json() == {"sample_count": 1}
    sample = (await client.get("/v1/rl/trajectories/c1")).json()
    expected = [e["logprob"] for e in response["choices"][0]["logprobs"]["content"]]
    assert sample["trajectory"]["response_logprobs"] == pytest.approx(expected, rel=1e-6)
    assert sample["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
                                  "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                                  "constraints": {}}


async def test_capture_reward_and_sample_fields(client, redis):
    await start_task(client, "s1", "t1")
    request, response = load_fixture("chat_request.json"), load_fixture("chat_response.json")
    before, after = await capture(client, "t1", "c1", request, response)
    assert before.status_code == 200 and after.status_code == 204 and after.content == b""
    # :after repeat is idempotent.
    again = await client.post(
        "/internal/v1/completions:after",
        json={"rl_task_id": "t1", "capture_id": "c1", "request": before.json()["request"], "response": response},
    )
    assert again.status_code == 204
    assert await redis.smembers(keys.committed_captures("t1")) == {b"c1"}
    assert await redis.exists(keys.staged("t1", "c1"))
    # Nothing is published before the reward.
    assert (await client.get("/v1/rl/trajectories/stats")).json()["total"] == 0
    assert (await client.post("/v1/rl/tasks/t1/stop")).json()["status"] == "finalized"
    assert await redis.zscore(keys.TASKS_AWAITING_REWARD, "t1") is not None
    r = await client.post("/v1/rl/tasks/t1/reward", json={"reward": 0.75})
    assert r.json() == {"sample_count": 1}
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 0.75})).json() == {"sample_count": 1}
    assert not await redis.exists(keys.staged("t1", "c1"))
    assert await redis.zscore(keys.TASKS_AWAITING_REWARD, "t1") is None
    assert await redis.zscore(keys.TASKS_GC, "t1") is not None
    stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert (stats["total"], stats["by_status"]["pending"], stats["by_source"]) == (1, 1, {"rl_task": 1})

    sample = (await client.get("/v1/rl/trajectories/c1")).json()
    assert sample["sample_id"] == sample["trajectory_id"] == "c1"
    assert (sample["rl_task_id"], sample["session_id"], sample["user_id"], sample["model"]) == ("t1", "s1", "tiny", "tiny")
    assert (sample["policy_version"], sample["source"], sample["status"]) == ("base", "rl_task", "pending")
    assert sample["judge"] == {"score": 0.75, "source": "terminal"}
    traj = sample["trajectory"]
    assert traj["prompt_ids"] == response["prompt_token_ids"]
    assert traj["response_ids"] == response["choices"][0]["token_ids"]
    expected_lp = [e["logprob"] for e in response["choices"][0]["logprobs"]["content"]]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(traj["response_logprobs"], expected_lp))
    assert traj["input_ids"] == response["prompt_token_ids"] + response["choices"][0]["token_ids"]
    assert traj["response_text"] == response["choices"][0]["message"]["content"]
    assert sample["response"]["prompt_token_ids"] == response["prompt_token_ids"]
    assert sample["request"]["logprobs"] is True
    # The stored hash keeps the arrays only in packed fields.
    stored = decode_meta(await redis.hget(keys.traj("c1"), "sample_json"))
    assert "prompt_ids" not in stored["trajectory"] and "prompt_token_ids" not in stored["response"]
    assert "token_ids" not in stored["response"]["choices"][0]


async def test_each_sample_records_its_effective_sampling(client, redis):
    """Issue 29: the client's sampling is kept in the injected request, the fields it left out get explicit neutral
    values, and the sample records the result: detail, listing, hash field and the capture's event."""
    await start_task(client, "s1", "t1")
    response = load_fixture("chat_response.json")
    request = {k: v for k, v in load_fixture("chat_request.json").items() if k != "temperature"}
    before, after = await capture(client, "t1", "c1", dict(request, temperature=0.7, top_p=0.9), response)
    assert after.status_code == 204
    injected = before.json()["request"]
    expected = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    assert {k: injected[k] for k in expected} == expected
    assert injected["top_logprobs"] == request["top_logprobs"] == 1  # the client asked for one alternative
    # A request that names no sampling field records vLLM's neutral values (never the model's generation_config).
    _, after = await capture(client, "t1", "c2", request, dict(response, id="chatcmpl-2"))
    assert after.status_code == 204
    assert (await client.post("/v1/rl/tasks/t1/stop")).json()["status"] == "finalized"
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1.0})).json() == {"sample_count": 2}

    expected["constraints"] = {}  # issue 35: nothing constrained these two samples
    neutral = dict(expected, temperature=1.0, top_p=1.0)
    for capture_id, sampling in (("c1", expected), ("c2", neutral)):
        sample = (await client.get(f"/v1/rl/trajectories/{capture_id}")).json()
        assert sample["sampling"] == sampling
        assert orjson.loads(await redis.hget(keys.traj(capture_id), "sampling")) == sampling
    listed = {i["sample_id"]: i["sampling"] for i in (await client.get("/v1/rl/trajectories")).json()["items"]}
    assert listed == {"c1": expected, "c2": neutral}
    events = (await client.get("/v1/rl/tasks/t1/events")).json()["items"]
    committed = [e["data"] for e in events if e["type"] == "capture_committed"]
    assert [(e["capture_id"], e["sampling"]) for e in committed] == [("c1", expected), ("c2", neutral)]


async def test_before_refuses_only_what_vllm_would_refuse_and_the_task_stays_active(client):
    """Issue 35: greedy decoding and penalties are captured (they were 400 `invalid_completion`, which an AIGW saw
    too); a value vLLM itself refuses still is."""
    await start_task(client, "s1", "t1")
    request = load_fixture("chat_request.json")
    for extra in ({"temperature": 2.5}, {"top_k": 2.5}, {"repetition_penalty": 0}, {"n": 0}):
        r = await client.post("/internal/v1/completions:before",
                              json={"rl_task_id": "t1", "capture_id": "c1", "request": {**request, **extra}})
        assert code(r) == (400, "invalid_completion"), (extra, r.text)
        assert r.json()["error"]["message"].startswith("request." + next(iter(extra)))
    for i, extra in enumerate(({"temperature": 0}, {"repetition_penalty": 1.1}, {"n": 2})):
        r = await client.post("/internal/v1/completions:before",
                              json={"rl_task_id": "t1", "capture_id": f"c{i}", "request": {**request, **extra}})
        assert r.status_code == 200 and {k: r.json()["request"][k] for k in extra} == extra
    assert await task_status(client) == ("active", None)


async def test_lora_fixture_passes_for_a_pinned_lora_task(client):
    await start_task(client, "s1", "t1", policy="tiny:v1", model="tiny:v1")
    request = dict(load_fixture("chat_request.json"), model="tiny:v1")
    _, after = await capture(client, "t1", "c1", request, load_fixture("chat_lora_response.json"))
    assert after is not None and after.status_code == 204


@pytest.mark.parametrize(
    "reward", [True, None, "0.5", 1.5, -0.1],
)
async def test_reward_rejects_non_numbers(client, reward):
    await start_task(client, "s1", "t1")
    r = await client.post("/v1/rl/tasks/t1/reward", json={"reward": reward})
    assert code(r) == (400, "invalid_reward")


async def test_reward_body_rules(client):
    await start_task(client, "s1", "t1")
    assert code(await client.post("/v1/rl/tasks/t1/reward", content=b'{"reward": NaN}')) == (400, "invalid_reward")
    assert code(await client.post("/v1/rl/tasks/t1/reward", content=b'{"reward": Infinity}')) == (400, "invalid_reward")
    assert code(await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1, "x": 2})) == (400, "invalid_reward_request")
    assert code(await client.post("/v1/rl/tasks/t1/reward", json=[1])) == (400, "invalid_request")
    assert code(await client.post("/v1/rl/tasks/t1/reward", content=b"nope")) == (400, "invalid_request")


async def test_reward_conflicts(client, redis_url, tmp_path):
    await start_task(client, "s1", "t1")
    # Not finalized.
    assert code(await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1})) == (409, "reward_conflict")
    await client.post("/v1/rl/tasks/t1/stop")
    r = await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1})
    assert code(r) == (409, "reward_conflict") and "at least one capture" in r.json()["error"]["message"]
    # Another value after a published reward.
    await start_task(client, "s2", "t2")
    await capture(client, "t2", "c1", load_fixture("chat_request.json"), load_fixture("chat_response.json"))
    await client.post("/v1/rl/tasks/t2/stop")
    assert (await client.post("/v1/rl/tasks/t2/reward", json={"reward": 1})).json() == {"sample_count": 1}
    assert code(await client.post("/v1/rl/tasks/t2/reward", json={"reward": 0})) == (409, "reward_conflict")


def _mutations():
    """(name, mutate(request, response), expected status) for each §4.2 rejection at :after."""

    def resp(fn):
        return lambda req, res: fn(res)

    def choice(res):
        return res["choices"][0]

    cases = {
        "missing prompt ids": resp(lambda r: r.pop("prompt_token_ids")),
        "negative token id": resp(lambda r: choice(r)["token_ids"].__setitem__(0, -1)),
        "bool token id": resp(lambda r: choice(r)["token_ids"].__setitem__(0, True)),
        "empty token ids": resp(lambda r: choice(r).__setitem__("token_ids", [])),
        "missing logprobs": resp(lambda r: choice(r).pop("logprobs")),
        "positive logprob": resp(lambda r: choice(r)["logprobs"]["content"][0].__setitem__("logprob", 0.5)),
        "bool logprob": resp(lambda r: choice(r)["logprobs"]["content"][0].__setitem__("logprob", False)),
        "misaligned logprobs": resp(lambda r: choice(r)["logprobs"]["content"].pop()),
        "missing finish_reason": resp(lambda r: choice(r).__setitem__("finish_reason", None)),
        "missing usage": resp(lambda r: r.pop("usage")),
        "inconsistent usage": resp(lambda r: r["usage"].__setitem__("prompt_tokens", 1)),
        "bad total": resp(lambda r: r["usage"].__setitem__("total_tokens", 1)),
        "two choices": resp(lambda r: r["choices"].append(copy.deepcopy(r["choices"][0]))),
        "wrong object": resp(lambda r: r.__setitem__("object", "chat.completion.chunk")),
        "n > 1": lambda req, res: req.__setitem__("n", 2),
    }
    out = [pytest.param(fn, 400, id=name) for name, fn in cases.items()]
    out.append(pytest.param(resp(lambda r: r.__setitem__("model", "other")), 409, id="wrong model"))
    out.append(pytest.param(lambda req, res: req.__setitem__("max_tokens", 3), 409, id="request fingerprint"))
    return out


@pytest.mark.parametrize(("mutate", "status"), _mutations())
async def test_after_rejections_abort_the_task(client, redis, mutate, status):
    await start_task(client, "s1", "t1")
    request, response = load_fixture("chat_request.json"), load_fixture("chat_response.json")
    before = await client.post(
        "/internal/v1/completions:before", json={"rl_task_id": "t1", "capture_id": "c1", "request": request}
    )
    injected = before.json()["request"]
    mutate(injected, response)
    r = await client.post(
        "/internal/v1/completions:after",
        json={"rl_task_id": "t1", "capture_id": "c1", "request": injected, "response": response},
    )
    assert code(r) == (status, "invalid_completion" if status == 400 else "completion_conflict")
    assert await task_status(client) == ("aborted", "capture_failed")
    assert not await redis.exists(keys.staged("t1", "c1"))


async def test_after_without_before_and_non_finite_logprob(client):
    await start_task(client, "s1", "t1")
    response = load_fixture("chat_response.json")
    r = await client.post(
        "/internal/v1/completions:after",
        json={"rl_task_id": "t1", "capture_id": "cX", "request": load_fixture("chat_request.json"), "response": response},
    )
    assert code(r) == (409, "completion_conflict") and "no matching before" in r.json()["error"]["message"]
    assert await task_status(client) == ("aborted", "capture_failed")

    await start_task(client, "s2", "t2")
    before = await client.post(
        "/internal/v1/completions:before",
        json={"rl_task_id": "t2", "capture_id": "c1", "request": load_fixture("chat_request.json")},
    )
    raw = orjson.dumps(
        {"rl_task_id": "t2", "capture_id": "c1", "request": before.json()["request"], "response": response}
    ).replace(b'"logprob":-5.743277549743652', b'"logprob":NaN', 1)
    assert code(await client.post("/internal/v1/completions:after", content=raw)) == (400, "invalid_completion")
    assert await task_status(client, "t2") == ("aborted", "capture_failed")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"capture_id": "c1", "request": {}}, "missing field: rl_task_id"),
        ({"rl_task_id": "t1", "request": {}}, "missing field: capture_id"),
        ({"rl_task_id": "t1", "capture_id": "c1"}, "missing field: request"),
        ({"rl_task_id": "t1", "capture_id": 5, "request": {}}, None),
        ({"rl_task_id": "t1", "capture_id": "c 1", "request": {}}, None),
        ({"rl_task_id": "t1", "capture_id": "c1", "agent_turn_id": 3, "request": {}}, None),
        ({"rl_task_id": "t1", "capture_id": "c1", "request": []}, None),
        ({"rl_task_id": "t1", "capture_id": "c1", "request": {"model": "tiny"}}, None),
        ({"rl_task_id": "t1", "capture_id": "c1", "request": {"model": "tiny", "messages": [], "n": 0}}, None),
    ],
)
async def test_before_input_errors_leave_the_task_active(client, body, message):
    await start_task(client, "s1", "t1")
    r = await client.post("/internal/v1/completions:before", json=body)
    assert code(r) == (400, "invalid_completion")
    if message:
        assert r.json()["error"]["message"] == message
    assert await task_status(client) == ("active", None)


async def test_before_model_mismatch_is_conflict_without_abort(client):
    await start_task(client, "s1", "t1")
    request = dict(load_fixture("chat_request.json"), model="other")
    r = await client.post("/internal/v1/completions:before", json={"rl_task_id": "t1", "capture_id": "c1", "request": request})
    assert code(r) == (409, "completion_conflict")
    assert await task_status(client) == ("active", None)


async def test_discard_rules(client, redis):
    await start_task(client, "s1", "t1")
    request = load_fixture("chat_request.json")
    disc = {"rl_task_id": "t1", "capture_id": "c1"}
    assert (await client.post("/internal/v1/completions:discard", json=disc)).status_code == 204  # unknown capture
    await client.post("/internal/v1/completions:before", json=dict(disc, request=request))
    assert (await client.post("/internal/v1/completions:discard", json=dict(disc, agent_turn_id="u9"))).status_code == 409
    assert (await client.post("/internal/v1/completions:discard", json=disc)).status_code == 204
    assert (await client.post("/internal/v1/completions:discard", json=disc)).status_code == 204
    assert not await redis.exists(keys.capture("t1", "c1"))
    assert await redis.scard(keys.captures("t1")) == 0
    await capture(client, "t1", "c2", request, load_fixture("chat_response.json"))
    r = await client.post("/internal/v1/completions:discard", json={"rl_task_id": "t1", "capture_id": "c2"})
    assert code(r) == (409, "completion_conflict")
    assert await task_status(client) == ("active", None)  # discard never aborts
    # Disconnect → discard, then stop finalizes with no trajectory.
    assert (await client.post("/v1/rl/tasks/t1/stop")).json()["status"] == "finalized"


async def test_after_once_finalized_is_idempotent_but_new_captures_conflict(client):
    await start_task(client, "s1", "t1")
    request, response = load_fixture("chat_request.json"), load_fixture("chat_response.json")
    before, _ = await capture(client, "t1", "c1", request, response)
    await client.post("/v1/rl/tasks/t1/stop")
    again = await client.post(
        "/internal/v1/completions:after",
        json={"rl_task_id": "t1", "capture_id": "c1", "request": before.json()["request"], "response": response},
    )
    assert again.status_code == 204
    r = await client.post(
        "/internal/v1/completions:before", json={"rl_task_id": "t1", "capture_id": "c2", "request": request}
    )
    assert code(r) == (409, "completion_conflict")
    assert await task_status(client) == ("finalized", "user_stopped")
