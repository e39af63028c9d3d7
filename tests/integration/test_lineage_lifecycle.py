"""The lineage lifecycle (docs/lineages.md "Lifecycle", issue 36 item 4) through the RL Service's public routes, with
the scripted trainer, a fake gateway on a real socket and a private real Redis: archive (no Task, no run, versions
unloaded, data kept), restore (the version served again), delete (every key of the lineage gone in batches, nothing
else touched, the files kept or removed), the agent-key cap on registrations, and the idle sweep."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online import lineage_lifecycle, lineage_purge
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from openjiuwen.agent_evolving.agent_rl.online.training.run_records import TrainingRun
from tests.conftest import load_fixture
from tests.support.fake_gateway import Fail, FakeGateway
from tests.support.invariants import check_invariants
from tests.support.runs import wait_for_run
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_headers
from tests.support.waiting import wait_for_async

REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")
LINEAGE_HEADER = "x-aigw-rl-lineage"
AGENT_KEY = "x-aigw-rl-agent-key"
MAX_LINEAGES = "x-aigw-rl-max-lineages"


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             min_samples_for_training=2, max_samples_per_run=2, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"), lineages={"max_count": 50})
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            yield app.state.deps, client, gateway


async def start(client, lineage: str, task_id: str, *, agent: str | None = None, cap: int | None = None,
                policy: str = "base"):
    headers = {**start_headers(f"s-{task_id}", task_id, policy=policy), LINEAGE_HEADER: lineage}
    if agent is not None:
        headers[AGENT_KEY] = agent
    if cap is not None:
        headers[MAX_LINEAGES] = str(cap)
    return await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal", "lineage": lineage},
                             headers=headers)


async def finished_task(client, lineage: str, task_id: str, captures: int = 1) -> None:
    """A Task of `lineage` with `captures` completions, stopped and rewarded: its samples pending on the line."""
    assert (await start(client, lineage, task_id)).status_code == 201
    for i in range(captures):
        _, after = await capture(client, task_id, f"cap{task_id}x{i}", REQUEST, RESPONSE)
        assert after is not None and after.status_code == 204, after and after.text
    assert (await client.post(f"/v1/rl/tasks/{task_id}/stop")).status_code == 200
    assert (await client.post(f"/v1/rl/tasks/{task_id}/reward", json={"reward": 1.0})).status_code == 200


async def train(deps, client, lineage: str) -> TrainingRun:
    r = await client.post("/v1/rl/training/runs", json={"lineage": lineage})
    assert r.status_code == 201, r.text
    run = await wait_for_run(deps.runner, r.json()["training_run_id"])
    assert run.status == "succeeded", run
    return run


def code(resp) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


async def lineage_of(client, name: str) -> dict[str, Any]:
    r = await client.get(f"/v1/rl/lineages/{name}")
    assert r.status_code == 200, r.text
    return r.json()


async def test_archive_refuses_tasks_and_training_keeps_the_data_and_restore_serves_the_version(service, redis):
    deps, client, gateway = service
    await finished_task(client, "a", "ta1", captures=2)
    v1 = await train(deps, client, "a")
    assert gateway.line_active[f"{MODEL_ID}:a"] == (v1.lora_name, v1.lora_path)
    await finished_task(client, "a", "ta2", captures=2)  # pending again: an archived line must not train them

    r = await client.post("/v1/rl/lineages/a/archive")
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["archived_by"], r.json()["restores_to"]) == ("archived", "operator",
                                                                                      f"{MODEL_ID}:a:v1")
    assert gateway.retired == [f"{MODEL_ID}:a"] and f"{MODEL_ID}:a" not in gateway.line_active
    # No new Task, no run (manual or automatic), no activation of its versions; everything recorded stays.
    assert code(await start(client, "a", "ta3")) == (409, "lineage_archived")
    assert code(await client.post("/v1/rl/training/runs", json={"lineage": "a"})) == (409, "lineage_archived")
    assert code(await client.post("/v1/rl/loras/activate", json={"lora_name": f"{MODEL_ID}:a:v1"})) == (
        409, "lineage_archived")
    assert (await lineage_of(client, "a"))["scheduler"]["pending_samples"] == 2
    listed = (await client.get("/v1/rl/lineages")).json()["items"]
    assert [(i["lineage"], i["state"]) for i in listed] == [("a", "archived")]
    tasks = (await client.get("/v1/rl/tasks", params={"lineage": "a"})).json()["items"]
    assert sorted(t["rl_task_id"] for t in tasks) == ["ta1", "ta2"]
    assert (await client.post("/v1/rl/lineages/a/archive")).status_code == 200  # idempotent
    assert await redis.zcard(keys.LINEAGES_RETIRING) == 0  # the unload was confirmed
    await check_invariants(redis, model_id=MODEL_ID)

    r = await client.post("/v1/rl/lineages/a/restore")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "live"
    assert gateway.line_active[f"{MODEL_ID}:a"] == (v1.lora_name, v1.lora_path)
    assert (await start(client, "a", "ta3")).status_code == 201
    assert code(await client.post("/v1/rl/lineages/a/restore")) == (409, "lineage_not_archived")
    await check_invariants(redis, model_id=MODEL_ID)


async def test_what_is_refused_and_why(service, redis):
    deps, client, gateway = service
    assert code(await client.post("/v1/rl/lineages/default/archive")) == (400, "lineage_protected")
    assert code(await client.post("/v1/rl/lineages/default/delete")) == (400, "lineage_protected")
    assert code(await client.post("/v1/rl/lineages/nobody/archive")) == (404, "lineage_not_found")
    assert code(await client.post("/v1/rl/lineages/Bad/delete")) == (404, "lineage_not_found")
    assert (await start(client, "a", "ta1")).status_code == 201  # active
    assert code(await client.post("/v1/rl/lineages/a/archive")) == (409, "lineage_busy")
    assert code(await client.post("/v1/rl/lineages/a/delete")) == (409, "lineage_busy")
    assert code(await client.post("/v1/rl/lineages/a/archive", json={"x": 1})) == (400, "invalid_lineage_request")
    assert code(await client.post("/v1/rl/lineages/a/delete", json={"remove_files": "yes"})) == (
        400, "invalid_lineage_request")
    assert await redis.exists(keys.lineage_state("a")) == 0 and gateway.retired == []
    await check_invariants(redis, model_id=MODEL_ID)


@pytest.mark.parametrize("failing", ["read", "retire"])
async def test_an_unload_the_gateway_does_not_answer_is_finished_by_the_leader(service, redis, failing):
    """Archived at once (no Task, no run), whatever the gateway says; the version to restore is read and the line
    retired by the leader's loop once the gateway answers."""
    deps, client, gateway = service
    await finished_task(client, "a", "ta1", captures=2)
    v1 = await train(deps, client, "a")
    (gateway.policy_plan if failing == "read" else gateway.retire_plan).extend([Fail(503)] * 20)
    assert code(await client.post("/v1/rl/lineages/a/archive")) == (502, "gateway_unavailable")
    assert (await lineage_of(client, "a"))["state"] == "archived"
    assert code(await start(client, "a", "ta2")) == (409, "lineage_archived")
    assert await redis.zrange(keys.LINEAGES_RETIRING, 0, -1) == [b"a"]
    await check_invariants(redis, model_id=MODEL_ID)
    gateway.policy_plan.clear()
    gateway.retire_plan.clear()
    await deps.lineage_lifecycle.finish_retiring()  # what the leader's loop does at its next round
    assert gateway.retired == [f"{MODEL_ID}:a"] and await redis.zcard(keys.LINEAGES_RETIRING) == 0
    assert (await lineage_of(client, "a"))["restores_to"] == v1.lora_name
    await check_invariants(redis, model_id=MODEL_ID)


async def test_an_archive_and_task_starts_racing_never_leave_an_active_task_on_an_archived_lineage(service, redis):
    deps, client, _ = service
    for round_ in range(12):
        lineage = f"r{round_}"
        await finished_task(client, lineage, f"t{round_}x")
        results = await asyncio.gather(client.post(f"/v1/rl/lineages/{lineage}/archive"),
                                       *(start(client, lineage, f"t{round_}y{i}") for i in range(4)))
        archive, starts = results[0], results[1:]
        started = [r for r in starts if r.status_code == 201]
        if archive.status_code == 200:
            assert started == [] and all(code(r) == (409, "lineage_archived") for r in starts)
        else:
            assert code(archive) == (409, "lineage_busy") and started
    await check_invariants(redis, model_id=MODEL_ID)


async def all_keys(redis) -> dict[str, Any]:
    """Every key of the database with its value in a comparable form (service lease keys left out: they move)."""
    out: dict[str, Any] = {}
    async for raw in redis.scan_iter(match="*", count=1000):
        key = raw.decode()
        if key.startswith(keys.PREFIX + "service:"):
            continue
        kind = (await redis.type(key)).decode()
        if kind == "string":
            value: Any = (await redis.get(key)).decode(errors="replace")
        elif kind == "hash":
            value = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (await redis.hgetall(key)).items()}
        elif kind == "zset":
            value = {m.decode(errors="replace"): s for m, s in await redis.zrange(key, 0, -1, withscores=True)}
        elif kind == "set":
            value = {m.decode(errors="replace"): True for m in await redis.smembers(key)}
        elif kind == "stream":  # timelines
            value = [f"{i.decode()} " + orjson.dumps({k.decode(): v.decode(errors="replace") for k, v in f.items()},
                                                     option=orjson.OPT_SORT_KEYS).decode()
                     for i, f in await redis.xrange(key)]
        else:
            value = [i.decode(errors="replace") for i in await redis.lrange(key, 0, -1)]
        out[key] = value
    return out


def mentions(text: str, tokens: set[str], names: set[str]) -> bool:
    return text in names or any(token in text for token in tokens)


def without(value: Any, tokens: set[str], names: set[str]) -> Any:
    """A value with every member, field or item that mentions the lineage left out."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if not mentions(k, tokens, names)
                and not (isinstance(v, str) and mentions(v, tokens, names))}
    if isinstance(value, list):
        return [i for i in value if not mentions(i, tokens, names)]
    return value


async def ids_of(client, redis, lineage: str) -> set[str]:
    """Every id the lineage owns: its Tasks, samples, runs and rollouts."""
    found: set[str] = set()
    for path, field in (("/v1/rl/tasks", "rl_task_id"), ("/v1/rl/trajectories", "trajectory_id"),
                        ("/v1/rl/training/runs", "training_run_id")):
        r = await client.get(path, params={"lineage": lineage, "limit": 1000})
        assert r.status_code == 200, r.text
        found |= {item[field] for item in r.json()["items"]}
    for raw in await redis.zrange(keys.ROLLOUTS_BY_CREATION, 0, -1):
        if orjson.loads(await redis.get(keys.rollout(raw.decode()))).get("lineage") == lineage:
            found.add(raw.decode())
    return found


async def test_delete_removes_every_key_of_the_lineage_in_batches_and_nothing_else(service, redis, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setattr(lineage_purge, "BATCH", 3)  # many batches from a handful of records
    deps, client, gateway = service
    for lineage in ("a", "b"):
        for i in range(4):
            await finished_task(client, lineage, f"t{lineage}{i}", captures=2)
        await train(deps, client, lineage)
        await train(deps, client, lineage)
    r = await client.post("/v1/rl/loras/activate", json={"lora_name": f"{MODEL_ID}:a:v1"})  # a rollout record
    assert r.status_code == 200, r.text
    assert (await client.post("/v1/rl/lineages/a/pause")).status_code == 200
    await finished_task(client, "a", "ta9")  # one more pending sample
    a_ids = await ids_of(client, redis, "a")
    assert len(a_ids) >= 4 + 9 + 2 + 1
    before = await all_keys(redis)

    r = await client.post("/v1/rl/lineages/a/delete", json={"remove_files": True})
    assert r.status_code == 202, r.text
    assert r.json()["state"] == "deleting" and r.json()["remove_files"] is True
    await wait_for_async(lambda: _gone(client, "a"), timeout_s=20, what="lineage a deleted")
    after = await all_keys(redis)

    tokens, names = {f"{MODEL_ID}:a", "lineage:a:", "by_lineage:a", *a_ids}, {"a"}
    owned = {key for key in before if mentions(key, tokens, names)}
    # Every key of a went, and only those (a shared key that held only a's entries is gone with them).
    assert owned and set(after) == {k for k in set(before) - owned if without(before[k], tokens, names) != {}}
    for key, value in after.items():
        assert without(value, tokens, names) == value, f"{key} still mentions lineage a"
        assert value == without(before[key], tokens, names), f"{key} changed beyond losing lineage a"
    assert gateway.retired == [f"{MODEL_ID}:a"]
    # Its versions are gone from the repository; only the number of its last one stays.
    a_dir = tmp_path / "loras" / MODEL_ID / "lineages" / "a"
    assert [p.name for p in a_dir.iterdir()] == ["retired.json"]
    assert orjson.loads((a_dir / "retired.json").read_bytes()) == {"last_version": 2}
    assert (tmp_path / "loras" / MODEL_ID / "lineages" / "b" / "v2").is_dir()
    await check_invariants(redis, model_id=MODEL_ID)

    # Gone from every route; the name can be used again, from nothing.
    assert code(await client.get("/v1/rl/lineages/a")) == (404, "lineage_not_found")
    assert code(await client.get("/v1/rl/tasks", params={"lineage": "a"})) == (404, "lineage_not_found")
    assert [i["lineage"] for i in (await client.get("/v1/rl/lineages")).json()["items"]] == ["b"]
    await finished_task(client, "a", "ta10", captures=2)
    assert (await lineage_of(client, "a"))["scheduler"]["pending_samples"] == 2  # its own, nothing of before
    again = await train(deps, client, "a")  # from base, and never the name of a removed version
    assert (again.parent_lora_name, again.lora_name) == ("base", f"{MODEL_ID}:a:v3")

    # b's files stay when the operator keeps them.
    assert (await client.post("/v1/rl/lineages/b/archive")).status_code == 200
    assert (await client.post("/v1/rl/lineages/b/delete")).status_code == 202
    await wait_for_async(lambda: _gone(client, "b"), timeout_s=20, what="lineage b deleted")
    assert (tmp_path / "loras" / MODEL_ID / "lineages" / "b" / "v2").is_dir()
    await check_invariants(redis, model_id=MODEL_ID)


async def _gone(client, lineage: str) -> bool:
    return (await client.get(f"/v1/rl/lineages/{lineage}")).status_code == 404


async def test_a_deleting_lineage_serves_nothing_and_refuses_everything(service, redis, monkeypatch):
    deps, client, _ = service
    await finished_task(client, "a", "ta1")
    stalled = asyncio.Event()

    async def stall(lineage: str, *, remove_files: bool) -> dict[str, int]:
        await stalled.wait()
        return {}

    monkeypatch.setattr(deps.lineage_lifecycle._purge, "run", stall)  # noqa: SLF001 - hold the deletion open
    assert (await client.post("/v1/rl/lineages/a/delete")).status_code == 202
    assert (await lineage_of(client, "a"))["state"] == "deleting"
    assert code(await start(client, "a", "ta2")) == (409, "lineage_deleting")
    assert code(await client.get("/v1/rl/trajectories", params={"lineage": "a"})) == (404, "lineage_not_found")
    assert code(await client.post("/v1/rl/lineages/a/archive")) == (409, "lineage_deleting")
    assert code(await client.post("/v1/rl/lineages/a/restore")) == (409, "lineage_deleting")
    assert (await client.post("/v1/rl/lineages/a/delete")).status_code == 202  # a repeat: the same deletion
    await check_invariants(redis, model_id=MODEL_ID)
    stalled.set()


async def test_an_agent_keys_cap_bounds_the_lineages_it_registers(service, redis):
    deps, client, _ = service
    assert (await start(client, "a", "t1", agent="k1", cap=2)).status_code == 201
    assert (await start(client, "b", "t2", agent="k1", cap=2)).status_code == 201
    assert code(await start(client, "c", "t3", agent="k1", cap=2)) == (409, "agent_lineage_limit_reached")
    assert (await start(client, "a", "t4", agent="k1", cap=2)).status_code == 201  # registered already: no count
    assert (await start(client, "c", "t5", agent="k2", cap=1)).status_code == 201  # another key's own cap
    assert (await start(client, "d", "t6")).status_code == 201  # the operator: no cap
    assert code(await start(client, "e", "t7", agent="k2", cap=1)) == (409, "agent_lineage_limit_reached")
    assert await redis.hgetall(keys.LINEAGES_COUNT_BY_KEY) == {b"k1": b"2", b"k2": b"1"}
    assert code(await start(client, "e", "t8", cap=1)) == (400, "invalid_gateway_task")  # a cap without a key
    r = await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal", "lineage": "e"},
                          headers={**start_headers("s9", "t9"), LINEAGE_HEADER: "e", AGENT_KEY: "k1",
                                   MAX_LINEAGES: "-1"})
    assert code(r) == (400, "invalid_gateway_task")
    # Deleting a lineage the key registered gives the key its slot back.
    for t in ("t1", "t4"):
        assert (await client.post(f"/v1/rl/tasks/{t}/stop")).status_code == 200
    assert (await client.post("/v1/rl/lineages/a/delete")).status_code == 202
    await wait_for_async(lambda: _gone(client, "a"), timeout_s=20, what="lineage a deleted")
    assert await redis.hget(keys.LINEAGES_COUNT_BY_KEY, "k1") == b"1"
    assert (await start(client, "e", "t10", agent="k1", cap=2)).status_code == 201
    await check_invariants(redis, model_id=MODEL_ID)


async def test_the_idle_sweep_archives_lineages_without_tasks_a_bounded_number_per_round(
        redis, redis_url, tmp_path, monkeypatch):
    monkeypatch.setattr(lineage_lifecycle, "IDLE_PER_TICK", 3)
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url,
                             lineages={"idle_archive_seconds": 3600, "lifecycle_interval_seconds": 3600})
        async with running_app(config) as (app, client):
            lifecycle = app.state.deps.lineage_lifecycle
            for i in range(5):
                await finished_task(client, f"idle{i}", f"ti{i}")
            assert (await start(client, "busy", "tb")).status_code == 201  # an active Task: in use
            started = {m.decode(): s for m, s in await redis.zrange(keys.LINEAGES_LAST_TASK, 0, -1, withscores=True)}
            assert set(started) == {*(f"idle{i}" for i in range(5)), "busy"}
            assert await lifecycle.sweep_idle(now=max(started.values()) + 60) == 0  # nobody idle yet
            later = max(started.values()) + 3601
            assert await lifecycle.sweep_idle(now=later) == 3  # bounded per round
            assert await lifecycle.sweep_idle(now=later) == 2
            assert await lifecycle.sweep_idle(now=later) == 0
            states = {i["lineage"]: i["state"] for i in (await client.get("/v1/rl/lineages")).json()["items"]}
            assert states == {**{f"idle{i}": "archived" for i in range(5)}, "busy": "live"}
            assert (await lineage_of(client, "idle0"))["archived_by"] == "idle"
            # The busy lineage's clock restarted when the sweep found it in use.
            assert await redis.zscore(keys.LINEAGES_LAST_TASK, "busy") == pytest.approx(later)
            assert len(gateway.retired) == 5
            await check_invariants(redis, model_id=MODEL_ID)


async def test_a_config_with_an_idle_ttl_is_validated(redis_url, tmp_path):
    from openjiuwen.agent_evolving.agent_rl.online.config import ConfigError

    for bad in ({"idle_archive_seconds": 0}, {"idle_archive_seconds": "1h"}, {"lifecycle_interval_seconds": 0}):
        with pytest.raises(ConfigError):
            make_config(redis_url, tmp_path, lineages=bad)
    assert make_config(redis_url, Path(tmp_path), lineages={}).lineages.idle_archive_seconds is None


async def test_automatic_training_leaves_an_archived_lineage_alone_until_it_is_restored(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             min_samples_for_training=2, max_samples_per_run=2, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"),
                             training_policy={"auto": True, "min_pending_samples": 2, "poll_interval_seconds": 3600})
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            deps = app.state.deps
            await finished_task(client, "a", "ta1", captures=2)
            assert (await client.post("/v1/rl/lineages/a/archive")).status_code == 200
            assert await deps.scheduler.tick() == []  # eligible by its count, archived: never started
            view = await lineage_of(client, "a")
            assert (view["state"], view["scheduler"]["eligible"], view["scheduler"]["pending_samples"]) == (
                "archived", False, 2)
            assert (await client.post("/v1/rl/lineages/a/restore")).status_code == 200
            [run] = await deps.scheduler.tick()
            assert run.lineage == "a" and (await wait_for_run(deps.runner, run.training_run_id)).status == "succeeded"
            await check_invariants(redis, model_id=MODEL_ID)
