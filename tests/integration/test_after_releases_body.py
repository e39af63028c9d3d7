"""`:after` lets the parsed response go before its Redis commit (issue 38; benchmarks-notes "CPU per captured call").

A 2,048-token JSON response parses into ~20k objects. While the commit waits on Redis, anything that still holds them
makes every collector pass walk them, once per session in flight; the pipeline gives them up first. This was said
and not done: the `async def after` kept its own reference to the parsed body until the commit returned. (A packed
body's arrays are bytes, which the collector never walks.)
"""

from __future__ import annotations

import copy
import gc

import orjson

from tests.conftest import load_fixture
from tests.support.service_app import make_config, running_app, start_task

REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")


def live_responses(marker: str) -> int:
    """Parsed responses with this `id` still alive, token arrays included (the sample keeps a copy without them)."""
    return sum(1 for o in gc.get_objects() if type(o) is dict and o.get("id") == marker and "prompt_token_ids" in o)


async def test_the_parsed_response_is_gone_while_the_commit_waits_on_redis(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (app, client):
        ledger = app.state.deps.pipeline._ledger
        seen: list[int] = []
        real_commit = ledger.commit

        async def commit(*args, **kwargs):
            seen.append(live_responses(marker))
            return await real_commit(*args, **kwargs)

        ledger.commit = commit
        assert (await start_task(client, "s1", "t1")).status_code == 201
        hook = {"rl_task_id": "t1", "capture_id": "c1", "agent_turn_id": None}
        before = await client.post("/internal/v1/completions:before", json={**hook, "request": REQUEST})
        assert before.status_code == 200, before.text
        marker = "chatcmpl-release-check-7f3a"
        response = copy.deepcopy(RESPONSE) | {"id": marker}
        body = orjson.dumps({**hook, "request": before.json()["request"], "response": response})
        del response
        after = await client.post("/internal/v1/completions:after", content=body)
        assert after.status_code == 204, after.text
    assert seen == [0]
