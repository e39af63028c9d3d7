"""Excluding a vLLM instance's samples from training (issue 28 item 2), against a real Redis and the service app.

An operator who learns that an instance served made-up token ids excludes it: its samples not yet claimed become
`excluded`, later ones are published `excluded`, and one a running Training Run gives back goes to `excluded`, never
to `pending` (invariant 11, tests/support/invariants.py).
"""

from __future__ import annotations

import asyncio

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


async def publish(deps, instances: list[str | None], *, start: int = 0) -> list[str]:
    """One pending sample per entry, served by that instance (None: the hook named none, as an AIGW's)."""
    out = []
    for i, instance in enumerate(instances, start):
        task = Task(f"t{i}", f"s{i}", MODEL_ID, "base", "terminal", "finalized", "2026-01-01T00:00:00+00:00")
        sample = build_sample(task, capture_id=f"c{i:04d}", agent_turn_id=None, request=REQUEST, response=RESPONSE,
                              validated=validate_response(RESPONSE, policy_model=MODEL_ID), instance=instance)
        sample.meta["created_at"] = f"2026-01-01T00:00:{i % 60:02d}.{i:06d}+00:00"
        sample.meta["judge"] = {"score": 1.0, "source": "terminal"}
        await deps.samples.publisher.insert_if_absent([sample])
        out.append(f"c{i:04d}")
    return out


async def statuses(redis, sample_ids: list[str]) -> list[str]:
    return [(await redis.hget(keys.traj(s), "status")).decode() for s in sample_ids]


async def assert_invariants(redis) -> None:
    """Every invariant but Task ownership (these samples are published without Tasks)."""
    report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
    assert [v for v in report.violations if "which has no record" not in v] == []


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             min_samples_for_training=2, max_samples_per_run=2, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"))
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            yield app, client, backend


async def test_exclusion_files_an_instances_samples_now_and_later_and_only_its_own(service, redis):
    app, client, backend = service
    ids = await publish(app.state.deps, ["rogue", "good", "rogue", None])
    listed = (await client.get("/v1/rl/trajectories", params={"status": "pending"})).json()["items"]
    assert {i["sample_id"]: i["instance"] for i in listed} == dict(zip(ids, ["rogue", "good", "rogue", None]))
    assert (await client.get(f"/v1/rl/trajectories/{ids[0]}")).json()["instance"] == "rogue"

    answer = await client.post("/v1/rl/trajectories/exclude", json={"instance": "rogue"})
    assert answer.status_code == 200
    assert answer.json() == {"instance": "rogue", "excluded": 2, "training": 0, "excluded_instances": ["rogue"]}
    assert await statuses(redis, ids) == ["excluded", "pending", "excluded", "pending"]
    stats = (await client.get("/v1/rl/trajectories/stats")).json()
    assert stats["by_status"]["excluded"] == 2 and stats["by_status"]["pending"] == 2
    # A sample the instance serves afterwards is never trainable; the exclusion is idempotent.
    later = await publish(app.state.deps, ["rogue", "good"], start=10)
    assert await statuses(redis, later) == ["excluded", "pending"]
    again = await client.post("/v1/rl/trajectories/exclude", json={"instance": "rogue"})
    assert again.json()["excluded"] == 0
    # The next Training Run trains on the other samples only.
    run = (await client.post("/v1/rl/training/runs")).json()
    await wait_for_run(app.state.deps.runner, run["training_run_id"])
    assert backend.calls[-1]["sample_ids"] == [ids[1], ids[3]]
    await assert_invariants(redis)


async def test_a_sample_a_run_gives_back_after_its_instance_was_excluded_is_excluded(service, redis):
    app, client, backend = service
    backend.plan = {"outcome": "block"}
    ids = await publish(app.state.deps, ["rogue", "good"])
    run_id = (await client.post("/v1/rl/training/runs")).json()["training_run_id"]
    while not backend.calls:
        await asyncio.sleep(0.01)
    answer = (await client.post("/v1/rl/trajectories/exclude", json={"instance": "rogue"})).json()
    # Claimed samples stay with their run; the answer says how many, so the operator can cancel it.
    assert (answer["excluded"], answer["training"]) == (0, 1)
    assert await statuses(redis, ids) == ["training", "training"]
    await client.post(f"/v1/rl/training/runs/{run_id}/stop")
    assert await statuses(redis, ids) == ["excluded", "pending"]
    await assert_invariants(redis)


async def test_bad_exclusion_bodies_get_400(service):
    _, client, _ = service
    for body in ({}, {"instance": ""}, {"instance": 3}, {"instance": "a\nb"}, {"instance": "x" * 257},
                 {"instance": "a", "purge": True}, []):
        resp = await client.post("/v1/rl/trajectories/exclude", json=body)
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_request"), body


async def test_exclusion_reaches_every_lineages_line(service, redis):
    """A rogue instance served Tasks of several lineages: its samples on every line are excluded, not only the
    default line's (docs/lineages.md: samples are filed on their lineage's line)."""
    app, client, backend = service
    deps = app.state.deps
    await redis.zadd(keys.LINEAGES, {"support": 1.0, "coding": 2.0})
    ids = []
    for i, (lineage, instance) in enumerate([("support", "rogue"), ("coding", "rogue"), ("coding", "good"),
                                             ("default", "rogue")], 20):
        task = Task(f"t{i}", f"s{i}", MODEL_ID, "base", "terminal", "finalized", "2026-01-01T00:00:00+00:00",
                    lineage=None if lineage == "default" else lineage)
        sample = build_sample(task, capture_id=f"c{i:04d}", agent_turn_id=None, request=REQUEST, response=RESPONSE,
                              validated=validate_response(RESPONSE, policy_model=MODEL_ID), instance=instance)
        sample.meta["judge"] = {"score": 1.0, "source": "terminal"}
        assert await deps.samples.publisher.insert_if_absent([sample]) == [f"c{i:04d}"]
        ids.append(f"c{i:04d}")
    answer = (await client.post("/v1/rl/trajectories/exclude", json={"instance": "rogue"})).json()
    assert answer["excluded"] == 3
    assert await statuses(redis, ids) == ["excluded", "excluded", "pending", "excluded"]
    assert await redis.zcard(keys.traj_index(f"{MODEL_ID}:support", "pending")) == 0
    assert await redis.zcard(keys.traj_index(f"{MODEL_ID}:coding", "pending")) == 1
    await assert_invariants(redis)
