"""Training Runs per lineage (docs/lineages.md wire 4, 5) with the scripted backend, a fake gateway on a real socket
and a private real Redis: each line's run claims only its own samples, starts from its own active version (read
with the line in the `{model}` position) and produces `<line>:vN`, numbered per line; the default line is untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.online.capture.request import normalize_request
from openjiuwen.agent_evolving.agent_rl.online.capture.response import validate_response
from openjiuwen.agent_evolving.agent_rl.online.capture.sample import build_sample
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import Task
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import check_invariants
from tests.support.service_app import MODEL_ID, make_config, running_app
from tests.support.runs import wait_for_run

REQUEST = normalize_request(load_fixture("chat_request.json"))
RESPONSE = load_fixture("chat_response.json")


async def publish(store, lineage: str, count: int, *, start: int, score: float, policy: str = "base") -> list[str]:
    """Publish `count` samples of `lineage` straight through the store (oldest first), its lineage registered as
    its first Task start would have."""
    if lineage != "default":
        await store.publisher._redis.zadd(keys.LINEAGES, {lineage: 1.0}, nx=True)
    ids = []
    for i in range(start, start + count):
        task = Task(f"t{i}", f"s{i}", MODEL_ID, policy, "terminal", "finalized", "2026-01-01T00:00:00+00:00",
                    lineage=lineage)
        sample = build_sample(task, capture_id=f"c{i:04d}", agent_turn_id=None, request=REQUEST, response=RESPONSE,
                              validated=validate_response(RESPONSE, policy_model=MODEL_ID))
        sample.meta["created_at"] = f"2026-01-01T00:00:{i % 60:02d}.{i:06d}+00:00"
        sample.meta["judge"] = {"score": score, "source": "terminal"}
        assert await store.publisher.insert_if_absent([sample]) == [f"c{i:04d}"]
        ids.append(f"c{i:04d}")
    return ids


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             min_samples_for_training=2, max_samples_per_run=2, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"))
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            yield app.state.deps, client, gateway, backend


async def test_two_lineages_train_their_own_samples(service, redis, tmp_path):
    deps, client, gateway, backend = service
    a_ids = await publish(deps.samples, "a", 3, start=0, score=1.0)
    b_ids = await publish(deps.samples, "b", 3, start=10, score=-1.0)
    # Each line's samples sit in its own pending index; nothing reached the default line's.
    assert await redis.zrange(keys.traj_index(f"{MODEL_ID}:a", "pending"), 0, -1) == [i.encode() for i in a_ids]
    assert await redis.zrange(keys.traj_index(f"{MODEL_ID}:b", "pending"), 0, -1) == [i.encode() for i in b_ids]
    assert await redis.zcard(keys.traj_index(MODEL_ID, "pending")) == 0
    assert (await client.post("/v1/rl/training/runs")).json()["error"]["code"] == "insufficient_samples"

    done = {}
    for lineage in ("a", "b"):
        r = await client.post("/v1/rl/training/runs", json={"lineage": lineage})
        assert r.status_code == 201, r.text
        assert r.json()["lineage"] == lineage
        done[lineage] = await wait_for_run(deps.runner, r.json()["training_run_id"])
    assert backend.calls[0]["sample_ids"] == a_ids[:2]  # the line's oldest, and no sample of the other line
    assert backend.calls[1]["sample_ids"] == b_ids[:2]
    for lineage in ("a", "b"):
        run = done[lineage]
        assert (run.status, run.lora_name, run.parent_lora_name) == ("succeeded", f"{MODEL_ID}:{lineage}:v1", "base")
        assert Path(run.lora_path) == (tmp_path / "loras" / MODEL_ID / "lineages" / lineage / "v1").resolve()
    # The parents were read with the line in the {model} position; activations name the line's versions.
    assert gateway.policy_lines == [MODEL_ID, f"{MODEL_ID}:a", f"{MODEL_ID}:b"]  # the first: the default start
    assert [(a["lora_name"], a["expected_lora_name"]) for a in gateway.activations] == [
        (f"{MODEL_ID}:a:v1", "base"), (f"{MODEL_ID}:b:v1", "base")]
    assert gateway.active is None  # the default line's active version never moved
    assert b'"lora_name":"base"' in await redis.get(keys.POLICY_OBSERVED)  # the default line's, not a lineage's

    # The next run of `a` continues from `a`'s v1 and numbers per line.
    await publish(deps.samples, "a", 1, start=20, score=1.0, policy=f"{MODEL_ID}:a:v1")
    r = await client.post("/v1/rl/training/runs", json={"lineage": "a"})
    second = await wait_for_run(deps.runner, r.json()["training_run_id"])
    assert (second.lora_name, second.parent_lora_name) == (f"{MODEL_ID}:a:v2", f"{MODEL_ID}:a:v1")
    assert backend.calls[2]["sample_ids"] == [a_ids[2], "c0020"]
    report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
    # The samples were published without Task records (straight through the store); every other rule holds.
    assert [v for v in report.violations if "which has no record" not in v] == []


async def test_invariant_checker_flags_a_sample_in_another_lines_index(service, redis):
    deps, *_ = service
    [sample_id] = await publish(deps.samples, "a", 1, start=0, score=1.0)
    await publish(deps.samples, "b", 1, start=1, score=1.0)
    # Move the sample into b's pending index by hand (what a claim bug across lines would do).
    await redis.zrem(keys.traj_index(f"{MODEL_ID}:a", "pending"), sample_id)
    await redis.zadd(keys.traj_index(f"{MODEL_ID}:b", "pending"), {sample_id: 1.0})
    report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
    assert f"sample {sample_id} of line '{MODEL_ID}:a' is in line '{MODEL_ID}:b''s pending index" in report.violations


async def test_run_records_of_the_default_line_carry_no_lineage(service, redis):
    deps, client, gateway, _ = service
    await publish(deps.samples, "default", 2, start=0, score=1.0)
    r = await client.post("/v1/rl/training/runs", json={"lineage": "default"})
    assert r.status_code == 201 and "lineage" not in r.json()
    run = await wait_for_run(deps.runner, r.json()["training_run_id"])
    assert run.lora_name == f"{MODEL_ID}:v1"
    assert b"lineage" not in await redis.get(keys.training_run(run.training_run_id))
    assert gateway.policy_lines == [MODEL_ID]


@pytest.mark.parametrize("body", [{"lineage": "Bad"}, {"lineage": "v2"}, {"lineage": 3}])
async def test_invalid_lineage_is_refused(service, body):
    _, client, _, _ = service
    r = await client.post("/v1/rl/training/runs", json=body)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_lineage")


async def test_unknown_body_key_is_refused(service):
    _, client, _, _ = service
    r = await client.post("/v1/rl/training/runs", json={"lineage": "a", "x": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_training_request")


async def test_lineages_are_listed_newest_first_page_by_page(service, redis):
    deps, client, _, _ = service
    for i, lineage in enumerate(("a", "b", "c")):
        await redis.zadd(keys.LINEAGES, {lineage: 1_700_000_000.0 + i})
    await publish(deps.samples, "b", 2, start=0, score=1.0)
    first = await client.get("/v1/rl/lineages", params={"limit": 2})
    assert first.status_code == 200, first.text
    assert [(i["lineage"], i["line"], i["pending_samples"], i["active_run"]) for i in first.json()["items"]] == [
        ("c", f"{MODEL_ID}:c", 0, None), ("b", f"{MODEL_ID}:b", 2, None)]
    assert first.json()["items"][0]["first_used_at"] == "2023-11-14T22:13:22+00:00"
    second = await client.get("/v1/rl/lineages", params={"limit": 2, "cursor": first.json()["next_cursor"]})
    assert [i["lineage"] for i in second.json()["items"]] == ["a"] and second.json()["next_cursor"] is None
    for params in ({"cursor": "nope"}, {"limit": 0}):
        r = await client.get("/v1/rl/lineages", params=params)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")


async def test_policies_of_one_lineage(service, redis):
    deps, client, _, _ = service
    await publish(deps.samples, "a", 1, start=0, score=1.0, policy=f"{MODEL_ID}:a:v1")
    await publish(deps.samples, "a", 1, start=1, score=1.0, policy="base")
    await publish(deps.samples, "default", 1, start=2, score=1.0, policy=f"{MODEL_ID}:v1")
    names = lambda r: [i["policy_version"] for i in r.json()["items"]]  # noqa: E731
    assert names(await client.get("/v1/rl/policies", params={"lineage": "a"})) == ["base", f"{MODEL_ID}:a:v1"]
    assert names(await client.get("/v1/rl/policies", params={"lineage": "default"})) == ["base", f"{MODEL_ID}:v1"]
    assert set(names(await client.get("/v1/rl/policies"))) == {"base", f"{MODEL_ID}:v1", f"{MODEL_ID}:a:v1"}
    r = await client.get("/v1/rl/policies", params={"lineage": "Bad"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_lineage")
    r = await client.get("/v1/rl/policies", params={"lineage": "zzz"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "lineage_not_found")


async def test_a_registered_lineage_has_its_own_view_pause_and_resume(service, redis):
    deps, client, _, _ = service
    await publish(deps.samples, "a", 3, start=0, score=1.0)  # registers `a`
    await publish(deps.samples, "default", 1, start=5, score=1.0)
    view = (await client.get("/v1/rl/lineages/a")).json()
    assert (view["lineage"], view["line"], view["paused"]) == ("a", f"{MODEL_ID}:a", False)
    assert view["scheduler"]["pending_samples"] == 3  # its own line's count, not the default line's (1)
    assert view["scheduler"]["oldest_pending_at"].startswith("2026-01-01T00:00:00")
    paused = (await client.post("/v1/rl/lineages/a/pause")).json()
    assert paused["paused"] is True and (await client.get("/v1/rl/lineages/default")).json()["paused"] is False
    assert (await client.post("/v1/rl/lineages/a/resume")).json()["paused"] is False
    r = await client.post("/v1/rl/lineages/unknown/pause")  # a lineage name never used: still 404
    assert (r.status_code, r.json()["error"]["code"]) == (404, "lineage_not_found")
    assert await redis.hlen(keys.LINEAGES_PAUSED) == 0


async def test_samples_and_counters_of_a_lineage_are_listed_with_its_name(service, redis):
    """`GET /v1/rl/trajectories?lineage=` and `/stats?lineage=` read that lineage's line; without it, the default
    line's, exactly as before lineages."""
    deps, client = service[0], service[1]
    [sample_id] = await publish(deps.samples, "support", 1, start=900, score=1.0)
    listed = (await client.get("/v1/rl/trajectories", params={"lineage": "support"})).json()["items"]
    assert [i["sample_id"] for i in listed] == [sample_id]
    assert sample_id not in [i["sample_id"] for i in (await client.get("/v1/rl/trajectories")).json()["items"]]
    stats = (await client.get("/v1/rl/trajectories/stats", params={"lineage": "support"})).json()
    assert stats["by_status"]["pending"] == 1
    assert (await client.get("/v1/rl/trajectories", params={"lineage": "Bad"})).json()["error"]["code"] == \
        "invalid_lineage"
    answer = await client.get("/v1/rl/trajectories/stats", params={"lineage": "nobody"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "lineage_not_found")
