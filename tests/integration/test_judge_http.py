"""JudgeScorer over real HTTP against the fake Judge (CONTRACT §6): votes, retries, length retry, timeouts, auth."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from openjiuwen.agent_evolving.agent_rl.online.errors import JudgeFailed
from openjiuwen.agent_evolving.agent_rl.online.judge import JudgeScorer
from tests.support.fake_judge import Content, Delay, FakeJudge, Hold, Raw, Status, Truncated, Verdict

REQUEST = {
    "model": "policy",
    "messages": [{"role": "user", "content": "What is 2+2?"}],
    "logprobs": True, "top_logprobs": 0, "return_token_ids": True,
}
RESPONSE = {
    "id": "c1", "object": "chat.completion", "prompt_token_ids": [151644, 77777],
    "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        "finish_reason": "stop", "token_ids": [88888, 151645],
        "logprobs": {"content": [{"token": "4", "logprob": -0.031337}]},
    }],
}


@pytest.fixture
async def judge() -> AsyncIterator[FakeJudge]:
    async with FakeJudge() as fake:
        yield fake


def scorer_for(judge: FakeJudge, **kwargs: object) -> JudgeScorer:
    options: dict = {"endpoint": judge.url, "model": "judge-model", "api_key": "sk-test-key", **kwargs}
    return JudgeScorer(**options)


async def score(scorer: JudgeScorer, feedback: str = "correct, thanks") -> object:
    try:
        return await scorer.score(REQUEST, RESPONSE, feedback)
    finally:
        await scorer.aclose()


async def test_success_sends_the_contract_body_and_normalizes_the_score(judge: FakeJudge) -> None:
    judge.enqueue(Verdict(7.5))
    result = await score(scorer_for(judge, endpoint=judge.url + "/v1/"))
    assert (result.score, result.votes, result.judge_model, result.prompt_version) == (
        0.75, [7.5], "judge-model", "judge-v1")
    assert result.as_sample_judge("feedback")["source"] == "judge"
    [sent] = judge.requests
    assert sent.path == "/v1/chat/completions"
    assert sent.body == {"model": "judge-model", "messages": [{"role": "user", "content": sent.prompt}],
                         "temperature": 0.1, "max_tokens": 4096, "stream": False}
    assert sent.authorization == "Bearer sk-test-key"
    assert "[user] What is 2+2?" in sent.prompt and "[assistant] 4" in sent.prompt
    assert "correct, thanks" in sent.prompt


async def test_prompt_holds_no_token_ids_logprobs_or_reasoning(judge: FakeJudge) -> None:
    await score(scorer_for(judge))
    raw = judge.requests[0].raw.decode()
    for leaked in ("151644", "77777", "88888", "151645", "0.031337", "logprob", "token_ids", "add them"):
        assert leaked not in raw


async def test_score_is_the_clamped_mean_of_votes(judge: FakeJudge) -> None:
    judge.enqueue(Verdict(12), Verdict(14), Verdict(16))  # a judge answering outside 0–10 still gives score ≤ 1
    result = await score(scorer_for(judge, votes=3))
    assert result.score == 1.0 and sorted(result.votes) == [12.0, 14.0, 16.0]
    judge.enqueue(Verdict(None, dims={"coherence_score": 2, "tool_usage": 4}))
    assert (await score(scorer_for(judge))).score == pytest.approx(0.3)


async def test_blank_key_sends_empty(judge: FakeJudge) -> None:
    await score(scorer_for(judge, api_key="  "))
    assert judge.requests[0].authorization == "Bearer EMPTY"


@pytest.mark.parametrize("reply", [Raw(), Raw(b'{"choices": []}'), Raw(b'{"id": "x"}'), Raw(b"[1, 2]"),
                                   Content("I would rate it highly."), Content("")])
async def test_unusable_reply_fails_the_vote_without_retry(judge: FakeJudge, reply: object,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    judge.enqueue(reply)
    with caplog.at_level(logging.WARNING), pytest.raises(JudgeFailed):
        await score(scorer_for(judge))
    assert len(judge.requests) == 1  # a 200 that holds no verdict is not transient
    assert "judge vote 1/1 failed" in caplog.text
    assert "sk-test-key" not in caplog.text


async def test_length_retry_doubles_max_tokens_at_temperature_zero(judge: FakeJudge) -> None:
    judge.enqueue(Truncated(), Verdict(6))
    result = await score(scorer_for(judge))
    assert result.votes == [6.0]
    first, second = (r.body for r in judge.requests)
    assert (first["temperature"], first["max_tokens"]) == (0.1, 4096)
    assert (second["temperature"], second["max_tokens"]) == (0, 8192)
    assert second["messages"] == first["messages"]


async def test_length_retry_happens_once_then_the_vote_fails(judge: FakeJudge) -> None:
    judge.enqueue(Truncated(), Truncated(), Verdict(9))
    with pytest.raises(JudgeFailed):
        await score(scorer_for(judge))
    assert len(judge.requests) == 2 and judge.pending == 1


async def test_truncated_but_parsable_reply_is_accepted(judge: FakeJudge) -> None:
    judge.enqueue(Content('{"overall": 5, "reason": "cut', finish_reason="length"))  # no object decodes …
    judge.enqueue(Content('{"overall": 5} and then some', finish_reason="length"))
    result = await score(scorer_for(judge))
    assert result.votes == [5.0] and len(judge.requests) == 2
    judge.clear()
    judge.enqueue(Content('{"overall": 4}', finish_reason="length"))  # … but this one parses: no second request
    assert (await score(scorer_for(judge))).votes == [4.0] and len(judge.requests) == 1


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
async def test_transient_statuses_are_retried_then_succeed(judge: FakeJudge, status: int) -> None:
    judge.enqueue(Status(status), Status(status), Verdict(9))
    result = await score(scorer_for(judge, retries=2))
    assert result.votes == [9.0] and len(judge.requests) == 3


async def test_retries_are_capped(judge: FakeJudge) -> None:
    judge.enqueue(Status(503), Status(503), Verdict(9))
    started = time.monotonic()
    with pytest.raises(JudgeFailed):
        await score(scorer_for(judge, retries=1))
    assert len(judge.requests) == 2 and judge.pending == 1
    assert time.monotonic() - started >= 0.2  # backoff 0.2 s × attempt before the retry


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_other_statuses_fail_the_vote_without_retry(judge: FakeJudge, status: int) -> None:
    judge.enqueue(Status(status), Verdict(9))
    with pytest.raises(JudgeFailed):
        await score(scorer_for(judge, retries=2))
    assert len(judge.requests) == 1


async def test_a_slow_reply_times_out(judge: FakeJudge) -> None:
    judge.enqueue(Delay(2.0, Verdict(9)))
    started = time.monotonic()
    with pytest.raises(JudgeFailed):
        await score(scorer_for(judge, timeout_s=0.2, retries=0))
    assert time.monotonic() - started < 1.5


async def test_a_timeout_is_retried(judge: FakeJudge) -> None:
    judge.enqueue(Delay(2.0, Verdict(1)), Verdict(9))
    result = await score(scorer_for(judge, timeout_s=0.3, retries=1))
    assert result.votes == [9.0] and len(judge.requests) == 2


async def test_transport_errors_are_retried_then_fail() -> None:
    with socket.socket() as s:  # a port nothing listens on: every connect is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scorer = JudgeScorer(endpoint=f"http://127.0.0.1:{port}", model="m", api_key="", retries=1, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(JudgeFailed):
        await score(scorer)
    assert time.monotonic() - started >= 0.2  # the one retry waited its backoff


async def test_majority_tolerates_one_failed_vote_of_three(judge: FakeJudge) -> None:
    judge.enqueue(Verdict(6), Status(400), Verdict(8))
    result = await score(scorer_for(judge, votes=3))
    assert result.score == pytest.approx(0.7)
    assert sorted(result.votes, key=str) == [6.0, 8.0, "fail"]
    assert len(judge.requests) == 3


async def test_majority_fails_with_two_failed_votes_of_three(judge: FakeJudge) -> None:
    judge.enqueue(Verdict(6), Status(400), Raw())
    with pytest.raises(JudgeFailed, match="1 of 3"):
        await score(scorer_for(judge, votes=3))


async def test_min_votes_override(judge: FakeJudge) -> None:
    judge.enqueue(Verdict(6), Status(400), Raw())
    result = await score(scorer_for(judge, votes=3, min_votes=1))
    assert result.votes.count("fail") == 2 and result.score == pytest.approx(0.6)
    judge.enqueue(Verdict(6), Verdict(7), Status(400))
    with pytest.raises(JudgeFailed):
        await score(scorer_for(judge, votes=3, min_votes=3))


async def test_votes_run_concurrently(judge: FakeJudge) -> None:
    gate = judge.gate()
    judge.enqueue(*(Hold(gate, Verdict(5)) for _ in range(3)))
    task = asyncio.create_task(score(scorer_for(judge, votes=3)))
    await judge.wait_for_requests_async(3)  # all three are in flight before any is answered
    assert not task.done()
    gate.open()
    assert (await task).votes == [5.0, 5.0, 5.0]


async def test_injected_client_is_not_closed(judge: FakeJudge) -> None:
    async with httpx.AsyncClient() as client:
        scorer = JudgeScorer(endpoint=judge.url, model="m", api_key="k", client=client)
        await scorer.score(REQUEST, RESPONSE, "")
        await scorer.aclose()
        assert not client.is_closed
        assert "(no feedback)" in judge.requests[0].prompt


@pytest.mark.parametrize("kwargs", [
    {"votes": 0}, {"votes": 3, "min_votes": 4}, {"min_votes": 0}, {"retries": -1}, {"timeout_s": 0},
    {"endpoint": " "}, {"model": ""},
])
def test_constructor_rejects_bad_settings(kwargs: dict) -> None:
    options = {"endpoint": "http://judge", "model": "m", "api_key": "k", **kwargs}
    with pytest.raises(ValueError):
        JudgeScorer(**options)


def test_fake_judge_is_usable_from_sync_code() -> None:
    with FakeJudge(default=Verdict(3)) as fake:
        fake.enqueue(Status(503))
        first = httpx.post(fake.chat_url, json={"model": "m", "messages": []})
        second = httpx.post(fake.chat_url, json={"model": "m", "messages": []})
        assert first.status_code == 503
        assert second.json()["choices"][0]["message"]["content"] == '{"overall": 3, "reason": "fake judge"}'
        assert [r.body["model"] for r in fake.wait_for_requests(2)] == ["m", "m"]


async def test_fake_judge_default_can_choose_per_request(judge: FakeJudge) -> None:
    # Concurrent publications judge samples in no fixed order; a callable default scripts by content instead.
    judge.default = lambda req: Verdict(9 if "[assistant] 4" in req.prompt else 1)
    wrong = {**RESPONSE, "choices": [{"index": 0, "message": {"role": "assistant", "content": "5"}}]}
    scorer = scorer_for(judge)
    try:
        right_result, wrong_result = await asyncio.gather(scorer.score(REQUEST, RESPONSE, ""),
                                                          scorer.score(REQUEST, wrong, ""))
    finally:
        await scorer.aclose()
    assert (right_result.votes, wrong_result.votes) == ([9.0], [1.0])
