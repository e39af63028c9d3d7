"""Prompt-prefix sharing against a real Redis: a conversation's repeated prompt ids are stored once, every read
returns the exact prompt, each deletion path releases its references, old plain `prompt_ids` samples still read,
and the invariant checker names each broken block (invariant P, store/prompt_blocks.py)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import pytest
from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.online.config import RewardPolicyConfig
from openjiuwen.agent_evolving.agent_rl.online.rewards.ledger import RewardLedger
from openjiuwen.agent_evolving.agent_rl.online.rewards.reward_policy import RewardPolicy
from openjiuwen.agent_evolving.agent_rl.online.store import keys, prompt_blocks
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample, pack_ids, pack_logprobs
from openjiuwen.agent_evolving.agent_rl.online.store.prompt_blocks import BLOCK_IDS
from openjiuwen.agent_evolving.agent_rl.online.assembly import SampleStore, make_sample_store
from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED
from tests.conftest import load_fixture
from tests.integration.test_trajectory_store import MODEL, T0, iso_at, make_doc, move
from tests.support.invariants import ClientRecord, check_invariants
from tests.support.samples import sample_status
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_task, with_user

BLOCK_PATTERN = keys.PREFIX + "prompt_block:*"


def conversation(seed: int, turns: int = 4, first: int = 1024, completion: int = 300) -> list[list[int]]:
    """Prompts of an agent loop: turn k = turn k−1's prompt + its completion + a 16-token user message."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 151_000) for _ in range(first)]]
    for _ in range(turns - 1):
        prompts.append(prompts[-1] + [rng.randrange(3, 151_000) for _ in range(completion + 16)])
    return prompts


def sample(sample_id: str, prompt: list[int], *, created: float = T0) -> PackedSample:
    doc = make_doc(sample_id, created=created, prompt=prompt, response=[7, 8, 9])
    doc["rl_task_id"] = doc["task_id"] = ""  # store-level samples: no Task for the checker to look for
    return PackedSample.from_document(doc)


@pytest.fixture
def store(redis: Redis) -> SampleStore:
    return make_sample_store(redis, model_id=MODEL)


async def blocks(redis: Redis) -> dict[str, int]:
    """digest hex -> refs of every stored block."""
    out = {}
    async for key in redis.scan_iter(match=BLOCK_PATTERN):
        out[key.decode().rsplit(":", 1)[1]] = int(await redis.hget(key, "refs"))
    return out


async def holds_invariants(redis: Redis) -> None:
    report = await check_invariants(redis, model_id=MODEL, raise_on_violation=False)
    assert report.ok, report.describe()


async def prompts_read(store: SampleStore, sample_ids: list[str]) -> dict[str, list[int]]:
    return {d["sample_id"]: d["trajectory"]["prompt_ids"] for d in await store.documents.get_documents(sample_ids)}


async def test_a_conversation_stores_each_repeated_prompt_id_once(redis: Redis, store: SampleStore) -> None:
    prompts = conversation(1)
    # Terminal Tasks publish all turns at once, delayed-feedback Tasks turn by turn: both share.
    await store.publisher.insert_if_absent([sample("t0", prompts[0]), sample("t1", prompts[1])])
    await store.publisher.insert_if_absent([sample("t2", prompts[2])])
    await store.publisher.insert_if_absent([sample("t3", prompts[3])])

    ids_ = [f"t{k}" for k in range(4)]
    assert await prompts_read(store, ids_) == dict(zip(ids_, prompts))
    for k, prompt in enumerate(prompts):
        detail = await store.documents.detail(f"t{k}")
        assert detail is not None
        assert detail["trajectory"]["prompt_ids"] == prompt == detail["response"]["prompt_token_ids"]
        assert detail["trajectory"]["input_ids"] == prompt + [7, 8, 9]

    # The longest prompt's full blocks are every block; block i is referenced by each turn whose prompt covers it.
    stored = await blocks(redis)
    assert len(stored) == len(prompts[-1]) // BLOCK_IDS
    assert Counter(stored.values()) == Counter(
        sum(len(p) // BLOCK_IDS > i for p in prompts) for i in range(len(prompts[-1]) // BLOCK_IDS))
    # Prompt ids held in Redis: the blocks once, plus each sample's tail (less than a block).
    tails = [len(await redis.hget(keys.traj(s), "prompt_ids")) // 4 for s in ids_]
    assert tails == [len(p) % BLOCK_IDS for p in prompts]
    held = len(stored) * BLOCK_IDS + sum(tails)
    assert held == len(prompts[-1]) // BLOCK_IDS * BLOCK_IDS + sum(tails) < len(prompts[-1]) + 4 * BLOCK_IDS
    assert sum(map(len, prompts)) > 2.5 * held  # a plain copy per request would hold every one of them
    await holds_invariants(redis)


async def test_conversations_with_one_system_prompt_share_its_blocks(redis: Redis, store: SampleStore) -> None:
    system = conversation(2, turns=1, first=3 * BLOCK_IDS + 10)[0]
    a, b = system + [1] * 400, system + [2] * 400
    await store.publisher.insert_if_absent([sample("a", a), sample("b", b)])
    refs = sorted((await blocks(redis)).values())
    # 3 shared system blocks (refs 2), then one block of each conversation (refs 1).
    assert refs == [1, 1, 2, 2, 2]
    assert await prompts_read(store, ["a", "b"]) == {"a": a, "b": b}
    await holds_invariants(redis)


async def test_each_deletion_path_releases_its_references(redis: Redis, store: SampleStore) -> None:
    prompts = conversation(3)
    await store.publisher.insert_if_absent([sample(f"d{k}", p, created=T0 + k) for k, p in enumerate(prompts)])
    before = await blocks(redis)

    # Roll-back of a failed publication: the last turn goes, and with it the blocks only it referenced.
    assert await store.deletion.delete_pending(["d3"]) == 1
    after = await blocks(redis)
    assert len(after) == len(prompts[2]) // BLOCK_IDS < len(before)
    assert all(after[h] == before[h] - 1 for h in after if before[h] > 1 and h in after)
    assert await prompts_read(store, ["d0", "d1", "d2"]) == {f"d{k}": prompts[k] for k in range(3)}
    await holds_invariants(redis)

    # Retention: trained samples older than the retention leave, releasing theirs.
    await move(redis, store.line, ["d0", "d1"], "training")
    await move(redis, store.line, ["d0", "d1"], "trained", at=T0)
    assert await store.deletion.sweep_expired(store.line, fence=UNFENCED, retention_seconds=10, now=T0 + 100) == 2
    assert await prompts_read(store, ["d2"]) == {"d2": prompts[2]}
    assert set((await blocks(redis)).values()) == {1}
    await holds_invariants(redis)

    assert await store.deletion.delete_pending(["d2"]) == 1
    assert await blocks(redis) == {}
    await holds_invariants(redis)


async def test_a_reward_policy_drop_releases_its_references(redis: Redis) -> None:
    policy = RewardPolicy(RewardPolicyConfig.model_validate(
        {"sources": {"audit": {"deadline_seconds": 60, "fallback": "drop"}}}))
    store = make_sample_store(redis, model_id=MODEL, reward_policy=policy)
    ledger = RewardLedger(redis, store.line, policy, owner=MODEL)
    prompts = conversation(4, turns=2)
    now = time.time()
    await store.publisher.insert_if_absent([sample("kept", prompts[0], created=now),
                                            sample("dropped", prompts[1], created=now)])
    await ledger.attach("kept", "audit", 1.0)
    assert (await ledger.sweep_due(fence=UNFENCED, now=now + 61)).dropped == 1
    assert not await redis.exists(keys.traj("dropped"))
    assert sorted((await blocks(redis)).values()) == [1] * (len(prompts[0]) // BLOCK_IDS)
    assert await prompts_read(store, ["kept"]) == {"kept": prompts[0]}
    await holds_invariants(redis)


async def test_samples_stored_with_a_plain_prompt_still_read(redis: Redis, store: SampleStore) -> None:
    """A hash written before prefix sharing (whole prompt in `prompt_ids`, no `prompt_blocks`) reads as before and
    is deleted without touching the blocks of a newer sample with the same prefix."""
    prompts = conversation(5, turns=2)
    old = sample("old", prompts[0])
    await redis.hset(keys.traj("old"), mapping={
        "sample_id": "old", "user_id": MODEL, "session_id": "sess-1", "rl_task_id": "", "source": "rl_task",
        "policy_version": "base", "created_at": iso_at(T0), "status": "pending", "updated_at": iso_at(T0),
        "run_id": "", "sample_json": old.meta_blob(), "prompt_ids": pack_ids(prompts[0]),
        "response_ids": pack_ids([7, 8, 9]), "response_logprobs": pack_logprobs([-0.5] * 3),
    })
    await redis.zadd(keys.traj_index(MODEL, "pending"), {"old": T0})
    await redis.hset(keys.traj_stats(MODEL), mapping={"status:pending": 1, "source:rl_task": 1,
                                                       "pending_policy:base": 1})
    await store.publisher.insert_if_absent([sample("new", prompts[1], created=T0 + 1)])
    assert await prompts_read(store, ["old", "new"]) == {"old": prompts[0], "new": prompts[1]}
    assert (await store.documents.detail("old"))["trajectory"]["prompt_ids"] == prompts[0]
    shared = await blocks(redis)
    await holds_invariants(redis)

    assert await store.deletion.delete_pending(["old"]) == 1
    assert await blocks(redis) == shared
    assert await prompts_read(store, ["new"]) == {"new": prompts[1]}
    await holds_invariants(redis)


async def test_a_sample_deleted_between_the_two_reads_is_simply_absent(
    redis: Redis, store: SampleStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = conversation(6, turns=2)
    await store.publisher.insert_if_absent([sample("stays", prompts[0]), sample("goes", prompts[1], created=T0 + 1)])
    real = prompt_blocks.read_blocks
    calls = []

    async def deleting_first(redis_: Redis, digests: Any) -> dict[bytes, bytes | None]:
        calls.append(1)
        if len(calls) == 1:  # the sample's hash was read; now it and its last references disappear
            assert await store.deletion.delete_pending(["goes"]) == 1
        return await real(redis_, digests)

    monkeypatch.setattr(prompt_blocks, "read_blocks", deleting_first)
    assert await prompts_read(store, ["stays", "goes"]) == {"stays": prompts[0]}
    assert len(calls) == 2  # read again once, and found gone
    calls.clear()
    await store.publisher.insert_if_absent([sample("goes", prompts[1], created=T0 + 1)])
    assert await store.documents.detail("goes") is None


async def test_a_missing_block_of_an_existing_sample_is_an_error(redis: Redis, store: SampleStore) -> None:
    prompt = conversation(7, turns=1)[0]
    await store.publisher.insert_if_absent([sample("s", prompt)])
    async for key in redis.scan_iter(match=BLOCK_PATTERN):
        await redis.delete(key)
        break
    with pytest.raises(RuntimeError, match="invariant P"):
        await store.documents.get_documents(["s"])


async def test_concurrent_publications_and_deletions_keep_refcounts_exact(
    redis: Redis, store: SampleStore
) -> None:
    """Racing inserts, roll-backs and sweeps over samples that share blocks: each EXEC moves references with its
    sample, so at the end every block's `refs` equals its referencing samples and the prompts read back exactly."""
    rng = random.Random(9)
    convs = [conversation(10 + i, turns=3, first=400) for i in range(3)]
    prompt_of = {f"c{i}-{k}-{n}": convs[i][k] for i in range(3) for k in range(3) for n in range(3)}
    names = sorted(prompt_of)

    async def worker(seed: int) -> None:
        local = random.Random(seed)
        for _ in range(12):
            picked = local.sample(names, 3)
            if local.random() < 0.6:
                await store.publisher.insert_if_absent(
                    [sample(s, prompt_of[s], created=T0 + names.index(s)) for s in picked])
            else:
                await store.deletion.delete_pending(picked)

    await asyncio.gather(*(worker(rng.randrange(10**6)) for _ in range(6)))
    present = [s for s in names if await sample_status(store.documents, s) is not None]
    assert await prompts_read(store, present) == {s: prompt_of[s] for s in present}
    await holds_invariants(redis)
    await store.deletion.delete_pending(names)
    assert await blocks(redis) == {}


async def test_the_checker_names_each_broken_block(redis: Redis, store: SampleStore) -> None:
    prompts = conversation(11, turns=2, first=3 * BLOCK_IDS)
    await store.publisher.insert_if_absent([sample("x", prompts[0]), sample("y", prompts[1])])
    digests = prompt_blocks.unpack_digests(await redis.hget(keys.traj("y"), "prompt_blocks"))
    shared, own = prompt_blocks.block_key(digests[0]), prompt_blocks.block_key(digests[-1])
    await redis.hincrby(shared, "refs", 1)
    await redis.hset(prompt_blocks.block_key(digests[1]), "ids", b"\x00" * prompt_blocks.BLOCK_BYTES)
    await redis.expire(prompt_blocks.block_key(digests[2]), 600)
    await redis.delete(own)
    stray = b"\x01" * 16
    orphan = prompt_blocks.block_key(stray)
    await redis.hset(orphan, mapping={"ids": b"\x00" * prompt_blocks.BLOCK_BYTES, "refs": 1})
    report = await check_invariants(redis, model_id=MODEL, raise_on_violation=False)
    text = "\n".join(report.violations)
    assert f"prompt block {digests[0].hex()}: refs 3, but 2 sample(s) reference it" in text
    assert "sample x: its prompt blocks do not match their chained digests" in text
    assert f"prompt block {digests[2].hex()} has a TTL" in text
    assert f"sample y references missing prompt block(s) ['{digests[-1].hex()}']" in text
    assert f"prompt block {stray.hex()} is referenced by no sample (refs 1)" in text
    assert len(report.violations) == 5, report.violations


async def test_a_captured_conversation_reads_back_exactly_through_the_service(redis, redis_url, tmp_path) -> None:
    """End to end: three turns of a terminal Task go through `:before`/`:after`, stop and reward; the detail route
    returns each captured prompt exactly, the turns share their blocks, and every invariant holds."""
    request, response = load_fixture("chat_request.json"), load_fixture("chat_response.json")
    prompts = conversation(12, turns=3, first=600, completion=200)
    record = ClientRecord()
    async with running_app(make_config(redis_url, tmp_path)) as (_, client):
        assert (await start_task(client, "s-conv", "tconv")).status_code == 201
        record.task_started("tconv")
        for k, prompt in enumerate(prompts):
            resp = {**response, "prompt_token_ids": prompt,
                    "usage": {**response["usage"], "prompt_tokens": len(prompt),
                              "total_tokens": len(prompt) + response["usage"]["completion_tokens"]}}
            before, after = await capture(client, "tconv", f"conv-{k}", with_user(request, f"turn {k}"), resp)
            assert before.status_code == 200 and after is not None and after.status_code == 204, after
            record.capture_committed("tconv", f"conv-{k}")
        assert (await client.post("/v1/rl/tasks/tconv/stop")).status_code == 200
        record.task_finalized("tconv")
        r = await client.post("/v1/rl/tasks/tconv/reward", json={"reward": 1.0})
        assert r.status_code == 200
        record.reward_acknowledged("tconv", 1.0, r.json()["sample_count"])
        for k, prompt in enumerate(prompts):
            detail = (await client.get(f"/v1/rl/trajectories/conv-{k}")).json()
            assert detail["trajectory"]["prompt_ids"] == prompt == detail["response"]["prompt_token_ids"]
    assert sorted((await blocks(redis)).values(), reverse=True) == [
        sum(len(p) // BLOCK_IDS > i for p in prompts) for i in range(len(prompts[-1]) // BLOCK_IDS)]
    report = await check_invariants(redis, model_id=MODEL_ID, sent=record, raise_on_violation=False)
    assert report.ok and report.client_samples_checked == 3, report.describe()
