"""Issue 35 at the RL Service's hooks: what constrained a capture is recorded in each sample (`sampling.constraints`),
the `constrained_samples` setting keeps some kinds out of training (published `excluded` with their `exclusion`),
the choices of an `n` > 1 answer are one sample each of one group, and a sample stored before any of this still
loads. Real Redis, the app over ASGI, the recorded vLLM 0.32 answer."""

from __future__ import annotations

import copy

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from openjiuwen.agent_evolving.agent_rl.online.training.batch import convert_samples
from tests.conftest import load_fixture
from tests.support.invariants import check_invariants
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_task

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": SCHEMA, "strict": True}}


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path, constrained_samples={"penalties": "exclude"})) as (
            app, client):
        yield app, client


def choices_answer(n: int) -> dict:
    """The recorded answer as vLLM lays out `n` choices: each its own tokens and logprobs, usage summed."""
    answer = load_fixture("chat_response.json")
    first = answer["choices"][0]
    choices = []
    for i in range(n):
        choice = copy.deepcopy(first)
        choice["index"] = i
        choice["token_ids"] = [t + i for t in first["token_ids"][: 8 - i]]
        choice["logprobs"]["content"] = [dict(e, logprob=e["logprob"] - i) for e in first["logprobs"]["content"][: 8 - i]]
        choice["message"]["content"] = f"choice {i}"
        choices.append(choice)
    answer["choices"] = list(reversed(choices))  # the order on the wire does not matter, the indexes do
    completion = sum(len(c["token_ids"]) for c in choices)
    answer["usage"] = dict(answer["usage"], completion_tokens=completion,
                           total_tokens=answer["usage"]["prompt_tokens"] + completion)
    return answer


async def sample(client, sample_id: str) -> dict:
    r = await client.get(f"/v1/rl/trajectories/{sample_id}")
    assert r.status_code == 200, r.text
    return r.json()


async def test_constraints_are_recorded_and_the_setting_decides_training(service, redis):
    _, client = service
    await start_task(client, "s1", "t1")
    request = load_fixture("chat_request.json")
    response = load_fixture("chat_response.json")
    sent = {
        "c1": dict(request, response_format=JSON_SCHEMA),  # grammar: correct (default)
        "c2": dict(request, temperature=0),  # greedy: exclude (default)
        "c3": dict(request, presence_penalty=0.5, logit_bias={"5": -100, "7": 2}),  # penalties: exclude (set)
        "c4": dict(request, use_beam_search=True, n=1),  # beam search: never trained
    }
    for capture_id, body in sent.items():
        before, after = await capture(client, "t1", capture_id, body, dict(response, id=f"chatcmpl-{capture_id}"))
        assert before.status_code == 200 and after is not None and after.status_code == 204, (capture_id, before.text)
    assert (await client.post("/v1/rl/tasks/t1/stop")).json()["status"] == "finalized"
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1.0})).json() == {"sample_count": 4}

    c1, c2, c3, c4 = [await sample(client, c) for c in sent]
    digest = c1["sampling"]["constraints"]["json_schema"]
    assert digest["source"] == "response_format" and digest["name"] == "Answer" and digest["strict"] is True
    assert len(digest["digest"]) == 16 and digest["bytes"] == len(orjson.dumps(SCHEMA, option=orjson.OPT_SORT_KEYS))
    assert "properties" not in orjson.dumps(c1["sampling"]).decode()  # the schema itself is never in the record
    assert (c1["status"], c1.get("exclusion")) == ("pending", None)
    # Greedy decoding: vLLM's effective sampling (no truncation) and the kind, kept out of training by default.
    assert c2["sampling"]["temperature"] == 0.0 and c2["sampling"]["constraints"] == {"greedy": {}}
    assert (c2["status"], c2["exclusion"]) == ("excluded", {"reason": "constraint", "kinds": ["greedy"]})
    assert c3["sampling"]["constraints"] == {"penalties": {"presence_penalty": 0.5},
                                             "logit_bias": {"count": 2, "min": -100, "max": 2}}
    assert (c3["status"], c3["exclusion"]) == ("excluded", {"reason": "constraint", "kinds": ["penalties"]})
    assert c4["exclusion"] == {"reason": "constraint", "kinds": ["beam_search"]}
    assert all(s["judge"]["score"] == 1.0 for s in (c1, c2, c3, c4))  # rewarded all the same

    listed = {i["sample_id"]: i for i in (await client.get("/v1/rl/trajectories")).json()["items"]}
    assert listed["c2"]["exclusion"] == c2["exclusion"] and listed["c1"]["exclusion"] is None
    assert listed["c3"]["sampling"] == c3["sampling"]
    stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert stats["by_status"]["pending"] == 1 and stats["by_status"]["excluded"] == 3
    # Never claimed: the only pending sample is the one a run may take.
    assert [m.decode() for m in await redis.zrange(keys.traj_index(MODEL_ID, "pending"), 0, -1)] == ["c1"]
    metrics = (await client.get("/metrics")).text
    assert 'rl_constrained_samples_total{kind="greedy",model_id="tiny",training="exclude"} 1.0' in metrics
    assert 'rl_constrained_samples_total{kind="json_schema",model_id="tiny",training="correct"} 1.0' in metrics
    assert 'kind="logit_bias",model_id="tiny",training="correct"} 1.0' in metrics
    await check_invariants(redis, model_id=MODEL_ID)


async def test_the_choices_of_one_request_are_one_sample_each_of_one_group(service, redis):
    app, client = service
    await start_task(client, "s1", "t1")
    request = dict(load_fixture("chat_request.json"), n=3)
    before, after = await capture(client, "t1", "c1", request, choices_answer(3))
    assert after is not None and after.status_code == 204, after.text if after else before.text
    meta = orjson.loads(await redis.get(keys.capture("t1", "c1")))
    assert meta["samples"] == 3
    # A repeat of the same `:after` is idempotent, one with another answer a conflict.
    repeat = await client.post("/internal/v1/completions:after", json={
        "rl_task_id": "t1", "capture_id": "c1", "request": before.json()["request"], "response": choices_answer(3)})
    assert repeat.status_code == 204
    assert (await client.post("/v1/rl/tasks/t1/stop")).json()["status"] == "finalized"
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 0.5})).json() == {"sample_count": 3}

    samples = [await sample(client, s) for s in ("c1", "c1.1", "c1.2")]
    for i, doc in enumerate(samples):
        assert (doc["group_uid"], doc["choice_index"], doc["status"]) == ("t1:c1", i, "pending")
        assert doc["trajectory"]["response_ids"] == [t + i for t in choices_answer(1)["choices"][0]["token_ids"][: 8 - i]]
        assert doc["trajectory"]["response_text"] == f"choice {i}"
        assert doc["trajectory"]["prompt_ids"] == samples[0]["trajectory"]["prompt_ids"]
        assert doc["judge"]["score"] == 0.5
    stored = await app.state.deps.samples.documents.get_documents(["c1", "c1.1", "c1.2"])  # what a run claims
    batch = convert_samples(stored, pad_token_id=0, max_prompt_length=64, max_response_length=8,
                            advantage_estimator="grpo")
    assert batch.uid == ["t1:c1"] * 3  # one GRPO group: one prompt's choices
    events = (await client.get("/v1/rl/tasks/t1/events")).json()["items"]
    assert [e["data"].get("samples") for e in events if e["type"] == "capture_committed"] == [3]
    await check_invariants(redis, model_id=MODEL_ID)


@pytest.mark.parametrize(("n", "answer", "message"), [
    (3, lambda: choices_answer(2), "response must have exactly 3 choices"),
    (2, lambda: dict(choices_answer(2), usage=load_fixture("chat_response.json")["usage"]),
     "usage does not match the token ids"),
])
async def test_an_answer_that_does_not_match_n_is_refused(service, n, answer, message):
    _, client = service
    await start_task(client, "s1", "t1")
    _, after = await capture(client, "t1", "c1", dict(load_fixture("chat_request.json"), n=n), answer())
    assert after is not None and after.status_code == 400 and after.json()["error"]["message"].startswith(message)


async def test_a_sample_stored_before_constraints_existed_still_loads_and_trains(service, redis):
    """A document in today's shape (issue 29: `sampling` without `constraints`) is listed, shown and converted as an
    unconstrained sample, and the setting never excludes it."""
    app, client = service
    await start_task(client, "s1", "t1")
    await capture(client, "t1", "c1", load_fixture("chat_request.json"), load_fixture("chat_response.json"))
    await client.post("/v1/rl/tasks/t1/stop")
    staged = PackedSample.decode_staged(await redis.get(keys.staged("t1", "c1")))
    old = staged.to_document()
    del old["sampling"]["constraints"]
    old["sample_id"] = old["trajectory_id"] = "legacy-1"
    old["rl_task_id"] = old["task_id"] = None
    store = app.state.deps.samples
    assert await store.publisher.insert_if_absent([PackedSample.from_document(old)]) == ["legacy-1"]
    doc = await sample(client, "legacy-1")
    assert "constraints" not in doc["sampling"] and doc["status"] == "pending" and doc.get("exclusion") is None
    listed = {i["sample_id"]: i for i in (await client.get("/v1/rl/trajectories")).json()["items"]}
    assert listed["legacy-1"]["exclusion"] is None
    batch = convert_samples(await store.documents.get_documents(["legacy-1"]), pad_token_id=0, max_prompt_length=64,
                            max_response_length=16)
    assert batch.corrected.tolist() == [False] and batch.temperatures.tolist() == [1.0]
