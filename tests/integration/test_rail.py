"""rail-v1 ingestion against a real Redis: validation, staging with TTLs, atomic pops, judging, stored samples."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.common.errors import install_error_envelope
from openjiuwen.agent_evolving.agent_rl.online.api.rail import build_rail_router
from openjiuwen.agent_evolving.agent_rl.online.errors import InvalidInput, JudgeFailed
from openjiuwen.agent_evolving.agent_rl.online.rail_ingest.ingest import RailIngestor
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from openjiuwen.agent_evolving.agent_rl.online.assembly import SampleStore, make_sample_store
from tests.support.samples import sample_status

MODEL = "qwen-test"
RETENTION_S = 3600
SESSION = "sess-1"
TRAJ = "traj-1"


@dataclass
class FakeResult:
    score: float

    def as_sample_judge(self, tag: str) -> dict[str, Any]:
        return {
            "score": self.score, "source": "judge", "tag": tag, "votes": [self.score * 10],
            "judge_model": "fake-judge", "prompt_version": "judge-v1",
        }


class FakeJudge:
    """Scores every reply 0.8, fails for replies listed in `fail_on`; records (reply, feedback) per call."""

    def __init__(self, fail_on: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[str, str]] = []
        self.requests: list[dict[str, Any]] = []
        self.fail_on = set(fail_on)

    async def score(self, request: dict[str, Any], response: dict[str, Any], feedback: str) -> FakeResult:
        reply = response["choices"][0]["message"]["content"]
        self.calls.append((reply, feedback))
        self.requests.append(request)
        await asyncio.sleep(0)  # let concurrent uploads interleave
        if reply in self.fail_on:
            raise JudgeFailed("fewer than 2 judge votes succeeded")
        return FakeResult(0.8)


def rail_sample(step: int | None = None, **overrides: Any) -> dict[str, Any]:
    n = 0 if step is None else step
    sample: dict[str, Any] = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {n}"}],
        "prompt_ids": [100 + n, 101, 102],
        "response_tokens": [200 + n, 201],
        "logprobs": [-0.5, -0.25],
        "response": {"content": f"reply {n}", "finish_reason": "stop"},
        "tools": [],
    }
    if step is not None:
        sample["step_index"] = step
    sample.update(overrides)
    return sample


def batch(*samples: dict[str, Any], **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "protocol_version": "rail-v1", "session_id": SESSION, "trajectory_id": TRAJ, "samples": list(samples),
    }
    body.update(fields)
    return body


@pytest.fixture
def store(redis: Redis) -> SampleStore:
    return make_sample_store(redis, model_id=MODEL)


@pytest.fixture
def judge() -> FakeJudge:
    return FakeJudge()


@pytest.fixture
def ingestor(redis: Redis, store: SampleStore, judge: FakeJudge) -> RailIngestor:
    return RailIngestor(redis, store.publisher, judge, model_id=MODEL, retention_seconds=RETENTION_S)


async def staged_members(redis: Redis) -> list[str]:
    return [m.decode() for m in await redis.zrange(keys.pending_judge_session(SESSION), 0, -1)]


async def pending_ids(redis: Redis) -> list[str]:
    return sorted(m.decode() for m in await redis.zrange(keys.traj_index(MODEL, "pending"), 0, -1))


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"protocol_version": "rail-v2"}, "protocol_version must be 'rail-v1'"),
        ({"session_id": "bad session"}, "session_id must match"),
        ({"trajectory_id": "x" * 129}, "trajectory_id must match"),
        ({"trajectory_id": None}, "trajectory_id must match"),
        ({"samples": {"0": {}}}, "samples must be a list"),
        ({"session_done": "yes"}, "session_done must be a boolean"),
        ({"trajectory_meta": []}, "trajectory_meta must be an object"),
        ({"prev_feedback": 5}, "prev_feedback must be"),
        ({"user_id": 7}, "user_id must be a string"),
        ({"model_id": "other-model"}, "model_id does not match"),
    ],
)
async def test_batch_level_errors(ingestor: RailIngestor, redis: Redis, change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput) as err:
        await ingestor.ingest(batch(rail_sample(0)) | change)
    assert err.value.code == "invalid_rail_batch"
    assert message in err.value.message
    assert await staged_members(redis) == []


async def test_missing_fields_are_named(ingestor: RailIngestor) -> None:
    for name in ("session_id", "trajectory_id", "samples"):
        body = batch(rail_sample(0))
        del body[name]
        with pytest.raises(InvalidInput, match=f"missing field: {name}"):
            await ingestor.ingest(body)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"messages": []}, "samples[0].messages must be a non-empty list"),
        ({"messages": ["hi"]}, "samples[0].messages must be a non-empty list"),
        ({"prompt_ids": [1, True]}, "samples[0].prompt_ids must be a list of integers"),
        ({"prompt_ids": [-1]}, "samples[0].prompt_ids must be a list of integers"),
        ({"response_tokens": [2**32]}, "samples[0].response_tokens must be a list of integers"),
        ({"response_tokens": "1 2"}, "samples[0].response_tokens must be a list of integers"),
        ({"logprobs": [-0.1, math.nan]}, "samples[0].logprobs must be a list of finite numbers"),
        ({"logprobs": [-0.1, False]}, "samples[0].logprobs must be a list of finite numbers"),
        ({"response_mask": [1]}, "samples[0].response_mask must have as many entries"),
        ({"response_mask": [1, 2]}, "samples[0].response_mask must be a list of 0 and 1"),
        ({"step_index": -1}, "samples[0].step_index must be an integer"),
        ({"step_index": True}, "samples[0].step_index must be an integer"),
        ({"tools": {}}, "samples[0].tools must be a list"),
        ({"response": "text"}, "samples[0].response must be an object"),
        (
            {"render_fingerprint": "a", "render_fingerprint_expected": "b"},
            "samples[0].render_fingerprint does not match",
        ),
    ],
)
async def test_every_sample_rejected_is_a_400_with_the_first_error(
    ingestor: RailIngestor, judge: FakeJudge, redis: Redis, override: dict[str, Any], message: str
) -> None:
    await ingestor.ingest(batch(rail_sample(0)))  # something staged that a bad batch must not pop
    bad = rail_sample(None) | override  # no step_index: the position (0) is used
    with pytest.raises(InvalidInput) as err:
        await ingestor.ingest(batch(bad, rail_sample(5, messages=[]), prev_feedback="ok", session_done=True))
    assert err.value.code == "invalid_rail_batch"
    assert err.value.message.startswith(message)
    assert judge.calls == []  # no pop happened
    assert await staged_members(redis) == [f"{TRAJ}:0"]


async def test_missing_arrays_are_named(ingestor: RailIngestor) -> None:
    for name in ("prompt_ids", "response_tokens", "logprobs"):
        sample = rail_sample(0)
        del sample[name]
        with pytest.raises(InvalidInput, match=f"missing field: {name}"):
            await ingestor.ingest(batch(sample))


async def test_partially_valid_batch_reports_rejections(ingestor: RailIngestor, redis: Redis) -> None:
    result = await ingestor.ingest(batch(rail_sample(0), rail_sample(1, prompt_ids="x"), rail_sample(0)))
    assert (result["accepted"], result["rejected"]) == (1, 2)
    assert [e["sample_id"] for e in result["errors"]] == [f"{TRAJ}:1", f"{TRAJ}:0"]
    assert "repeats an earlier sample" in result["errors"][1]["error"]
    assert await staged_members(redis) == [f"{TRAJ}:0"]


async def test_no_judge_is_refused(redis: Redis, store: SampleStore) -> None:
    ingestor = RailIngestor(redis, store.publisher, None, model_id=MODEL, retention_seconds=RETENTION_S)
    with pytest.raises(InvalidInput) as err:
        await ingestor.ingest(batch(rail_sample(0)))
    assert err.value.code == "judge_not_configured"
    assert await staged_members(redis) == []


# ---------------------------------------------------------------------------------------------- staging


async def test_staging_builds_the_sample_document_with_ttls(ingestor: RailIngestor, redis: Redis) -> None:
    result = await ingestor.ingest(
        batch(
            rail_sample(3, logprobs=[-0.5], response_mask=[1, 1], meta={"routed_experts": [[1, 2]], "k": "v"}),
            rail_sample(None, logprobs=[-0.5, -0.25, -1.0], response_mask=[0, 1], response_text="shown"),
            user_id="alice", tenant_id="acme", model_id=MODEL, instruction_text="do it",
            trajectory_meta={"policy_version": f"{MODEL}:v2", "agent": "a1"},
        )
    )
    assert result == {
        "protocol_version": "rail-v1", "session_id": SESSION, "trajectory_id": TRAJ, "accepted": 2, "rejected": 0,
        "judged": 0, "judge_failed": 0, "session_flushed": 0, "errors": [],
    }
    assert await staged_members(redis) == [f"{TRAJ}:3", f"{TRAJ}:1"]  # batch order, not member order
    staging_keys = (
        keys.pending_judge(SESSION, TRAJ, 3), keys.pending_judge(SESSION, TRAJ, 1), keys.pending_judge_session(SESSION)
    )
    for key in staging_keys:
        assert 0 < await redis.ttl(key) <= RETENTION_S

    first = PackedSample.decode_staged(await redis.get(keys.pending_judge(SESSION, TRAJ, 3))).to_document()
    assert first["sample_id"] == first["trajectory_id"] == f"{TRAJ}:3"
    assert (first["source"], first["mode"], first["io_mode"], first["turn_num"]) == ("rail", "rail-v1", "rail", 4)
    assert (first["rl_task_id"], first["task_id"], first["session_id"]) == (None, None, SESSION)
    assert first["user_id"] == first["model"] == MODEL  # owner forced
    assert first["policy_version"] == f"{MODEL}:v2"
    assert first["request"] == {"messages": rail_sample(3)["messages"], "tools": []}
    assert first["response"]["choices"][0]["message"] == {"role": "assistant", "content": "reply 3"}
    trajectory = first["trajectory"]
    assert trajectory["prompt_ids"] == [103, 101, 102]
    assert trajectory["response_ids"] == [203, 201]
    assert trajectory["response_logprobs"] == [-0.5, 0.0]  # zero-padded to the response length
    assert "response_mask" not in trajectory  # all ones is not stored
    assert trajectory["routed_experts"] == [[1, 2]]
    assert trajectory["response_text"] == "reply 3"
    assert first["rail_meta"] == {
        "protocol_version": "rail-v1", "user_id": "alice", "tenant_id": "acme",
        "sample_meta": {"routed_experts": [[1, 2]], "k": "v"},
        "trajectory_meta": {"policy_version": f"{MODEL}:v2", "agent": "a1"}, "instruction_text": "do it",
    }
    second = PackedSample.decode_staged(await redis.get(keys.pending_judge(SESSION, TRAJ, 1))).to_document()
    assert second["trajectory"]["response_logprobs"] == [-0.5, -0.25]  # truncated
    assert second["trajectory"]["response_mask"] == [0, 1]
    assert second["trajectory"]["response_text"] == "shown"
    assert await redis.exists(keys.traj(f"{TRAJ}:3")) == 0  # nothing stored before judging


async def test_unknown_policy_version_becomes_base(ingestor: RailIngestor, redis: Redis) -> None:
    for n, meta in enumerate(({"policy_version": "other:v1"}, {"policy_version": f"{MODEL}:v0"}, {})):
        await ingestor.ingest(batch(rail_sample(n), trajectory_meta=meta))
    await ingestor.ingest(batch(session_done=True))
    for n in range(3):
        assert await redis.hget(keys.traj(f"{TRAJ}:{n}"), "policy_version") == b"base"


# ---------------------------------------------------------------------------------------------- judging


async def test_prev_feedback_judges_the_earliest_staged_sample(
    ingestor: RailIngestor, judge: FakeJudge, redis: Redis, store: SampleStore
) -> None:
    await ingestor.ingest(batch(rail_sample(0), rail_sample(1)))
    await ingestor.ingest(batch(rail_sample(2), trajectory_id="traj-2"))
    result = await ingestor.ingest(batch(rail_sample(3), prev_feedback={"raw_user_text": "great, thanks"}))
    assert (result["accepted"], result["judged"], result["judge_failed"]) == (1, 1, 0)
    assert judge.calls == [("reply 0", "great, thanks")]
    assert judge.requests[0] == {"messages": rail_sample(0)["messages"], "tools": []}
    assert await pending_ids(redis) == [f"{TRAJ}:0"]
    assert await staged_members(redis) == [f"{TRAJ}:1", "traj-2:2", f"{TRAJ}:3"]
    assert await redis.exists(keys.pending_judge(SESSION, TRAJ, 0)) == 0

    doc = (await store.documents.get_documents([f"{TRAJ}:0"]))[0]
    assert doc["judge"] == FakeResult(0.8).as_sample_judge("prev_feedback")
    assert doc["trajectory"]["response_ids"] == [200, 201]
    assert await sample_status(store.documents, f"{TRAJ}:0") == "pending"

    for feedback in ("plain text", {"text": "t"}, {"feedback": "f"}):
        await ingestor.ingest(batch(prev_feedback=feedback))
    assert judge.calls[1:] == [("reply 1", "plain text"), ("reply 2", "t"), ("reply 3", "f")]
    empty = await ingestor.ingest(batch(prev_feedback="nothing left"))
    assert (empty["judged"], len(judge.calls)) == (0, 4)


async def test_session_done_flushes_every_staged_sample(
    ingestor: RailIngestor, judge: FakeJudge, redis: Redis, store: SampleStore
) -> None:
    await ingestor.ingest(batch(rail_sample(0), rail_sample(1)))
    result = await ingestor.ingest(batch(rail_sample(2), session_done=True))
    assert (result["accepted"], result["judged"], result["session_flushed"]) == (1, 3, 3)
    assert sorted(judge.calls) == [("reply 0", ""), ("reply 1", ""), ("reply 2", "")]
    documents = await store.documents.get_documents([f"{TRAJ}:{n}" for n in range(3)])
    tags = {d["sample_id"]: d["judge"]["tag"] for d in documents}
    assert tags == {f"{TRAJ}:0": "session_flush", f"{TRAJ}:1": "session_flush", f"{TRAJ}:2": "session_done"}
    assert await staged_members(redis) == []
    assert await redis.exists(*(keys.pending_judge(SESSION, TRAJ, n) for n in range(3))) == 0
    stats = await store.stats.stats(store.line)
    assert stats["by_status"]["pending"] == 3 and stats["by_source"] == {"rail": 3}

    # a retried upload of stored samples is accepted but neither staged nor judged again
    again = await ingestor.ingest(batch(rail_sample(2), session_done=True))
    assert (again["accepted"], again["judged"], again["session_flushed"]) == (1, 0, 0)
    assert len(judge.calls) == 3


async def test_judge_failures_are_reported_and_not_stored(redis: Redis, store: SampleStore) -> None:
    judge = FakeJudge(fail_on=("reply 0", "reply 2"))
    ingestor = RailIngestor(redis, store.publisher, judge, model_id=MODEL, retention_seconds=RETENTION_S)
    await ingestor.ingest(batch(rail_sample(0), rail_sample(1), rail_sample(2)))
    first = await ingestor.ingest(batch(prev_feedback="meh"))
    assert (first["judged"], first["judge_failed"]) == (0, 1)
    assert first["errors"] == [{"sample_id": f"{TRAJ}:0", "error": "judge failed: fewer than 2 judge votes succeeded"}]
    done = await ingestor.ingest(batch(session_done=True))
    assert (done["judged"], done["judge_failed"], done["session_flushed"]) == (1, 1, 2)
    assert [e["sample_id"] for e in done["errors"]] == [f"{TRAJ}:2"]
    assert await pending_ids(redis) == [f"{TRAJ}:1"]
    assert await redis.exists(keys.traj(f"{TRAJ}:0"), keys.traj(f"{TRAJ}:2")) == 0
    assert await staged_members(redis) == []


async def test_concurrent_prev_feedback_pops_judge_each_sample_once(
    ingestor: RailIngestor, judge: FakeJudge, redis: Redis
) -> None:
    await ingestor.ingest(batch(*(rail_sample(n) for n in range(6))))
    results = await asyncio.gather(*(ingestor.ingest(batch(prev_feedback=f"fb{n}")) for n in range(8)))
    assert sum(r["judged"] for r in results) == 6
    replies = [reply for reply, _ in judge.calls]
    assert sorted(replies) == sorted(f"reply {n}" for n in range(6))  # each judged exactly once
    assert await pending_ids(redis) == sorted(f"{TRAJ}:{n}" for n in range(6))
    assert await staged_members(redis) == []


async def test_concurrent_session_done_flushes_once(ingestor: RailIngestor, judge: FakeJudge, redis: Redis) -> None:
    await ingestor.ingest(batch(*(rail_sample(n) for n in range(4))))
    results = await asyncio.gather(*(ingestor.ingest(batch(session_done=True)) for _ in range(4)))
    assert sorted(r["session_flushed"] for r in results) == [0, 0, 0, 4]
    assert len(judge.calls) == 4
    assert len(await pending_ids(redis)) == 4


async def test_expired_staged_sample_is_skipped_by_prev_feedback(
    ingestor: RailIngestor, judge: FakeJudge, redis: Redis
) -> None:
    await ingestor.ingest(batch(rail_sample(0), rail_sample(1)))
    await redis.delete(keys.pending_judge(SESSION, TRAJ, 0))  # as if its TTL had run out
    result = await ingestor.ingest(batch(prev_feedback="next"))
    assert result["judged"] == 1 and judge.calls == [("reply 1", "next")]
    assert await staged_members(redis) == []


# ---------------------------------------------------------------------------------------------- route


def rail_client(ingestor: RailIngestor) -> httpx.AsyncClient:
    app = FastAPI()
    install_error_envelope(app)
    app.include_router(build_rail_router(ingestor))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://rl")


@pytest.fixture
async def client(ingestor: RailIngestor) -> Any:
    async with rail_client(ingestor) as c:
        yield c


async def test_upload_route(client: httpx.AsyncClient, redis: Redis, store: SampleStore) -> None:
    ok = await client.post("/v1/gateway/upload/batch", json=batch(rail_sample(0), user_id="bob", session_done=True))
    assert ok.status_code == 200
    assert ok.json() == {
        "ok": True,
        "result": {
            "protocol_version": "rail-v1", "session_id": SESSION, "trajectory_id": TRAJ, "accepted": 1,
            "rejected": 0, "judged": 1, "judge_failed": 0, "session_flushed": 1, "errors": [],
        },
    }
    assert await redis.hget(keys.traj(f"{TRAJ}:0"), "user_id") == MODEL.encode()  # owner forced

    mismatch = await client.post("/v1/gateway/upload/batch", json=batch(rail_sample(1), model_id="other"))
    assert (mismatch.status_code, mismatch.json()["error"]["code"]) == (400, "invalid_rail_batch")
    rejected = await client.post("/v1/gateway/upload/batch", json=batch(rail_sample(1, messages=[])))
    assert rejected.status_code == 400
    assert rejected.json()["error"] == {
        "code": "invalid_rail_batch", "message": "samples[0].messages must be a non-empty list of objects"
    }
    for raw in (b"[1]", b"{bad", b""):
        resp = await client.post("/v1/gateway/upload/batch", content=raw, headers={"content-type": "application/json"})
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_request")

    bare_ingestor = RailIngestor(redis, store.publisher, None, model_id=MODEL, retention_seconds=RETENTION_S)
    async with rail_client(bare_ingestor) as bare:
        no_judge = await bare.post("/v1/gateway/upload/batch", json=batch(rail_sample(1)))
    assert (no_judge.status_code, no_judge.json()["error"]["code"]) == (400, "judge_not_configured")
    assert orjson.loads(no_judge.content)["error"]["message"]

