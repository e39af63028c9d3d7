"""Task start with a lineage (docs/lineages.md wire 2, 3), over HTTP against a private real Redis: validation, the
refusal under a gateway without lineages, registration on first use bounded by `lineages.max_count`, and records
that carry `lineage` only when it is not `default`."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.support.service_app import make_config, running_app, start_headers

LINEAGE = "x-aigw-rl-lineage"


@pytest.fixture
async def client(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path, lineages={"max_count": 2})) as (_, c):
        yield c


async def start(client, session, task_id, *, lineage=None, header=None, policy="base"):
    body = {"reward_mode": "terminal", **({"lineage": lineage} if lineage is not None else {})}
    headers = start_headers(session, task_id, policy=policy)
    if header is not None:
        headers[LINEAGE] = header
    return await client.post("/v1/rl/tasks/start", json=body, headers=headers)


def code(resp) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


async def test_non_default_lineage_is_registered_and_carried(client, redis):
    r = await start(client, "s1", "t1", lineage="support", header="support", policy="tiny:support:v2")
    assert r.status_code == 201
    assert r.json()["lineage"] == "support"
    assert r.json()["policy_lora_name"] == "tiny:support:v2"
    assert await redis.zrange(keys.LINEAGES, 0, -1) == [b"support"]
    listed = (await client.get("/v1/rl/tasks")).json()["items"]
    assert [t.get("lineage") for t in listed] == ["support"]
    # The same start again is the same Task (the lineage is part of the spec), registered once.
    assert (await start(client, "s1", "t1", lineage="support", header="support",
                        policy="tiny:support:v2")).status_code == 200
    assert await redis.zcard(keys.LINEAGES) == 1


async def test_default_lineage_record_is_unchanged(client, redis):
    for session, task_id, kw in (("s1", "t1", {}), ("s2", "t2", {"lineage": "default", "header": "default"})):
        r = await start(client, session, task_id, **kw)
        assert r.status_code == 201
        assert "lineage" not in r.json()
        assert b"lineage" not in await redis.get(keys.task(task_id))
    assert await redis.zcard(keys.LINEAGES) == 0  # `default` always exists: never registered


@pytest.mark.parametrize(("kw", "expected"), [
    ({"lineage": "Support", "header": "Support"}, "invalid_lineage"),
    ({"lineage": "v3", "header": "v3"}, "invalid_lineage"),
    ({"lineage": 7}, "invalid_lineage"),
    ({"lineage": "a" * 64, "header": "a" * 64}, "invalid_lineage"),
    ({"lineage": "support", "header": "other"}, "invalid_lineage"),
    ({"lineage": "support", "header": "default"}, "invalid_lineage"),
    # Without the header the gateway is an AIGW: it cannot have pinned the Task on the lineage's line.
    ({"lineage": "support"}, "lineage_unsupported"),
    # The pinned policy must be a version of the Task's line, never another line's.
    ({"lineage": "support", "header": "support", "policy": "tiny:v1"}, "invalid_gateway_task"),
    ({"lineage": "support", "header": "support", "policy": "tiny:other:v1"}, "invalid_gateway_task"),
    ({"lineage": "support", "header": "support", "policy": "big:support:v1"}, "invalid_gateway_task"),
    # A gateway that pins per line (it sends the header) pins a default Task on the default line only.
    ({"header": "default", "policy": "tiny:support:v1"}, "invalid_gateway_task"),
    ({"lineage": "default", "header": "default", "policy": "big:v1"}, "invalid_gateway_task"),
])
async def test_refusals(client, redis, kw, expected):
    assert code(await start(client, "s1", "t1", **kw)) == (400, expected)
    assert not await redis.exists(keys.task("t1"))
    assert await redis.zcard(keys.LINEAGES) == 0


async def test_limit_refuses_a_new_lineage_but_not_a_known_one(client, redis):
    for i, name in enumerate(("a", "b")):
        assert (await start(client, f"s{i}", f"t{i}", lineage=name, header=name)).status_code == 201
    refused = await start(client, "s9", "t9", lineage="c", header="c")
    assert code(refused) == (409, "lineage_limit_reached")
    assert not await redis.exists(keys.task("t9"))
    assert await redis.zrange(keys.LINEAGES, 0, -1) == [b"a", b"b"]
    # Known lineages and the default one still start Tasks at the limit.
    assert (await start(client, "s5", "t5", lineage="a", header="a")).status_code == 201
    assert (await start(client, "s6", "t6")).status_code == 201


async def test_a_start_of_another_lineage_on_a_session_with_an_active_task_is_a_conflict(client, redis):
    """The session's active Task is answered to a repeated start only when it is of the lineage asked for: a Task of
    another lineage would send the samples to the wrong line."""
    assert (await start(client, "s1", "t1", header="default")).status_code == 201
    r = await start(client, "s1", "t2", lineage="support", header="support", policy="tiny:support:v1")
    assert code(r) == (409, "task_conflict") and "lineage 'default'" in r.json()["error"]["message"]
    assert await redis.get(keys.task("t2")) is None and await redis.zcard(keys.LINEAGES) == 0
    # The same lineage still answers the active Task (a repeated start), as before lineages.
    assert (await start(client, "s1", "t3", header="default")).json()["rl_task_id"] == "t1"
