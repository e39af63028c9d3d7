"""Task and Training Run listings per lineage (docs/lineages.md "Listings per lineage"), over HTTP against the RL
Service app (lifespan included) and a private real Redis: `?lineage=` returns exactly one lineage's items across
pages, from that lineage's own index; retention trims those indexes with the overall ones; ids listed before the
upgrade are indexed by the leader's one-time backfill; malformed names are refused in the error envelope."""

from __future__ import annotations

import time

import pytest

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.lineage_backfill import ListingBackfill
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED
from tests.integration.test_lineage_training import publish
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import check_invariants
from tests.support.runs import wait_for_run
from tests.support.service_app import MODEL_ID, make_config, running_app, start_headers

# Interleaved starts: a lineage's items are spread between the others' in the overall index.
PLAN = ["a", "b", "a", "default", "a", "b", "a", "default", "a", "a", "b", "a"]


async def start(client, task_id: str, lineage: str):
    body = {"reward_mode": "terminal", **({} if lineage == "default" else {"lineage": lineage})}
    policy = "base"
    headers = {**start_headers(f"s-{task_id}", task_id, policy=policy), "x-aigw-rl-lineage": lineage}
    r = await client.post("/v1/rl/tasks/start", json=body, headers=headers)
    assert r.status_code == 201, r.text


async def pages(client, route: str, **params) -> list[list[str]]:
    """Every page of a listing, as lists of ids."""
    out, cursor = [], None
    while True:
        q = {**params, **({"cursor": cursor} if cursor else {})}
        r = await client.get(route, params=q)
        assert r.status_code == 200, r.text
        body = r.json()
        out.append([item.get("rl_task_id") or item.get("training_run_id") for item in body["items"]])
        cursor = body["next_cursor"]
        if cursor is None:
            return out


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gateway.url, trainer_backend="scripted",
                             min_samples_for_training=1, max_samples_per_run=1, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"))
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            yield app.state.deps, client


async def test_task_listing_returns_exactly_one_lineage_across_pages(service, redis):
    deps, client = service
    for i, lineage in enumerate(PLAN):
        await start(client, f"t{i:02d}", lineage)
    expected = {name: [f"t{i:02d}" for i, lin in reversed(list(enumerate(PLAN))) if lin == name]
                for name in ("a", "b", "default")}
    for name, ids in expected.items():
        got = await pages(client, "/v1/rl/tasks", lineage=name, limit=2)
        assert [t for page in got for t in page] == ids  # newest first, nothing of another lineage, no repeat
        assert all(len(page) <= 2 for page in got) and len(got) == (len(ids) + 1) // 2
    # Unfiltered: every lineage's, as before.
    assert [t for page in await pages(client, "/v1/rl/tasks", limit=5) for t in page] == \
        [f"t{i:02d}" for i in reversed(range(len(PLAN)))]
    # With a status too: stop two of `a`'s Tasks.
    for t in ("t02", "t08"):
        assert (await client.post(f"/v1/rl/tasks/{t}/stop")).status_code == 200
    got = await pages(client, "/v1/rl/tasks", lineage="a", status="finalized", limit=1)
    assert [t for page in got for t in page] == ["t08", "t02"]
    got = await pages(client, "/v1/rl/tasks", lineage="a", status="active", limit=3)
    assert [t for page in got for t in page] == ["t11", "t09", "t06", "t04", "t00"]
    # A page reads the lineage's own index: its size is the lineage's, not the overall one's.
    assert await redis.zcard(keys.tasks_by_lineage("a")) == len(expected["a"])
    assert await redis.zcard(keys.tasks_by_lineage("default")) == len(expected["default"])
    # A cursor is bound to its lineage (and status).
    cursor = (await client.get("/v1/rl/tasks", params={"lineage": "a", "limit": 1})).json()["next_cursor"]
    r = await client.get("/v1/rl/tasks", params={"lineage": "b", "limit": 1, "cursor": cursor})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")
    await check_invariants(redis, model_id=MODEL_ID)


@pytest.mark.parametrize("route", ["/v1/rl/tasks", "/v1/rl/training/runs"])
@pytest.mark.parametrize(("value", "status", "code"), [
    ("Bad", 400, "invalid_lineage"), ("v3", 400, "invalid_lineage"), ("", 400, "invalid_lineage"),
    ("a" * 64, 400, "invalid_lineage"), ("a:b", 400, "invalid_lineage"), ("never-used", 404, "lineage_not_found"),
])
async def test_invalid_or_unknown_lineage_is_refused(service, route, value, status, code):
    _, client = service
    r = await client.get(route, params={"lineage": value})
    assert r.status_code == status
    assert set(r.json()) == {"error"} and r.json()["error"]["code"] == code and r.json()["error"]["message"]


async def test_task_listing_per_lineage_survives_retention(service, redis):
    deps, client = service
    for i, lineage in enumerate(PLAN):
        await start(client, f"t{i:02d}", lineage)
    gone = ["t00", "t01", "t03", "t04"]  # two of a's, one of b's, one of default's
    for t in gone:
        assert (await client.post(f"/v1/rl/tasks/{t}/stop")).status_code == 200
    await deps.sweeper.sweep_once()  # TTLs and listing-expiry entries; a's and b's lineage noted for the trimming
    assert await redis.hgetall(keys.TASKS_LISTING_LINEAGE) == {b"t00": b"a", b"t01": b"b", b"t04": b"a"}
    for t in gone:  # the records expire
        await redis.delete(keys.task(t))
    assert (await deps.sweeper.sweep_once(now=time.time() + 10 ** 7))["listings_removed"] == len(gone)
    # The lineage indexes lost exactly the expired ids, in the same sweep as the overall ones.
    assert await redis.zrange(keys.tasks_by_lineage("a"), 0, -1) == [b"t02", b"t06", b"t08", b"t09", b"t11"]
    assert await redis.zrange(keys.tasks_by_lineage("b"), 0, -1) == [b"t05", b"t10"]
    assert await redis.zrange(keys.tasks_by_lineage("default"), 0, -1) == [b"t07"]
    assert await redis.zcard(keys.tasks_by_lineage_status("a", "finalized")) == 0
    assert await redis.hlen(keys.TASKS_LISTING_LINEAGE) == 0
    got = await pages(client, "/v1/rl/tasks", lineage="a", limit=2)
    assert [t for page in got for t in page] == ["t11", "t09", "t08", "t06", "t02"]
    await check_invariants(redis, model_id=MODEL_ID)


async def test_run_listing_per_lineage_across_pages_and_retention(service, redis):
    deps, client = service
    order = ["a", "default", "a", "b", "a"]
    for i, lineage in enumerate(order):
        await publish(deps.samples, lineage, 1, start=i, score=1.0)
    runs = []
    for lineage in order:
        r = await client.post("/v1/rl/training/runs", json={"lineage": lineage})
        assert r.status_code == 201, r.text
        runs.append((lineage, (await wait_for_run(deps.runner, r.json()["training_run_id"])).training_run_id))
    a_runs = [run for lineage, run in reversed(runs) if lineage == "a"]
    got = await pages(client, "/v1/rl/training/runs", lineage="a", limit=2)
    assert [r for page in got for r in page] == a_runs and len(got) == 2
    got = await pages(client, "/v1/rl/training/runs", lineage="default", limit=2)
    assert [r for page in got for r in page] == [runs[1][1]]
    # Retention: the oldest `a` run's record expires; its lineage was noted at its terminal EXEC.
    oldest = a_runs[-1]
    assert await redis.hget(keys.RUNS_LISTING_LINEAGE, oldest) == b"a"
    await redis.delete(keys.training_run(oldest))
    await deps.sweeper.sweep_once(now=time.time() + 10 ** 8)
    assert await redis.zscore(keys.runs_by_lineage("a"), oldest) is None
    assert not await redis.hexists(keys.RUNS_LISTING_LINEAGE, oldest)
    got = await pages(client, "/v1/rl/training/runs", lineage="a", limit=2)
    assert [r for page in got for r in page] == a_runs[:-1]


async def test_ids_listed_before_the_upgrade_are_backfilled_once(service, redis):
    deps, client = service
    for i, lineage in enumerate(PLAN):
        await start(client, f"t{i:02d}", lineage)
    assert (await client.post("/v1/rl/tasks/t02/stop")).status_code == 200
    # What a deployment from before the per-lineage indexes holds: the overall indexes only, no marker.
    for key in [keys.tasks_by_lineage(n) for n in ("a", "b", "default")] + [
            keys.tasks_by_lineage_status(n, s) for n in ("a", "b", "default") for s in ("active", "finalized")]:
        await redis.delete(key)
    await redis.delete(keys.LISTINGS_LINEAGE_BACKFILL)
    assert (await client.get("/v1/rl/tasks", params={"lineage": "a"})).json()["items"] == []
    read = await ListingBackfill(redis, fence=UNFENCED, chunk=5).run()
    assert read == len(PLAN)
    assert await redis.get(keys.LISTINGS_LINEAGE_BACKFILL) == b"done"
    got = await pages(client, "/v1/rl/tasks", lineage="a", limit=4)
    assert [t for page in got for t in page] == ["t11", "t09", "t08", "t06", "t04", "t02", "t00"]
    got = await pages(client, "/v1/rl/tasks", lineage="a", status="finalized")
    assert [t for page in got for t in page] == ["t02"]
    assert await ListingBackfill(redis, fence=UNFENCED).run() == 0  # once done, never again
    await check_invariants(redis, model_id=MODEL_ID)
