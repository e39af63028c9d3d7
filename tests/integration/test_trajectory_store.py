"""The sample store's parts (store/) against a real Redis: stored state, counters, paging, detail, retention, footprint."""

from __future__ import annotations

import base64
import random
from collections import Counter
from datetime import datetime, timezone
from functools import partial
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.common import ids
from openjiuwen.agent_evolving.agent_rl.common.errors import install_error_envelope
from openjiuwen.agent_evolving.agent_rl.online.api.trajectories import build_trajectories_router
from openjiuwen.agent_evolving.agent_rl.online.errors import InvalidInput
from openjiuwen.agent_evolving.agent_rl.online.lineages import LineageRegistry
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.sample_status import SAMPLE_STATUSES
from openjiuwen.agent_evolving.agent_rl.online.store.codec import decode_meta
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from openjiuwen.agent_evolving.agent_rl.online.assembly import SampleStore, make_sample_store
from openjiuwen.agent_evolving.agent_rl.online.store.sample_line import SampleLine
from openjiuwen.agent_evolving.agent_rl.online.store.tx import transact
from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED
from tests.support.samples import sample_status

MODEL = "qwen-test"
T0 = 1_750_000_000.0


def iso_at(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat()


def make_doc(
    sample_id: str,
    *,
    created: float = T0,
    source: str = "rl_task",
    policy_version: str = "base",
    prompt: list[int] | None = None,
    response: list[int] | None = None,
    logprobs: list[float] | None = None,
    response_mask: list[int] | None = None,
) -> dict[str, Any]:
    prompt = [1, 2, 3] if prompt is None else prompt
    response = [4, 5] if response is None else response
    trajectory: dict[str, Any] = {
        "prompt_ids": prompt,
        "response_ids": response,
        "response_logprobs": [-0.5] * len(response) if logprobs is None else logprobs,
        "response_text": "ok",
        "tool_calls": [],
    }
    if response_mask is not None:
        trajectory["response_mask"] = response_mask
    return {
        "sample_id": sample_id,
        "trajectory_id": sample_id,
        "rl_task_id": "task1",
        "task_id": "task1",
        "agent_turn_id": None,
        "session_id": "sess-1",
        "user_id": MODEL,
        "model": MODEL,
        "policy_version": policy_version,
        "source": source,
        "mode": "gateway",
        "io_mode": "gateway",
        "turn_num": 0,
        "created_at": iso_at(created),
        "request": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        "response": {
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(response)},
        },
        "trajectory": trajectory,
        "judge": {"score": 0.5, "source": "terminal"},
    }


def packed(*docs: dict[str, Any]) -> list[PackedSample]:
    return [PackedSample.from_document(d) for d in docs]


@pytest.fixture
def store(redis: Redis) -> SampleStore:
    return make_sample_store(redis, model_id=MODEL)


async def move(redis: Redis, line: SampleLine, sample_ids: list[str], new: str, *, at: float = T0) -> None:
    """Mimics a training-side move (claim, PPO success, restore): hash, indexes and counters in one EXEC."""
    hash_keys = [keys.traj(s) for s in sample_ids]

    async def body(pipe: Any) -> None:
        async with redis.pipeline(transaction=False) as reads:
            for key in hash_keys:
                reads.hmget(key, "status", "policy_version", "created_at")
            rows = await reads.execute()
        pipe.multi()
        for sample_id, (old, version, created) in zip(sample_ids, rows):
            assert old is not None, sample_id
            score = ids.parse_iso_epoch(created.decode()) if new == "pending" else at
            line.queue_move(
                pipe, sample_id, old=old.decode(), new=new, score=score, policy_version=version.decode(),
                at=iso_at(at), run_id="run-000000000001" if new == "training" else None,
            )
        await pipe.execute()

    await transact(redis, body, *hash_keys)


async def stats_hash(redis: Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.traj_stats(MODEL))).items()}


async def index_sizes(redis: Redis) -> dict[str, int]:
    return {s: await redis.zcard(keys.traj_index(MODEL, s)) for s in SAMPLE_STATUSES}


# ---------------------------------------------------------------------------------------------- insert / delete


async def test_insert_writes_hash_index_users_and_counters(redis: Redis, store: SampleStore) -> None:
    docs = [make_doc("c2", created=T0 + 2), make_doc("c1", created=T0 + 1, source="rail", policy_version=f"{MODEL}:v1")]
    assert await store.publisher.insert_if_absent(packed(*docs)) == ["c2", "c1"]

    stored = await redis.hgetall(keys.traj("c1"))
    assert stored[b"status"] == b"pending"
    assert stored[b"sample_id"] == b"c1"
    assert stored[b"source"] == b"rail"
    assert stored[b"policy_version"] == f"{MODEL}:v1".encode()
    assert stored[b"rl_task_id"] == b"task1"
    assert stored[b"created_at"].decode() == iso_at(T0 + 1)
    assert stored[b"run_id"] == b""
    assert stored[b"prompt_ids"] == b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"
    assert len(stored[b"response_logprobs"]) == 8
    meta = decode_meta(stored[b"sample_json"])
    assert "prompt_ids" not in meta["trajectory"] and "response_ids" not in meta["trajectory"]
    assert "status" not in meta  # the status lives only in the hash field

    assert await redis.zrange(keys.traj_index(MODEL, "pending"), 0, -1, withscores=True) == [
        (b"c1", T0 + 1), (b"c2", T0 + 2)
    ]
    assert await redis.smembers(keys.TRAJ_USERS) == {MODEL.encode()}
    assert await stats_hash(redis) == {
        "status:pending": 2, "source:rl_task": 1, "source:rail": 1,
        "pending_policy:base": 1, f"pending_policy:{MODEL}:v1": 1,
    }


async def test_insert_is_idempotent_and_never_resets(redis: Redis, store: SampleStore) -> None:
    assert await store.publisher.insert_if_absent(packed(make_doc("a"), make_doc("b"))) == ["a", "b"]
    await move(redis, store.line, ["a"], "training")
    changed = make_doc("a", source="other")
    changed["judge"] = {"score": 1.0, "source": "terminal"}
    # duplicates inside one call count once; existing samples are skipped whatever their status
    assert await store.publisher.insert_if_absent(packed(changed, make_doc("c"), make_doc("c"), make_doc("b"))) == ["c"]
    assert await store.publisher.insert_if_absent(packed(make_doc("a"), make_doc("b"), make_doc("c"))) == []
    assert await store.publisher.insert_if_absent([]) == []

    assert await sample_status(store.documents, "a") == "training"
    assert decode_meta(await redis.hget(keys.traj("a"), "sample_json"))["judge"]["score"] == 0.5
    assert await index_sizes(redis) == {"pending": 2, "training": 1, "trained": 0, "failed": 0}
    assert await stats_hash(redis) == {
        "status:pending": 2, "status:training": 1, "source:rl_task": 3, "pending_policy:base": 2,
    }


async def test_insert_refuses_a_malformed_sample_id(store: SampleStore) -> None:
    with pytest.raises(ids.InvalidIdentifier):
        await store.publisher.insert_if_absent(packed(make_doc("bad id/..")))


async def test_delete_pending_removes_only_pending_samples(redis: Redis, store: SampleStore) -> None:
    await store.publisher.insert_if_absent(packed(make_doc("a"), make_doc("b", source="rail"), make_doc("c")))
    await move(redis, store.line, ["c"], "training")
    assert await store.deletion.delete_pending(["a", "b", "c", "unknown", "a"]) == 2
    assert await store.deletion.delete_pending(["a"]) == 0
    assert await redis.exists(keys.traj("a"), keys.traj("b")) == 0
    assert await sample_status(store.documents, "c") == "training"
    assert await index_sizes(redis) == {"pending": 0, "training": 1, "trained": 0, "failed": 0}
    stats = await store.stats.stats(store.line)
    assert stats["by_status"] == {"pending": 0, "training": 1, "trained": 0, "failed": 0}
    assert stats["by_source"] == {"rl_task": 1}
    assert stats["total"] == 1


# ---------------------------------------------------------------------------------------------- stats


async def _assert_counters_match(redis: Redis, store: SampleStore) -> None:
    stats = await store.stats.stats(store.line)
    sizes = await index_sizes(redis)
    assert stats["by_status"] == sizes
    assert stats["total"] == sum(sizes.values())
    by_source: Counter[str] = Counter()
    pending_policy: Counter[str] = Counter()
    async for key in redis.scan_iter(match="rl:v1:traj:*", count=1000):
        status, source, version = await redis.hmget(key, "status", "source", "policy_version")
        by_source[source.decode()] += 1
        if status == b"pending":
            pending_policy[version.decode()] += 1
        assert await redis.zscore(keys.traj_index(MODEL, status.decode()), key.decode()[len("rl:v1:traj:"):])
    assert stats["by_source"] == dict(by_source)
    counters = await stats_hash(redis)
    assert all(v >= 0 for v in counters.values())
    prefix = "pending_policy:"
    assert {k[len(prefix):]: v for k, v in counters.items() if k.startswith(prefix) and v} == dict(pending_policy)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_stats_equal_index_sizes_after_a_random_sequence(redis: Redis, store: SampleStore, seed: int) -> None:
    rng = random.Random(seed)
    universe = [f"s{i}" for i in range(40)]
    sources = ["rl_task", "rail"]
    versions = ["base", f"{MODEL}:v1", f"{MODEL}:v2"]
    for step in range(60):
        op = rng.choice(["insert", "insert", "delete", "claim", "finish", "restore", "sweep"])
        statuses = {s: await sample_status(store.documents, s) for s in universe}
        if op == "insert":
            picked = rng.sample(universe, rng.randint(1, 6))
            docs = [
                make_doc(
                    s, created=T0 + rng.randint(0, 5), source=rng.choice(sources), policy_version=rng.choice(versions)
                )
                for s in picked
            ]
            expected = [s for s in dict.fromkeys(picked) if statuses[s] is None]
            assert await store.publisher.insert_if_absent(packed(*docs)) == expected
        elif op == "delete":
            picked = rng.sample(universe, rng.randint(1, 8))
            assert await store.deletion.delete_pending(picked) == sum(statuses[s] == "pending" for s in set(picked))
        elif op == "claim":
            pending = [s for s, st in statuses.items() if st == "pending"]
            if pending:
                await move(redis, store.line, rng.sample(pending, min(len(pending), rng.randint(1, 5))), "training")
        elif op == "finish":
            training = [s for s, st in statuses.items() if st == "training"]
            for s in training:
                await move(redis, store.line, [s], rng.choice(["trained", "failed"]), at=T0 + step)
        elif op == "restore":
            training = [s for s, st in statuses.items() if st == "training"]
            if training:
                await move(redis, store.line, training, "pending")
        else:
            await store.deletion.sweep_expired(store.line, fence=UNFENCED, retention_seconds=10, now=T0 + step,
                                               limit=rng.randint(1, 4))
        await _assert_counters_match(redis, store)


async def test_stats_shape_and_stale_by_policy_lag(redis: Redis) -> None:
    store = make_sample_store(redis, model_id=MODEL, max_policy_lag=1)
    await store.publisher.insert_if_absent(
        packed(
            make_doc("b1", policy_version="base"),
            make_doc("v1", policy_version=f"{MODEL}:v1"),
            make_doc("v2", policy_version=f"{MODEL}:v2"),
            make_doc("v2b", policy_version=f"{MODEL}:v2", source="rail"),
            make_doc("v3", policy_version=f"{MODEL}:v3"),
        )
    )
    stats = await store.stats.stats(store.line)
    assert stats["stale"] == 0  # nothing observed yet
    assert set(stats) == {"total", "by_status", "by_source", "stale", "expired_unrewarded", "updated_at"}
    assert stats["total"] == 5 and stats["by_source"] == {"rail": 1, "rl_task": 4}
    assert stats["expired_unrewarded"] == 0
    assert ids.parse_iso_epoch(stats["updated_at"]) > 0

    observed = {"lora_name": f"{MODEL}:v3", "lora_path": "/x/v3", "at": iso_at(T0)}
    await redis.set(keys.POLICY_OBSERVED, orjson.dumps(observed))
    await redis.hincrby(keys.traj_stats(MODEL), "expired_unrewarded", 4)
    stats = await store.stats.stats(store.line)
    assert stats["stale"] == 2  # base (lag 3) and v1 (lag 2); v2 (lag 1) and v3 (lag 0) are eligible
    assert stats["expired_unrewarded"] == 4
    await move(redis, store.line, ["b1"], "training")  # only pending samples can be stale
    assert (await store.stats.stats(store.line))["stale"] == 1
    unlimited = make_sample_store(redis, model_id=MODEL)
    assert (await unlimited.stats.stats(unlimited.line))["stale"] == 0  # no limit set


# ---------------------------------------------------------------------------------------------- paging


async def _collect(store: SampleStore, status: str | None, limit: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    for _ in range(10_000):
        page = await store.listing.list_page(store.line, status, limit, cursor)
        assert len(page["items"]) <= limit
        items.extend(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            return items
        assert len(page["items"]) == limit  # only the last page may be short
    raise AssertionError("paging never ended")


async def test_paging_2500_samples_with_equal_scores(redis: Redis, store: SampleStore) -> None:
    rng = random.Random(7)
    names = [f"s{rng.randrange(10**9):09d}-{i}" for i in range(2500)]
    created = {name: T0 + rng.randrange(20) for name in names}  # ~125 samples share each created_at
    for start in range(0, len(names), 500):
        chunk = packed(*(make_doc(n, created=created[n]) for n in names[start:start + 500]))
        assert len(await store.publisher.insert_if_absent(chunk)) == 500
    shuffled = names[:]
    rng.shuffle(shuffled)
    groups = {"training": shuffled[:400], "trained": shuffled[400:800], "failed": shuffled[800:1000]}
    for status, members in groups.items():
        await move(redis, store.line, members, "training")
        if status != "training":
            for n, start in enumerate(range(0, len(members), 100)):
                await move(redis, store.line, members[start:start + 100], status, at=T0 + 100 + n % 2)
    status_of = {n: "pending" for n in names} | {n: s for s, ms in groups.items() for n in ms}
    score_of = {n: created[n] for n in names}
    score_of |= {n: T0 for n in groups["training"]}  # the move helper scores training at `at` = T0
    for status in ("trained", "failed"):
        members = groups[status]
        for n, start in enumerate(range(0, len(members), 100)):
            score_of |= {m: T0 + 100 + n % 2 for m in members[start:start + 100]}

    def expected(status: str) -> list[str]:
        return sorted((n for n in names if status_of[n] == status), key=lambda n: (score_of[n], n))

    everything = [n for s in SAMPLE_STATUSES for n in expected(s)]
    listed = await _collect(store, None, 97)
    assert [i["sample_id"] for i in listed] == everything  # no duplicate, no gap, bucket order then (score, id)
    for status, limit in (("pending", 100), ("training", 1000), ("trained", 7), ("failed", 200)):
        assert [i["sample_id"] for i in await _collect(store, status, limit)] == expected(status)

    item = listed[0]
    assert set(item) == {
        "trajectory_id", "sample_id", "model_id", "source", "status", "user_id", "session_id", "task_id",
        "policy_version", "sampling", "created_at", "updated_at", "instance", "exclusion",
    }
    assert item["sampling"] is None  # these documents carry no sampling record (rail-like)
    assert item["exclusion"] is None  # nothing keeps them out of training
    assert (item["model_id"], item["status"]) == (MODEL, "pending")
    assert (item["task_id"], item["session_id"]) == ("task1", "sess-1")
    assert item["created_at"] == iso_at(created[item["sample_id"]])


async def test_cursor_survives_its_sample_leaving_the_bucket(redis: Redis, store: SampleStore) -> None:
    names = [f"x{i:03d}" for i in range(30)]
    await store.publisher.insert_if_absent(packed(*(make_doc(n, created=T0 + (i // 10)) for i, n in enumerate(names))))
    page = await store.listing.list_page(store.line, "pending", 15, None)
    assert [i["sample_id"] for i in page["items"]] == names[:15]
    await move(redis, store.line, ["x014", "x013"], "training")  # the cursor's sample and its neighbour leave
    rest = await store.listing.list_page(store.line, "pending", 100, page["next_cursor"])
    assert [i["sample_id"] for i in rest["items"]] == names[15:]
    assert rest["next_cursor"] is None


async def test_empty_store_lists_nothing(store: SampleStore) -> None:
    assert await store.listing.list_page(store.line, None, 100, None) == {"items": [], "next_cursor": None}
    assert await store.listing.list_page(store.line, "failed", 1, None) == {"items": [], "next_cursor": None}


async def test_limit_status_and_cursor_validation(store: SampleStore) -> None:
    await store.publisher.insert_if_absent(packed(make_doc("a"), make_doc("b"), make_doc("c")))
    cursor = (await store.listing.list_page(store.line, "pending", 1, None))["next_cursor"]
    all_cursor = (await store.listing.list_page(store.line, None, 1, None))["next_cursor"]
    assert cursor and all_cursor
    for limit in (0, 1001, -1, True):
        with pytest.raises(InvalidInput) as err:
            await store.listing.list_page(store.line, None, limit, None)
        assert err.value.code == "invalid_request"
    forged = [
        "!!!", "", "x" * 2000, base64.urlsafe_b64encode(b"{}").decode(),
        base64.urlsafe_b64encode(orjson.dumps(["pending", "pending", "NaN", "a"])).decode(),
        base64.urlsafe_b64encode(orjson.dumps(["pending", "pending", 1.0, "bad id"])).decode(),
        base64.urlsafe_b64encode(orjson.dumps(["pending", "nope", 1.0, "a"])).decode(),
    ]
    for bad in forged:
        with pytest.raises(InvalidInput):
            await store.listing.list_page(store.line, "pending", 10, bad)
    for status, bad in (("trained", cursor), (None, cursor), ("pending", all_cursor)):  # made for another status
        with pytest.raises(InvalidInput):
            await store.listing.list_page(store.line, status, 10, bad)
    with pytest.raises(InvalidInput):
        await store.listing.list_page(store.line, "done", 10, None)
    page = partial(store.listing.list_page, store.line)
    assert [i["sample_id"] for i in (await page("pending", 10, cursor))["items"]] == ["b", "c"]
    assert [i["sample_id"] for i in (await page(None, 10, all_cursor))["items"]] == ["b", "c"]


# ---------------------------------------------------------------------------------------------- detail, helpers


async def test_detail_reassembles_the_full_view(redis: Redis, store: SampleStore) -> None:
    prompt = [10, 11, 12, 2**32 - 1]
    response = [20, 21, 22]
    logprobs = [-0.5, -0.25, -0.125]  # exact in float32
    doc = make_doc("d1", prompt=prompt, response=response, logprobs=logprobs, response_mask=[1, 0, 1])
    await store.publisher.insert_if_absent(
        packed(doc, make_doc("d2", prompt=[1], response=[2, 3], logprobs=[-1.0, -2.0])))

    view = await store.documents.detail("d1")
    assert view is not None
    trajectory = view["trajectory"]
    assert trajectory["prompt_ids"] == prompt
    assert trajectory["response_ids"] == response
    assert trajectory["response_logprobs"] == logprobs
    assert trajectory["input_ids"] == prompt + response
    assert trajectory["attention_mask"] == [1] * 7
    assert trajectory["response_mask"] == [0, 0, 0, 0, 1, 0, 1]
    assert trajectory["prompt_text"] == ""
    assert view["response"]["prompt_token_ids"] == prompt
    choice = view["response"]["choices"][0]
    assert choice["token_ids"] == response
    assert choice["logprobs"] == {"content": [{"logprob": x} for x in logprobs]}
    assert choice["message"] == {"role": "assistant", "content": "ok"}
    assert (view["trajectory_id"], view["status"], view["_store_status"]) == ("d1", "pending", "pending")
    assert view["request"] == doc["request"] and view["judge"] == doc["judge"]

    other = await store.documents.detail("d2")
    assert other is not None and other["trajectory"]["response_mask"] == [0, 1, 1]
    await move(redis, store.line, ["d2"], "training")
    assert (await store.documents.detail("d2"))["status"] == "training"  # type: ignore[index]

    assert await store.documents.detail("missing") is None
    assert await store.documents.detail("../etc") is None
    assert await store.documents.detail("") is None

    docs = await store.documents.get_documents(["d2", "missing", "d1"])
    assert [d["sample_id"] for d in docs] == ["d2", "d1"]
    assert docs[1]["trajectory"]["prompt_ids"] == prompt and docs[1]["trajectory"]["response_mask"] == [1, 0, 1]
    documents = store.documents
    assert await sample_status(documents, "missing") is None and await sample_status(documents, "no/such") is None


# ---------------------------------------------------------------------------------------------- retention


async def test_sweep_removes_only_old_trained_and_failed(redis: Redis, store: SampleStore) -> None:
    old, new = T0, T0 + 1000
    await store.publisher.insert_if_absent(
        packed(*(make_doc(n, created=T0 - 10_000) for n in ("p", "t", "tr_old", "tr_new", "f_old", "f_old2", "f_new")))
    )
    await move(redis, store.line, ["t", "tr_old", "tr_new", "f_old", "f_old2", "f_new"], "training", at=old)
    await move(redis, store.line, ["tr_old"], "trained", at=old)
    await move(redis, store.line, ["tr_new"], "trained", at=new)
    await move(redis, store.line, ["f_old", "f_old2"], "failed", at=old)
    await move(redis, store.line, ["f_new"], "failed", at=new)

    # one per status per call
    sweep = partial(store.deletion.sweep_expired, store.line, fence=UNFENCED)
    assert await sweep(retention_seconds=500, now=T0 + 1200, limit=1) == 2
    assert await sweep(retention_seconds=500, now=T0 + 1200) == 1
    assert await sweep(retention_seconds=500, now=T0 + 1200) == 0
    for gone in ("tr_old", "f_old", "f_old2"):
        assert not await redis.exists(keys.traj(gone))
    assert {n: await sample_status(store.documents, n) for n in ("p", "t", "tr_new", "f_new")} == {
        "p": "pending", "t": "training", "tr_new": "trained", "f_new": "failed"
    }
    assert await index_sizes(redis) == {"pending": 1, "training": 1, "trained": 1, "failed": 1}
    await _assert_counters_match(redis, store)
    # pending and training samples never expire, however old
    assert await store.deletion.sweep_expired(store.line, fence=UNFENCED, retention_seconds=1, now=T0 + 10**9) == 2
    assert await index_sizes(redis) == {"pending": 1, "training": 1, "trained": 0, "failed": 0}


# ---------------------------------------------------------------------------------------------- footprint


async def test_redis_bytes_per_token_of_a_4096_token_sample(redis: Redis, store: SampleStore) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(150_000) for _ in range(2048)]
    response = [rng.randrange(150_000) for _ in range(2048)]
    logprobs = [-rng.random() * 5 for _ in range(2048)]
    await store.publisher.insert_if_absent(packed(make_doc("big", prompt=prompt, response=response, logprobs=logprobs)))
    usage = await redis.memory_usage(keys.traj("big"), samples=0)  # every field, not an extrapolated sample
    assert usage is not None and usage / 4096 <= 24
    docs = await store.documents.get_documents(["big"])
    assert docs[0]["trajectory"]["response_ids"] == response


# ---------------------------------------------------------------------------------------------- routes


@pytest.fixture
async def client(redis: Redis, store: SampleStore) -> Any:
    app = FastAPI()
    install_error_envelope(app)
    # The registry answers only `exists` here (`?lineage=`); the run reads behind it are never used.
    app.include_router(build_trajectories_router(
        store.line, LineageRegistry(redis, model_id=MODEL, runs=None), stats=store.stats, listing=store.listing,
        documents=store.documents, exclusion=store.exclusion,
    ))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://rl") as c:
        yield c


async def test_routes(client: httpx.AsyncClient, store: SampleStore) -> None:
    await store.publisher.insert_if_absent(packed(make_doc("a", created=T0 + 1), make_doc("b", created=T0 + 2)))
    stats = await client.get("/v1/rl/trajectories/stats")
    assert stats.status_code == 200 and stats.json()["by_status"]["pending"] == 2

    first = await client.get("/v1/rl/trajectories", params={"limit": "1", "status": "pending"})
    assert first.status_code == 200
    body = first.json()
    assert [i["sample_id"] for i in body["items"]] == ["a"] and body["next_cursor"]
    params = {"limit": "1", "status": "pending", "cursor": body["next_cursor"]}
    second = await client.get("/v1/rl/trajectories", params=params)
    assert [i["sample_id"] for i in second.json()["items"]] == ["b"] and second.json()["next_cursor"] is None
    default = await client.get("/v1/rl/trajectories")
    assert len(default.json()["items"]) == 2 and default.json()["next_cursor"] is None

    for params in ({"limit": "0"}, {"limit": "1001"}, {"limit": "x"}, {"limit": "1.5"}, {"limit": "-1"},
                   {"status": "done"}, {"cursor": "garbage!"}, {"status": "trained", "cursor": body["next_cursor"]}):
        resp = await client.get("/v1/rl/trajectories", params=params)
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_request"), params

    detail = await client.get("/v1/rl/trajectories/a")
    assert detail.status_code == 200 and detail.json()["trajectory"]["input_ids"] == [1, 2, 3, 4, 5]
    for unknown in ("/v1/rl/trajectories/nope", "/v1/rl/trajectories/a%20b"):
        resp = await client.get(unknown)
        assert resp.status_code == 404
        assert resp.json() == {"error": {"code": "trajectory_not_found", "message": "trajectory not found"}}
