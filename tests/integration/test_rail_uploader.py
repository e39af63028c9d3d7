"""The agent-side rail library (`agent_rl/rail/`) against the real RL Service process with a fake Judge: an agent
loop through RLOnlineRail, back-pressure, retries with backoff, 4xx never retried, close without flush.

A `Relay` (a small starlette app on a real socket) sits between the uploader and the service where a test needs to
hold, fail or count attempts; otherwise it forwards each request unchanged."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from openjiuwen.agent_evolving.agent_rl.common.signing_keys import SigningKey
from openjiuwen.agent_evolving.agent_rl.gateway.auth.hmac_auth import Caller, HmacVerifier, KeyRole
from openjiuwen.agent_evolving.agent_rl.rail import RLOnlineRail, TrajectoryUploader, UploaderClosed
from openjiuwen.agent_evolving.agent_rl.rail.uploader import UPLOAD_PATH
from tests.support.asgi_server import ThreadedServer
from tests.support.fake_judge import FakeJudge, Gate, Status
from tests.support.service_process import ServiceProcess

TOKEN = "rail-uploader-test-token"
SIGN_KEY = SigningKey(b"s" * 32, "rail-bot")  # the agent's own key (the operator key is refused)


@pytest.fixture(scope="module")
def judge() -> Iterator[FakeJudge]:
    with FakeJudge() as fake:
        yield fake


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_url: str, judge: FakeJudge) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("rail-uploader"), redis_url, env={"RL_SERVICE_TOKEN": TOKEN},
                        judge_endpoint=judge.url, judge_model="judge", judge_retries=0, judge_timeout=5.0) as svc:
        yield svc


# ---------------------------------------------------------------------------------------------- the relay


@dataclass(frozen=True)
class Answer:
    """Answer this status with an error envelope instead of forwarding."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Hold:
    """Wait for `gate`, then answer `then` (None: forward)."""

    gate: Gate
    then: Answer | None = None


@dataclass(frozen=True)
class Seen:
    at: float  # time.monotonic() on arrival
    headers: dict[str, str]
    body: bytes


class Relay:
    def __init__(self, target: str) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._script: deque[Answer | Hold] = deque()
        self._seen: list[Seen] = []
        self._server = ThreadedServer(Starlette(routes=[Route(UPLOAD_PATH, self._handle, methods=["POST"])]),
                                      name="rail-relay")

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def enqueue(self, *behaviours: Answer | Hold) -> None:
        with self._lock:
            self._script.extend(behaviours)

    async def wait_for(self, count: int, timeout_s: float = 10.0) -> None:
        def wait() -> None:
            with self._arrived:
                assert self._arrived.wait_for(lambda: len(self._seen) >= count, timeout_s), self._seen

        await asyncio.to_thread(wait)

    async def _handle(self, request: Request) -> Response:
        body = await request.body()
        with self._arrived:
            self._seen.append(Seen(time.monotonic(), {k.lower(): v for k, v in request.headers.items()}, body))
            behaviour = self._script.popleft() if self._script else None
            self._arrived.notify_all()
        if isinstance(behaviour, Hold):
            await behaviour.gate.wait(30.0)
            behaviour = behaviour.then
        if isinstance(behaviour, Answer):
            return JSONResponse({"error": {"code": f"scripted_{behaviour.status}", "message": "scripted"}},
                                status_code=behaviour.status, headers=behaviour.headers)
        forward = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with httpx.AsyncClient(timeout=30) as client:
            upstream = await client.post(self.target + UPLOAD_PATH, content=body, headers=forward)
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    def __enter__(self) -> Relay:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()


@pytest.fixture
def relay(service: ServiceProcess) -> Iterator[Relay]:
    with Relay(service.url) as r:
        yield r


# ---------------------------------------------------------------------------------------------- helpers


def sample(step: int, text: str = "answer") -> dict[str, Any]:
    return {
        "step_index": step,
        "messages": [{"role": "user", "content": f"question {step}"}],
        "prompt_ids": [1, 2, 3 + step],
        "response_tokens": [10 + step, 11],
        "logprobs": [-0.5, -0.25],
        "response": {"content": f"{text} {step}", "finish_reason": "stop"},
    }


def stored(service: ServiceProcess, session: str) -> list[dict[str, Any]]:
    """Full views of the session's pending samples, in listing order (oldest first)."""
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as client:
        listing = client.get("/v1/rl/trajectories", params={"status": "pending", "limit": 1000})
        assert listing.status_code == 200, listing.text
        ids = [item["sample_id"] for item in listing.json()["items"] if item["session_id"] == session]
        return [client.get(f"/v1/rl/trajectories/{sample_id}").json() for sample_id in ids]


# ---------------------------------------------------------------------------------------------- the agent loop


async def test_agent_loop_two_sessions_are_stored_judged_and_in_order(redis, service, judge) -> None:
    judge.clear()
    async with TrajectoryUploader(endpoint=service.url, bearer=TOKEN, flush_interval_s=0.05) as uploader:

        async def agent(session: str) -> None:
            rail = RLOnlineRail(uploader, session_id=session, policy_version="base")
            for step in range(3):
                if step:
                    rail.on_user_feedback(f"{session} feedback {step}")
                messages = [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": f"{session} question {step}"}]
                reply = {"role": "assistant", "content": f"{session} answer {step}"}
                sample_id = await rail.on_step(messages, reply, [1, 2, 3 + step], [10 + step, 11], [-0.5, -0.25])
                assert sample_id == f"{session}:{step}"
            await rail.on_session_end()

        await asyncio.gather(agent("loop-a"), agent("loop-b"))

    metrics = uploader.metrics
    assert (metrics.samples_sent, metrics.failed, metrics.dropped, metrics.retried) == (6, 0, 0, 0)
    assert (metrics.samples_lost, metrics.rejected, metrics.judge_failed) == (0, 0, 0)
    assert uploader.pending == 0
    for session in ("loop-a", "loop-b"):
        samples = stored(service, session)
        assert [s["sample_id"] for s in samples] == [f"{session}:0", f"{session}:1", f"{session}:2"]
        assert [s["judge"]["tag"] for s in samples] == ["prev_feedback", "prev_feedback", "session_done"]
        assert [s["turn_num"] for s in samples] == [1, 2, 3]
        for step, s in enumerate(samples):
            assert (s["source"], s["session_id"], s["policy_version"]) == ("rail", session, "base")
            assert s["trajectory"]["prompt_ids"] == [1, 2, 3 + step]
            assert s["trajectory"]["response_ids"] == [10 + step, 11]
            assert s["trajectory"]["response_logprobs"] == [-0.5, -0.25]
            assert s["trajectory"]["response_text"] == f"{session} answer {step}"
            assert s["judge"]["score"] == pytest.approx(0.8)
        # Each reply was judged with the user's next message as its feedback; the last one with none.
        prompts = {step: next(r.prompt for r in judge.requests if f"{session} answer {step}" in r.prompt)
                   for step in range(3)}
        assert f"{session} feedback 1" in prompts[0] and f"{session} feedback 2" in prompts[1]
        assert "(no feedback)" in prompts[2]


async def test_steps_read_from_a_vllm_completion(redis, service) -> None:
    completion = {
        "object": "chat.completion", "model": "tiny", "prompt_token_ids": [5, 6, 7],
        "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [8, 9],
                     "message": {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     "logprobs": {"content": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    async with TrajectoryUploader(endpoint=service.url, bearer=TOKEN, flush_interval_s=0.01) as uploader:
        rail = RLOnlineRail(uploader, session_id="vllm-shaped", trajectory_id="vllm-shaped.t1")
        await rail.on_step([{"role": "user", "content": "call f"}], completion)
        await rail.on_session_end()
    [s] = stored(service, "vllm-shaped")
    assert s["sample_id"] == "vllm-shaped.t1:0"
    assert s["trajectory"]["prompt_ids"] == [5, 6, 7] and s["trajectory"]["response_ids"] == [8, 9]
    assert s["trajectory"]["response_logprobs"] == pytest.approx([-0.1, -0.2])
    assert s["trajectory"]["tool_calls"][0]["function"]["name"] == "f"
    assert s["response"]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------------------------------- back-pressure


async def test_full_queue_blocks_submit_and_refuses_try_submit(redis, service, relay) -> None:
    gate = Gate()
    relay.enqueue(Hold(gate))
    async with TrajectoryUploader(endpoint=relay.url, bearer=TOKEN, max_queue=2, max_batch=1,
                                  flush_interval_s=0) as uploader:
        await uploader.submit("bp", sample(0))
        await relay.wait_for(1)  # the first batch is in flight, held by the relay
        await uploader.submit("bp", sample(1))
        assert uploader.pending == 2
        assert uploader.try_submit("bp", sample(2)) is False
        blocked = asyncio.create_task(uploader.submit("bp", sample(2), session_done=True))
        done, _ = await asyncio.wait({blocked}, timeout=0.3)
        assert not done, "submit returned although the queue was full"
        assert uploader.try_submit("bp", session_done=True) is False  # never overtakes a waiting submit
        gate.open()
        await asyncio.wait_for(blocked, 10)
    metrics = uploader.metrics
    assert (metrics.sent, metrics.samples_sent, metrics.failed, metrics.dropped) == (3, 3, 0, 0)
    samples = stored(service, "bp")
    assert [s["sample_id"] for s in samples] == ["bp:0", "bp:1", "bp:2"]
    assert [s["judge"]["tag"] for s in samples] == ["session_flush", "session_flush", "session_done"]


async def test_close_without_flush_discards_and_wakes_waiters(redis, relay) -> None:
    gate = Gate()
    relay.enqueue(Hold(gate, then=Answer(503)))
    uploader = TrajectoryUploader(endpoint=relay.url, bearer=TOKEN, max_queue=2, max_batch=1, flush_interval_s=0)
    await uploader.start()
    await uploader.submit("discard", sample(0))
    await relay.wait_for(1)
    await uploader.submit("discard", sample(1))
    blocked = asyncio.create_task(uploader.submit("discard", sample(2)))
    await asyncio.wait({blocked}, timeout=0.1)
    await uploader.close(flush=False)
    with pytest.raises(UploaderClosed):
        await blocked
    with pytest.raises(UploaderClosed):
        await uploader.submit("discard", sample(3))
    gate.open()
    metrics = uploader.metrics
    assert (metrics.samples_lost, metrics.sent, uploader.pending) == (2, 0, 0)
    assert len(relay.seen) == 1


# ---------------------------------------------------------------------------------------------- retries


async def test_429_and_5xx_are_retried_with_backoff_and_fresh_signatures(redis, service, relay) -> None:
    relay.enqueue(Answer(429, headers={"Retry-After": "0"}), Answer(503))
    async with TrajectoryUploader(endpoint=relay.url, bearer=TOKEN, sign_key=SIGN_KEY, backoff_first_s=0.05,
                                  backoff_cap_s=1.0) as uploader:
        await uploader.submit("retry", sample(0))
        await uploader.submit("retry", sample(1), session_done=True)  # completes the batch: sent at once
    metrics = uploader.metrics
    assert (metrics.sent, metrics.retried, metrics.failed, metrics.dropped) == (1, 2, 0, 0)
    seen = relay.seen
    assert len(seen) == 3 and len({s.body for s in seen}) == 1  # the same batch each time
    assert seen[1].at - seen[0].at >= 0.05 * 0.5  # first backoff, jittered down to half at most
    assert seen[2].at - seen[1].at >= 0.10 * 0.5  # doubled
    verifier = HmacVerifier(b"k" * 32, agent_keys={"rail-bot": SIGN_KEY.key})
    now_ms = time.time_ns() // 1_000_000
    # Every attempt signed anew (version 3, with the agent key, over POST and the upload path): none is a replay of
    # another.
    assert all(verifier.verify_request("POST", UPLOAD_PATH, s.headers, s.body, now_ms=now_ms)
               == Caller(KeyRole.AGENT, "rail-bot") for s in seen)
    assert all(s.headers["authorization"] == f"Bearer {TOKEN}" for s in seen)
    assert [s["sample_id"] for s in stored(service, "retry")] == ["retry:0", "retry:1"]


async def test_retries_are_capped(redis, relay) -> None:
    relay.enqueue(Answer(503), Answer(502), Answer(500))
    async with TrajectoryUploader(endpoint=relay.url, bearer=TOKEN, max_retries=2, backoff_first_s=0.01,
                                  backoff_cap_s=0.02) as uploader:
        await uploader.submit("capped", sample(0), session_done=True)
    metrics = uploader.metrics
    assert (metrics.sent, metrics.retried, metrics.failed, metrics.samples_lost) == (0, 2, 1, 1)
    assert len(relay.seen) == 3
    assert "failed after 3 attempts: HTTP 500 scripted_500" in (uploader.last_error or "")


async def test_transport_errors_are_retried(redis, service) -> None:
    attempts: list[int] = []

    async def flaky(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        if len(attempts) == 1:
            raise httpx.ConnectError("connection refused", request=request)
        async with httpx.AsyncClient() as real:
            return await real.send(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(flaky))
    async with TrajectoryUploader(endpoint=service.url, bearer=TOKEN, backoff_first_s=0.01,
                                  client=client) as uploader:
        await uploader.submit("transport", sample(0), session_done=True)
    assert not client.is_closed  # a client given to the uploader stays the caller's
    await client.aclose()
    assert (uploader.metrics.retried, uploader.metrics.sent, len(attempts)) == (1, 1, 2)
    assert [s["sample_id"] for s in stored(service, "transport")] == ["transport:0"]


async def test_4xx_is_counted_and_never_retried(redis, service, relay) -> None:
    async with TrajectoryUploader(endpoint=relay.url, bearer=TOKEN, flush_interval_s=0) as uploader:
        bad = sample(0) | {"prompt_ids": [-1]}  # the service refuses the whole batch: 400 invalid_rail_batch
        await uploader.submit("client-error", bad)
        await uploader.flush()
        assert uploader.metrics.dropped == 1
        assert "HTTP 400 invalid_rail_batch" in (uploader.last_error or "")
        await uploader.submit("client-error", sample(1), session_done=True)  # the session goes on
    async with TrajectoryUploader(endpoint=relay.url, bearer="wrong-token") as unauthorized:
        await unauthorized.submit("client-error-2", sample(0), session_done=True)
    assert "HTTP 401 unauthorized" in (unauthorized.last_error or "")
    assert (uploader.metrics.dropped, uploader.metrics.sent, uploader.metrics.retried) == (1, 1, 0)
    assert (uploader.metrics.samples_lost, unauthorized.metrics.dropped, unauthorized.metrics.retried) == (1, 1, 0)
    assert len(relay.seen) == 3  # one attempt each
    assert [s["sample_id"] for s in stored(service, "client-error")] == ["client-error:1"]


async def test_judge_failures_are_reported_not_retried(redis, service, judge) -> None:
    judge.clear()
    judge.enqueue(Status(500))
    async with TrajectoryUploader(endpoint=service.url, bearer=TOKEN) as uploader:
        await uploader.submit("judge-fails", sample(0), session_done=True)
    metrics = uploader.metrics
    assert (metrics.sent, metrics.judge_failed, metrics.retried) == (1, 1, 0)
    assert "sample judge-fails:0: judge failed" in (uploader.last_error or "")
    assert stored(service, "judge-fails") == []


# ---------------------------------------------------------------------------------------------- API misuse


async def test_invalid_items_are_refused_before_queueing() -> None:
    uploader = TrajectoryUploader(endpoint="http://127.0.0.1:9")
    with pytest.raises(RuntimeError, match="start"):
        await uploader.submit("s", sample(0))
    await uploader.start()
    with pytest.raises(ValueError, match="step_index"):
        await uploader.submit("s", {k: v for k, v in sample(0).items() if k != "step_index"})
    with pytest.raises(ValueError, match="session_id"):
        await uploader.submit("bad session", sample(0))
    with pytest.raises(ValueError, match="needs a sample"):
        await uploader.submit("s")
    with pytest.raises(TypeError):
        await uploader.submit("s", sample(0) | {"messages": [{"content": object()}]})
    assert uploader.pending == 0
    await uploader.close()
    with pytest.raises(UploaderClosed):
        await uploader.start()
    with pytest.raises(ValueError):
        TrajectoryUploader(endpoint="ftp://x")
    with pytest.raises(ValueError, match="credentials"):
        TrajectoryUploader(endpoint="http://user:secret@x")
    with pytest.raises(ValueError, match="must be an agent key"):  # an agent never gets the operator key
        TrajectoryUploader(endpoint="http://x", sign_key=SigningKey(b"k" * 32))
    assert "wrong" not in repr(TrajectoryUploader(endpoint="http://x", bearer="wrong"))
