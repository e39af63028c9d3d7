"""Canary rollout per lineage (docs/lineages.md "Rollout per lineage", docs/rollout.md) with a private real Redis, the
scripted trainer and the fake gateway on a real socket: two lineages each run their own canary at the same time, each
is promoted or rolled back by its own arms' rewards (Tasks of other lines never count, even when pinned to `base`),
operator commands name a line, the default line is untouched and the invariant checker is clean."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from tests.integration.test_lineage_training import publish
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import check_invariants
from tests.conftest import load_fixture
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_headers
from tests.support.runs import wait_for_run

A, B = f"{MODEL_ID}:a", f"{MODEL_ID}:b"
ROLLOUT = {"mode": "canary", "share": 0.5, "min_tasks": 3, "tolerance": 0.05,
           # The fake gateway opens every window on 2026-01-01: no timeout may decide for the rewards.
           "max_duration_seconds": 10**9,
           # Rounds are driven by the test (tick), never by the loop in the background.
           "decision_interval_seconds": 3600.0}


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID, canary=True) as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             min_samples_for_training=2, max_samples_per_run=2, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"), rollout=ROLLOUT)
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            yield app.state.deps, client, gateway


async def rewarded_task(client, task_id: str, lineage: str, policy: str, reward: float) -> None:
    """A Task of `lineage` pinned to `policy`, started, stopped and rewarded through the routes."""
    headers = start_headers(f"s-{task_id}", task_id, policy=policy)
    headers["x-aigw-rl-lineage"] = lineage
    body = {"reward_mode": "terminal", **({} if lineage == "default" else {"lineage": lineage})}
    assert (await client.post("/v1/rl/tasks/start", json=body, headers=headers)).status_code == 201
    response = load_fixture("chat_response.json")
    _, after = await capture(client, task_id, f"c-{task_id}", load_fixture("chat_request.json"), response)
    assert after.status_code == 204, after.text
    assert (await client.post(f"/v1/rl/tasks/{task_id}/stop")).status_code == 200
    r = await client.post(f"/v1/rl/tasks/{task_id}/reward", json={"reward": reward})
    assert r.status_code == 200, r.text


async def canary_of(deps, client, lineage: str) -> dict:
    await publish(deps.samples, lineage, 2, start={"a": 0, "b": 10}[lineage], score=1.0)
    r = await client.post("/v1/rl/training/runs", json={"lineage": lineage})
    assert r.status_code == 201, r.text  # was 409 lineage_rollout_unsupported
    run = await wait_for_run(deps.runner, r.json()["training_run_id"])
    assert (run.status, run.lora_name) == ("succeeded", f"{MODEL_ID}:{lineage}:v1")
    status = (await client.get("/v1/rl/rollout", params={"lineage": lineage})).json()
    assert status["lineage"] == lineage
    return status["current"]


async def test_two_lineages_each_decided_by_their_own_arms(service, redis, tmp_path):
    deps, client, gateway = service
    observed = await redis.get(keys.POLICY_OBSERVED)
    ro_a, ro_b = await canary_of(deps, client, "a"), await canary_of(deps, client, "b")
    # Two canaries at once, one per line, each with its own pointer; the default line has none.
    assert (ro_a["lineage"], ro_a["candidate"]["lora_name"], ro_a["baseline"]["lora_name"]) == ("a", f"{A}:v1", "base")
    assert (ro_b["lineage"], ro_b["candidate"]["lora_name"]) == ("b", f"{B}:v1")
    assert set(gateway.line_candidates) == {A, B} and gateway.candidate is None
    assert await redis.get(keys.rollout_current("a")) == ro_a["rollout_id"].encode()
    assert await redis.smembers(keys.ROLLOUT_LIVE_LINEAGES) == {b"a", b"b"}
    default = (await client.get("/v1/rl/rollout")).json()
    assert default["current"] is None and "lineage" not in default
    assert await deps.rollout.in_progress() is None and (await deps.rollout.in_progress(A)).rollout_id == \
        ro_a["rollout_id"]
    # The line's own next run waits for its canary; the run store is per line too.
    await publish(deps.samples, "a", 2, start=20, score=1.0)
    held = await client.post("/v1/rl/training/runs", json={"lineage": "a"})
    assert (held.status_code, held.json()["error"]["code"]) == (409, "rollout_in_progress")

    # a: the candidate earns more than a's `base`; b: less than b's `base`. Default-line Tasks pinned to `base`
    # earn the opposite of each: counted in a line's active arm, they would change both arms' figures.
    for i, (ca, aa, cb, ab, d) in enumerate([(0.9, 0.1, 0.1, 0.9, 0.5), (1.0, 0.0, 0.0, 1.0, 0.5),
                                             (0.95, 0.05, 0.05, 0.95, 0.6)]):
        await rewarded_task(client, f"ta-c{i}", "a", f"{A}:v1", ca)
        await rewarded_task(client, f"ta-a{i}", "a", "base", aa)
        await rewarded_task(client, f"tb-c{i}", "b", f"{B}:v1", cb)
        await rewarded_task(client, f"tb-a{i}", "b", "base", ab)
        await rewarded_task(client, f"td-{i}", "default", "base", d)
    arms = (await client.get("/v1/rl/rollout", params={"lineage": "a"})).json()["current"]["evaluation"]["arms"]
    assert (arms["candidate"]["tasks"], arms["active"]["tasks"]) == (3, 3)  # the 3 default `base` Tasks: not a's
    assert arms["active"]["reward"]["mean"] == pytest.approx(0.05)

    # b paused by the operator (body {"lineage"}): the round decides a alone.
    paused = await client.post("/v1/rl/rollout/pause", json={"lineage": "b"})
    assert (paused.status_code, paused.json()["status"]) == (200, "paused"), paused.text
    decisions = await deps.rollout_decisions.tick()
    assert (decisions["a"].action, decisions["a"].reason) == ("promote", "not_worse")
    assert decisions["b"].action == "rollback"  # what it would do; paused, so not done
    assert (await client.get("/v1/rl/rollout", params={"lineage": "b"})).json()["current"]["status"] == "paused"
    assert (await client.post("/v1/rl/rollout/resume", json={"lineage": "b"})).json()["status"] == "running"
    decisions = await deps.rollout_decisions.tick()
    assert (decisions["b"].action, decisions["b"].reason) == ("rollback", "regression")

    after_a = (await client.get("/v1/rl/rollout", params={"lineage": "a"})).json()
    after_b = (await client.get("/v1/rl/rollout", params={"lineage": "b"})).json()
    assert after_a["current"] is None and after_b["current"] is None
    assert [r["status"] for r in after_a["recent"]] == ["promoted"]  # only a's own rollouts
    assert [r["status"] for r in after_b["recent"]] == ["rolled_back"]
    assert gateway.line_active == {A: (f"{A}:v1", ro_a["candidate"]["lora_path"])}
    assert gateway.line_candidates == {}
    assert [(action, body["lora_name"]) for action, body in gateway.canary_calls if action != "start"] == [
        ("promote", f"{A}:v1"), ("abort", f"{B}:v1")]
    # The default line never moved: no candidate, no active version, its observed policy as before.
    assert (gateway.candidate, gateway.active) == (None, None)
    assert await redis.get(keys.POLICY_OBSERVED) == observed
    assert await redis.get(keys.ROLLOUT_CURRENT) is None
    marker = LoraRepository(tmp_path / "loras", model_id=MODEL_ID, line=A).model_dir / "active"
    assert marker.is_file() and f"{A}:v1" in marker.read_text()
    assert await redis.smembers(keys.ROLLOUT_LIVE_LINEAGES) == set()
    report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
    # The trained samples were published without Task records (straight through the store); every other rule holds.
    assert [v for v in report.violations if "which has no record" not in v] == []


async def test_rollout_routes_name_a_line(service, redis):
    deps, client, gateway = service
    await publish(deps.samples, "a", 1, start=0, score=1.0)  # registers `a`

    def code(resp):
        return resp.status_code, resp.json()["error"]["code"]

    assert code(await client.post("/v1/rl/rollout/promote", json={"lineage": "a"})) == (409, "no_rollout")
    assert code(await client.post("/v1/rl/rollout/rollback", json={"lineage": "zz"})) == (404, "lineage_not_found")
    assert code(await client.post("/v1/rl/rollout/pause", json={"lineage": "Bad"})) == (400, "invalid_lineage")
    assert code(await client.post("/v1/rl/rollout/resume", json={"lineage": "a", "x": 1})) == (
        400, "invalid_rollout_request")
    assert code(await client.get("/v1/rl/rollout", params={"lineage": "v2"})) == (400, "invalid_lineage")
    assert code(await client.get("/v1/rl/rollout", params={"lineage": "zz"})) == (404, "lineage_not_found")
    assert (await client.get("/v1/rl/rollout", params={"lineage": "a"})).json()["current"] is None
    assert code(await client.post("/v1/rl/rollout/promote", json={"lineage": "default"})) == (409, "no_rollout")


async def test_an_orphan_candidate_of_a_line_is_dropped_by_its_next_canary(service, redis, tmp_path):
    """A line's gateway candidate that no rollout owns (its record lost) would refuse the line's every canary:
    the next one drops it and starts."""
    deps, client, gateway = service
    gateway.line_candidates[A] = (f"{A}:v7", str(tmp_path / "orphan"))
    ro = await canary_of(deps, client, "a")
    assert ro["candidate"]["lora_name"] == f"{A}:v1"
    assert [(action, body["lora_name"]) for action, body in gateway.canary_calls] == [
        ("start", f"{A}:v1"), ("abort", f"{A}:v7"), ("start", f"{A}:v1")]
    assert gateway.line_candidates == {A: (f"{A}:v1", ro["candidate"]["lora_path"])}


async def test_invariant_checker_flags_a_line_without_its_pointer(service, redis):
    deps, client, gateway = service
    ro = await canary_of(deps, client, "a")
    assert (await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)).violations == [
        v for v in (await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)).violations
        if "which has no record" in v]
    await redis.delete(keys.rollout_current("a"))  # what a non-atomic end would leave
    report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
    assert f"rollouts ['{ro['rollout_id']}'] of lineage 'a' are not ended but none is current" in report.violations
    assert "rollouts:live_lineages is ['a'], the lineages with a rollout pointer are []" in report.violations


async def rollout_series(client) -> dict[tuple[str, tuple], float]:
    """(family, sorted labels without model_id) → value of the rollout gauges in `GET /metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("rl_rollout_arm_tasks", "rl_rollout_arm_reward_mean", "rl_rollout_in_progress"):
            for s in family.samples:
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_id")))] = s.value
    return out


async def test_rollout_gauges_carry_the_lineage_of_each_live_canary_only(service, redis):
    deps, client, _ = service
    await canary_of(deps, client, "a")
    await canary_of(deps, client, "b")
    await rewarded_task(client, "ta-c0", "a", f"{A}:v1", 0.9)
    await rewarded_task(client, "tb-a0", "b", "base", 0.2)
    await rewarded_task(client, "tb-a1", "b", "base", 0.4)
    decisions = await deps.rollout_decisions.tick()
    assert decisions["a"].action == decisions["b"].action == "wait"  # min_tasks 3: nothing decided yet
    series = await rollout_series(client)

    def val(name: str, **labels: str) -> float | None:
        return series.get((name, tuple(sorted(labels.items()))))

    assert val("rl_rollout_arm_tasks", lineage="a", arm="candidate", outcome="started") == 1
    assert val("rl_rollout_arm_tasks", lineage="a", arm="candidate", outcome="rewarded") == 1
    assert val("rl_rollout_arm_reward_mean", lineage="a", arm="candidate") == pytest.approx(0.9)
    assert val("rl_rollout_arm_tasks", lineage="b", arm="active", outcome="started") == 2
    assert val("rl_rollout_arm_reward_mean", lineage="b", arm="active") == pytest.approx(0.3)
    assert val("rl_rollout_in_progress", lineage="b", status="running") == 1
    # The default line: always there, zeros (no canary of its own); its arms count no lineage's Tasks.
    assert val("rl_rollout_in_progress", lineage="default", status="running") == 0
    assert val("rl_rollout_arm_tasks", lineage="default", arm="candidate", outcome="started") == 0
    assert {dict(labels)["lineage"] for _, labels in series} == {"default", "a", "b"}

    # b's canary ends (operator rollback): the next round drops b's series, a's stay. Bounded by live canaries.
    r = await client.post("/v1/rl/rollout/rollback", json={"lineage": "b"})
    assert r.status_code == 200, r.text
    await deps.rollout_decisions.tick()
    assert await redis.smembers(keys.ROLLOUT_LIVE_LINEAGES) == {b"a"}
    series = await rollout_series(client)
    assert {dict(labels)["lineage"] for _, labels in series} == {"default", "a"}
    assert val("rl_rollout_arm_tasks", lineage="a", arm="candidate", outcome="started") == 1


async def test_a_lines_arms_read_only_that_lines_tasks(service, redis, monkeypatch):
    """Suspected in issue 37: each decision round read every lineage's Tasks created in the window (the overall
    creation index), for every live line. It reads the line's own index: 200 Tasks of other lineages in the window
    cost it nothing."""
    deps, client, _ = service
    await canary_of(deps, client, "a")
    await rewarded_task(client, "ta-c0", "a", f"{A}:v1", 0.9)
    await rewarded_task(client, "ta-a0", "a", "base", 0.4)
    for n in range(200):  # other lineages' Tasks in the same window, pinned to `base` like a's baseline
        headers = start_headers(f"s-other-{n}", f"tother{n}", policy="base")
        headers["x-aigw-rl-lineage"] = "default"
        assert (await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                                  headers=headers)).status_code == 201
    read: list[str] = []
    real_mget = deps.rollout._redis.mget

    async def counting_mget(names, *args):  # forwards to the real Redis; counts the Task records read
        read.extend(n for n in names if n.startswith(keys.PREFIX + "task:") and not n.endswith(":reward"))
        return await real_mget(names, *args)

    monkeypatch.setattr(deps.rollout._redis, "mget", counting_mget)
    candidate, active = await deps.rollout._evaluation.arms(await deps.rollout.in_progress(A))
    assert (candidate.tasks, active.tasks, candidate.ended, active.ended) == (1, 1, 1, 1)
    assert sorted(read) == sorted(keys.task(t) for t in ("ta-c0", "ta-a0"))  # was 202 records
