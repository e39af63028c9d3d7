"""A vLLM answer far larger than `global.maxUpstreamBodyBytes` is refused without being read, and nothing of it is
captured (issue 28 item 4).

Before the bound, a 300 MB answer took the gateway from 65 MB to 770 MB of resident memory: JSON answers were read
whole, and the SSE line buffer and a captured stream's aggregation grew without end. Here the bound is 1 MiB and a
fake vLLM writes 64 MiB answers as it generates them (JSON, an error answer, a captured OpenAI stream, a captured
Anthropic stream): each is 502 `upstream_too_large` (a stream, already started, ends without its end marker like
any broken stream), the fake is cut off far from its end, the gateway's peak RSS grows by far less than one answer,
and the Task commits no capture. Under the bound everything is served and captured as before, and a stream outside a
Task (relayed, never aggregated) is bounded per event only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis as SyncRedis

from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.system

CHAT = "/v1/chat/completions"
SESSION = "X-Agent-Session-Id"
LIMIT = 1 << 20
HUGE = 64 << 20
ASK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ANTHROPIC = {"model": "tiny", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as v:
        yield v


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the most resident memory the process ever had."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024  # type: ignore[union-attr]


def capture_sets(redis_url: str, t: str) -> dict[str, int]:
    prefix = f"rl:v1:task:{t}:captures"
    with SyncRedis.from_url(redis_url) as sync:
        return {name: sync.scard(key) for name, key in
                (("all", prefix), ("open", prefix + ":open"), ("committed", prefix + ":committed"))}


def error_of(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def test_a_far_larger_answer_is_refused_unread_and_nothing_is_captured(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm], global_overrides={"maxUpstreamBodyBytes": LIMIT}) as gw:
        gw.start_service()
        t = gw.start_task("s-big").json()["rl_task_id"]
        captured = {SESSION: "s-big"}
        assert gw.http.post(CHAT, json=ASK, headers=captured).status_code == 200  # warm: the baseline has served
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        t = gw.start_task("s-big").json()["rl_task_id"]
        baseline = peak_rss_bytes(gw.proc.pid)

        for headers, what in ((captured, "captured JSON"), ({}, "bypass JSON")):
            vllm.bloat_next(HUGE)
            assert error_of(gw.http.post(CHAT, json=ASK, headers=headers)) == (502, "upstream_too_large"), what
        vllm.bloat_next(HUGE, status=500)
        assert error_of(gw.http.post(CHAT, json=ASK, headers=captured)) == (502, "upstream_too_large")
        vllm.bloat_next(HUGE)
        r = gw.http.post(CHAT, json={**ASK, "stream": True}, headers=captured)
        assert r.status_code == 200 and "data: " in r.text and "[DONE]" not in r.text  # ended like a broken stream
        vllm.bloat_next(HUGE)
        r = gw.http.post("/v1/messages", json=ANTHROPIC, headers=captured)
        assert r.status_code == 200 and "message_start" in r.text and "message_stop" not in r.text

        # Every answer was cut off far from its end, and none of them was held: the peak grew by a few MiB.
        sent = wait_for(lambda: vllm.bloat_sent if len(vllm.bloat_sent) == 5 else None, what="the five answers end")
        assert all(s < HUGE // 4 for s in sent), sent
        grown = peak_rss_bytes(gw.proc.pid) - baseline
        print(f"peak RSS {baseline >> 20} MiB before, grown by {grown / (1 << 20):.1f} MiB")
        assert grown < 24 << 20, f"peak RSS grew by {grown >> 20} MiB for 64 MiB answers"
        assert "vLLM instance vllm-a answered more than 1048576 bytes" in gw.stderr()

        # Nothing of them was captured; the Task stayed active and ends with no sample.
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert capture_sets(redis_url, t) == {"all": 0, "open": 0, "committed": 0}

        # Under the bound: served and captured as before.
        t = gw.start_task("s-ok").json()["rl_task_id"]
        vllm.bloat_next(LIMIT // 2)
        r = gw.http.post(CHAT, json=ASK, headers={SESSION: "s-ok"})
        assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) > LIMIT // 4
        vllm.bloat_next(LIMIT // 2)
        r = gw.http.post(CHAT, json={**ASK, "stream": True}, headers={SESSION: "s-ok"})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert capture_sets(redis_url, t)["committed"] == 2
        assert "unhandled error" not in gw.stderr() and "unhandled error" not in gw.rl_log()


def test_outside_a_task_a_stream_is_bounded_per_event_only(redis, redis_url, tmp_path, vllm):
    """Relayed, never aggregated: a long stream of small events passes whole; one event past the bound ends it."""
    with GatewayProcess(tmp_path, redis_url, instances=[vllm], global_overrides={"maxUpstreamBodyBytes": LIMIT}) as gw:
        vllm.bloat_next(4 * LIMIT)
        r = gw.http.post(CHAT, json={**ASK, "stream": True})
        assert r.status_code == 200 and len(r.content) > 2 * LIMIT and r.text.endswith("data: [DONE]\n\n")
        giant = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "' + b"x" * (2 * LIMIT) + b'"}}]}\n\n'
        vllm.fail_next(CHAT, 200, body=giant + b"data: [DONE]\n\n", content_type="text/event-stream")
        r = gw.http.post(CHAT, json={**ASK, "stream": True})
        assert r.status_code == 200 and "[DONE]" not in r.text and len(r.content) < LIMIT
        assert "EventTooLarge" in gw.stderr()


def test_an_error_inside_a_stream_ends_it_and_commits_nothing(redis, redis_url, tmp_path, vllm):
    """Outside a Task the stream is no longer aggregated, so the in-stream error check moved out of the aggregator:
    captured or not, an error chunk ends the stream without its end marker, and the capture is not committed."""
    error = b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n'
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        t = gw.start_task("s-err").json()["rl_task_id"]
        for headers in ({SESSION: "s-err"}, {}):
            vllm.fail_next(CHAT, 200, body=error + b"data: [DONE]\n\n", content_type="text/event-stream")
            r = gw.http.post(CHAT, json={**ASK, "stream": True}, headers=headers)
            assert r.status_code == 200 and "[DONE]" not in r.text, headers
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert capture_sets(redis_url, t)["committed"] == 0
