"""The RL Service takes `:after` both ways (CONTRACT §2.8): the JSON body an AIGW sends, and the packed body this
project's gateway sends once `/health` lists `packed-v1`. Both store the same sample; a packed body is checked as
strictly as JSON; a malformed one is the contract's 400 envelope, never a 500."""

from __future__ import annotations

import copy
import math

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common.packed_hook import MEDIA_TYPE, pack_after
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import CaptureMeta
from tests.conftest import load_fixture
from tests.support.service_app import capture, make_config, running_app, start_task

REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")
PACKED = {"content-type": MEDIA_TYPE}
AFTER = "/internal/v1/completions:after"
# What differs between two captures of one completion: who and when.
IDENTITY = {"sample_id", "trajectory_id", "rl_task_id", "task_id", "session_id", "created_at", "completion_latency_ms"}


@pytest.fixture
async def service(redis, redis_url, tmp_path):  # `redis` first: it deletes what earlier tests left
    async with running_app(make_config(redis_url, tmp_path)) as (app, client):
        yield client


async def before(client, t: str, c: str) -> dict:
    r = await client.post("/internal/v1/completions:before",
                          json={"rl_task_id": t, "capture_id": c, "agent_turn_id": None, "request": REQUEST})
    assert r.status_code == 200, r.text
    return r.json()["request"]


def packed_body(t: str, c: str, injected: dict, response: dict) -> bytes:
    head = orjson.dumps({"rl_task_id": t, "capture_id": c, "agent_turn_id": None, "request": injected})
    body = pack_after(head, response)
    assert body is not None
    return body


async def staged(redis, t: str, c: str) -> PackedSample:
    return PackedSample.decode_staged(await redis.get(keys.staged(t, c)))


async def test_json_and_packed_bodies_store_the_same_sample(service, redis):
    await start_task(service, "s1", "t1")
    _, after = await capture(service, "t1", "c1", REQUEST, RESPONSE)
    assert after is not None and after.status_code == 204
    await start_task(service, "s2", "t2")
    injected = await before(service, "t2", "c2")
    r = await service.post(AFTER, content=packed_body("t2", "c2", injected, RESPONSE), headers=PACKED)
    assert r.status_code == 204, r.text

    via_json, via_packed = await staged(redis, "t1", "c1"), await staged(redis, "t2", "c2")
    assert via_packed.prompt_ids == via_json.prompt_ids
    assert via_packed.response_ids == via_json.response_ids
    assert via_packed.response_logprobs == via_json.response_logprobs
    strip = lambda meta: {k: v for k, v in meta.items() if k not in IDENTITY}  # noqa: E731
    assert strip(via_packed.meta) == strip(via_json.meta)
    record = CaptureMeta.from_json(await redis.get(keys.capture("t2", "c2")))
    assert record.response_fingerprint.startswith("packed:")

    # Finalized and rewarded, both read back as the same trajectory.
    for t in ("t1", "t2"):
        assert (await service.post(f"/v1/rl/tasks/{t}/stop")).status_code == 200
        assert (await service.post(f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0})).status_code == 200
    a, b = [(await service.get(f"/v1/rl/trajectories/{c}")).json() for c in ("c1", "c2")]
    assert a["trajectory"] == b["trajectory"] and a["response"] == b["response"]


async def test_a_repeated_packed_after_is_idempotent_and_a_different_one_conflicts(service, redis):
    await start_task(service, "s1", "t1")
    injected = await before(service, "t1", "c1")
    body = packed_body("t1", "c1", injected, RESPONSE)
    for _ in range(2):
        assert (await service.post(AFTER, content=body, headers=PACKED)).status_code == 204
    assert await redis.scard(keys.committed_captures("t1")) == 1
    other = copy.deepcopy(RESPONSE)
    other["choices"][0]["token_ids"][0] += 1
    r = await service.post(AFTER, content=packed_body("t1", "c1", injected, other), headers=PACKED)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "completion_conflict")


def _nan_logprob(r: dict) -> None:
    r["choices"][0]["logprobs"]["content"][0]["logprob"] = math.nan


def _positive_logprob(r: dict) -> None:
    r["choices"][0]["logprobs"]["content"][0]["logprob"] = 0.25


def _usage_off(r: dict) -> None:
    r["usage"]["completion_tokens"] += 1


def _other_model(r: dict) -> None:
    r["model"] = "not-the-policy"


@pytest.mark.parametrize("change, status, code", [
    (_nan_logprob, 400, "invalid_completion"),
    (_positive_logprob, 400, "invalid_completion"),
    (_usage_off, 400, "invalid_completion"),
    (_other_model, 409, "completion_conflict"),
], ids=["nan-logprob", "positive-logprob", "usage-mismatch", "model-mismatch"])
async def test_a_packed_body_is_checked_as_json_is_and_aborts_the_task(service, change, status, code):
    await start_task(service, "s1", "t1")
    injected = await before(service, "t1", "c1")
    response = copy.deepcopy(RESPONSE)
    change(response)
    r = await service.post(AFTER, content=packed_body("t1", "c1", injected, response), headers=PACKED)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    task = (await service.get("/v1/rl/tasks/t1")).json()
    assert (task["status"], task["finish_reason"]) == ("aborted", "capture_failed")


async def test_a_packed_body_that_also_carries_the_arrays_as_json_is_refused(service):
    await start_task(service, "s1", "t1")
    injected = await before(service, "t1", "c1")
    body = packed_body("t1", "c1", injected, RESPONSE)
    head_len = int.from_bytes(body[4:8], "little")
    head = orjson.loads(body[16:16 + head_len])
    head["response"]["prompt_token_ids"] = RESPONSE["prompt_token_ids"]
    raw = orjson.dumps(head)
    forged = body[:4] + len(raw).to_bytes(4, "little") + body[8:16] + raw + body[16 + head_len:]
    r = await service.post(AFTER, content=forged, headers=PACKED)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_completion")


@pytest.mark.parametrize("content", [b"", b"RLH1", b"RLH1" + b"\xff" * 12, b"\0" * 64])
async def test_a_malformed_packed_body_is_a_400_envelope(service, content):
    r = await service.post(AFTER, content=content, headers=PACKED)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text


async def test_health_advertises_the_encodings_and_other_routes_still_take_json_only(service):
    health = (await service.get("/health")).json()
    assert health["hook_encodings"] == ["json", "packed-v1"]
    r = await service.post("/internal/v1/completions:before", content=b"RLH1....", headers=PACKED)
    assert (r.status_code, r.json()["error"]["code"]) == (415, "unsupported_media_type")
    r = await service.post(AFTER, content=b"{}", headers={"content-type": "text/plain"})
    assert (r.status_code, r.json()["error"]["code"]) == (415, "unsupported_media_type")
