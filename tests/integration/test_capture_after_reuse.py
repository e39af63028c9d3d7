"""`:after` reuses what `:before` established (issue 31 item 3): the request `:before` validated, normalized and
fingerprinted comes back unchanged at `:after`, so it is not validated or normalized again; anything else takes the
full path, and a request changed in between is refused as before."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.online.capture import pipeline
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.conftest import load_fixture
from tests.support.service_app import capture, make_config, running_app, start_task


@pytest.fixture
def calls(monkeypatch) -> dict[str, int]:
    """How often the pipeline validates and normalizes a request."""
    counts = {"validate_request": 0, "normalize_request": 0}
    for name in counts:
        real = getattr(pipeline, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(pipeline, name, counted)
    return counts


@pytest.fixture
async def app_client(redis, redis_url, tmp_path):
    # A Judge is configured (never reached here) so that delayed-feedback Tasks may start.
    config = make_config(redis_url, tmp_path, judge_endpoint="http://127.0.0.1:9/v1", judge_model="judge")
    async with running_app(config) as (app, client):
        yield app, client


async def _status(client, t: str) -> tuple[str, str | None]:
    body = (await client.get(f"/v1/rl/tasks/{t}")).json()
    return body["status"], body["finish_reason"]


async def test_an_unchanged_request_is_validated_and_normalized_once_per_capture(app_client, calls, redis):
    _, client = app_client
    await start_task(client, "s1", "t1")
    request, response = load_fixture("chat_request.json"), load_fixture("chat_response.json")
    before, after = await capture(client, "t1", "c1", request, response)
    assert before.status_code == 200 and after is not None and after.status_code == 204
    assert calls == {"validate_request": 1, "normalize_request": 1}  # `:before` only (was 2 and 2)
    assert await redis.sismember(keys.committed_captures("t1"), "c1")
    # The sample keeps the injected request as `:before` answered it.
    assert (await client.post("/v1/rl/tasks/t1/stop")).status_code == 200
    assert (await client.post("/v1/rl/tasks/t1/reward", json={"reward": 1.0})).json() == {"sample_count": 1}
    sample = (await client.get("/v1/rl/trajectories/c1")).json()
    assert sample["request"] == before.json()["request"]


async def test_a_capture_reserved_by_another_process_takes_the_full_path(app_client, calls, redis):
    """Another worker answered `:before`: this one has no reservation of its own to compare with."""
    app, client = app_client
    await start_task(client, "s1", "t1")
    request, response = load_fixture("chat_request.json"), load_fixture("chat_response.json")
    before = await client.post("/internal/v1/completions:before",
                               json={"rl_task_id": "t1", "capture_id": "c1", "request": request})
    app.state.deps.ledger._open_hints.clear()  # what a worker that did not reserve it knows
    after = await client.post("/internal/v1/completions:after", json={
        "rl_task_id": "t1", "capture_id": "c1", "request": before.json()["request"], "response": response})
    assert after.status_code == 204
    assert calls == {"validate_request": 2, "normalize_request": 2}
    assert await redis.sismember(keys.committed_captures("t1"), "c1")


@pytest.mark.parametrize(("change", "status", "code"), [
    (lambda r: r.__setitem__("max_tokens", 3), 409, "completion_conflict"),  # valid, but not what `:before` saw
    (lambda r: r.__setitem__("n", 2), 400, "invalid_completion"),  # invalid: refused by validation, as before
    (lambda r: r.__setitem__("model", "other"), 409, "completion_conflict"),  # not the Task's policy model
], ids=["changed", "invalid", "other model"])
async def test_a_request_changed_between_before_and_after_is_refused_as_before(app_client, calls, redis, change,
                                                                                status, code):
    _, client = app_client
    await start_task(client, "s1", "t1")
    request, response = load_fixture("chat_request.json"), load_fixture("chat_response.json")
    before = await client.post("/internal/v1/completions:before",
                               json={"rl_task_id": "t1", "capture_id": "c1", "request": request})
    injected = before.json()["request"]
    change(injected)
    after = await client.post("/internal/v1/completions:after", json={
        "rl_task_id": "t1", "capture_id": "c1", "request": injected, "response": response})
    assert (after.status_code, after.json()["error"]["code"]) == (status, code)
    assert calls["validate_request"] == 2  # the changed request was checked as a new one
    assert await _status(client, "t1") == ("aborted", "capture_failed")
    assert not await redis.exists(keys.staged("t1", "c1"))


async def test_a_delayed_task_still_needs_the_turn_at_after(app_client, calls, redis):
    """The turn the request came with at `:before` must come again: without it the full path refuses it (400)."""
    _, client = app_client
    assert (await start_task(client, "s1", "t1", mode="delayed_feedback")).status_code == 201
    request, response = load_fixture("chat_request.json"), load_fixture("chat_response.json")
    before = await client.post("/internal/v1/completions:before", json={
        "rl_task_id": "t1", "capture_id": "c1", "agent_turn_id": "turn1", "request": request})
    assert before.status_code == 200
    after = await client.post("/internal/v1/completions:after", json={
        "rl_task_id": "t1", "capture_id": "c1", "request": before.json()["request"], "response": response})
    assert (after.status_code, after.json()["error"]["code"]) == (400, "invalid_completion")
    assert await _status(client, "t1") == ("aborted", "capture_failed")
